"""Build what the training loop trains: a model, its tokenizer and the strategy assembled for them.

A strategy that trains the backbone (`trains == "denoiser"`) gets a tiny model built from `model:`
or a pretrained checkpoint, optional LoRA adapters and activation checkpointing, wrapped in the
strategy's model shape. A strategy that trains a draft (DFlash) gets its draft and frozen target from the
speculative wing's builders (`tasks.speculative.setup`), assembled here (`draft_trainee`).
"""

from __future__ import annotations

from pathlib import Path

from dllm_common.config import PipelineSpec
from strategies import assemble_strategy, strategy_class
from strategies.assembly import candidate_mask_token_id
from strategies.dflash.features import CachedFeatures
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
    tokenizer_token_ids,
    wrap_for_architecture,
)
from strategies.options import resolve_options
from strategies.registry import model_shape
from tasks.common import StageRef
from tasks.data.tokenizer import load_tokenizer, refuse_mask_alias
from tasks.speculative.setup import (
    DraftSetup,
    check_mask_row,
    check_served_before_training,
    draft_strategy,
    features_dir,
    import_draft,
    load_spec_target,
    new_draft,
    new_draft_fields,
)
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
        return draft_trainee(spec, name, data, device, inputs or {})
    return denoiser_trainee(spec, name, data, device)


def draft_trainee(spec: PipelineSpec, name: str, data: StageRef, device: str, inputs: dict) -> Trainee:
    """What `train[name]` trains: the draft, against the target stage's model and (cached) features."""
    if "target" not in inputs:
        raise ValueError(
            f"train[{name}] needs its target stage: run it through the pipeline "
            f"(pretrain_target / target → cache_target → train[{name}])"
        )
    setup = DraftSetup.of(spec)  # the options and an imported draft's config, resolved and read once
    options = setup.options if setup.strategy == name else resolve_options(spec, name)
    if options.attention_backend == "flex_attention" and not str(device).startswith("cuda"):
        raise ValueError(
            "dflash.attention_backend 'flex_attention' trains on CUDA only (flex attention has no CPU "
            "backward in torch 2.13); use 'sdpa' here"
        )
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    target = load_spec_target(spec, inputs["target"].info["model_path"], device)
    if spec.model.kind == "pretrained":  # continued, or (train.steps: 0) published as it is to be evaluated
        draft = import_draft(spec, options, target, setup if setup.strategy == name else None)
        mask_id = draft.config.mask_token_id
    else:
        mask_id = candidate_mask_token_id(options, tokenizer)
        check_mask_row(mask_id, target)
        fields = new_draft_fields(spec, options)
        draft = new_draft(spec, target, inputs["target"], options.block_size, mask_id, options.copy_hint, fields)
    refuse_mask_alias(spec, tokenizer, {f"the mask token id train[{name}] resolves": mask_id})
    check_served_before_training(
        spec.tokenizer.allow_mask_alias,
        spec.chat_rows,
        tokenizer,
        target,
        inputs["target"].info["model_path"],
        mask_id,
    )
    for key, value in tokenizer_token_ids(tokenizer).items():  # the tokenizer's, whatever the target's config says
        setattr(draft.config, key, value)
    cache = CachedFeatures(features_dir(inputs["features"])) if "features" in inputs else None
    built = draft_strategy(name, options, draft, target, mask_token_id=mask_id, cache=cache)
    if spec.train.compile:
        compile_layers(draft)
    return Trainee.assembled(draft.to(device), tokenizer, built, spec.train.precision)
