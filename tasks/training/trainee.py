"""Build what the training loop trains: a model, its tokenizer and the strategy assembled for them.

A strategy that trains the backbone (`trains == "denoiser"`) gets a tiny model built from `model:`
or a pretrained checkpoint, optional LoRA adapters and activation checkpointing, wrapped in the
strategy's model shape. A strategy that trains a draft (DFlash) is assembled in `tasks.training.dflash_setup`.
"""

from __future__ import annotations

from pathlib import Path

from dllm_common.config import PipelineSpec
from strategies import assemble_strategy, strategy_class
from strategies.assembly import candidate_mask_token_id
from strategies.head import make_head_deferrable
from strategies.models import (
    NATIVE,
    add_lora,
    build_model,
    enable_activation_checkpointing,
    load_pretrained,
    set_token_ids,
    tiny_model_config,
    tiny_shape,
    wrap_for_architecture,
)
from strategies.options import resolve_options
from strategies.registry import model_shape
from tasks.common import StageRef
from tasks.data.tokenizer import load_tokenizer, refuse_mask_alias
from tasks.training import dflash_setup
from tasks.training.runtime import Trainee, compile_layers


def check_capabilities(spec: PipelineSpec, name: str) -> None:
    """Refuse `train:` settings the strategy cannot honour, before anything is built."""
    cls = strategy_class(name)
    if spec.train.activation_checkpointing and not cls.supports_activation_checkpointing:
        raise ValueError(f"train.activation_checkpointing is not supported with {name}; set it to false")
    if spec.train.peft is not None and not cls.supports_peft:
        raise ValueError(f"train.peft does not apply to {name} (it trains a small draft from scratch); unset it")


def tiny_config(spec: PipelineSpec, vocab_size: int):
    """The config of the tiny model `model:` describes, for a vocabulary of `vocab_size`."""
    m = spec.model
    return tiny_model_config(m.family, *tiny_shape(spec, vocab_size), m.tie_embeddings, m.attn_implementation)


def backbone(spec: PipelineSpec, tokenizer):
    """The model `model:` describes: a tiny one built from its shape, or a pretrained checkpoint."""
    m = spec.model
    if m.kind == "tiny":
        return build_model(tiny_config(spec, len(tokenizer)), spec.train.seed)
    return load_pretrained(
        m.path,
        dtype=m.dtype,
        trust_remote_code=m.trust_remote_code,
        gguf_file=m.gguf_file,
        attn_implementation=m.attn_implementation,
    )


def model_architecture(name: str, options) -> str | None:
    """The model shape strategy `name` trains with `options` (a strategy whose options choose it says so)."""
    cls = strategy_class(name)
    choose = getattr(cls, "model_architecture_for", None)
    return choose(options) if choose is not None else cls.model_architecture


def denoiser_trainee(spec: PipelineSpec, name: str, data: StageRef, device: str) -> Trainee:
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    options = resolve_options(spec, name)
    architecture = model_architecture(name, options)
    builds_itself = architecture is not None and hasattr(model_shape(architecture), "from_model_spec")
    if builds_itself:  # a shape that is a transformers model of its own (block_diffusion's DiffusionGemma)
        model = model_shape(architecture).from_model_spec(spec, tokenizer, options, spec.train.seed)
    else:
        model = backbone(spec, tokenizer)
    if spec.train.peft is not None:  # adapters on the backbone; strategy-owned modules stay trainable
        p = spec.train.peft
        add_lora(model, r=p.r, alpha=p.alpha, dropout=p.dropout, target_modules=p.target_modules)
    if spec.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    if not builds_itself and getattr(model.config, "dllm_attention", None) != NATIVE:  # remote-code dLLMs: own shape
        mask_id = candidate_mask_token_id(options, tokenizer)
        model = wrap_for_architecture(model, architecture, mask_token_id=mask_id)
    built = assemble_strategy(name, options, model, tokenizer)
    mask_id = built.mask_token_id if strategy_class(name).uses_mask_token else None
    refuse_mask_alias(spec, tokenizer, {f"the mask token id train[{name}] resolves": mask_id})
    set_token_ids(model.config, tokenizer, mask_id)  # what every folder saved from it names
    fused = spec.train.fused_head and make_head_deferrable(model, spec.train.head_chunk_rows)
    if spec.train.compile:
        compile_layers(model)
    return Trainee.assembled(model.to(device), tokenizer, built, spec.train.precision, fused_head=fused)


def build_trainee(spec: PipelineSpec, name: str, data: StageRef, device: str, inputs: dict | None = None) -> Trainee:
    """The model, tokenizer and assembled strategy `train[name]` trains (`inputs`: its upstream stages)."""
    check_capabilities(spec, name)
    if strategy_class(name).trains == "draft":
        return dflash_setup.draft_trainee(spec, name, data, device, inputs or {})
    return denoiser_trainee(spec, name, data, device)
