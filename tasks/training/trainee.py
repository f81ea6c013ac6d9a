"""Build what the training loop trains: a model, its tokenizer and the strategy assembled for them.

A strategy that trains the backbone (`trains == "denoiser"`) gets a tiny model built from `model:`
or a pretrained checkpoint, optional LoRA adapters and activation checkpointing, wrapped in the
strategy's model shape. A strategy that trains a draft (DFlash) gets its draft and frozen target from the
speculative wing's builders (`tasks.speculative.setup`), assembled here (`draft_trainee`).

The train stage and `dllm-flow plan` build with the same functions, `assembled_denoiser` and `assembled_draft`
(docs/planning.md): what only a stage has is an argument (the data stage's tokenizer, or `TokenIds` where there is
none; the target model; a config to build from without reading weights), and they build on whatever device and
tensor mode they are called under (the planner's: fake tensors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dllm_common.config import ConfigError, PipelineSpec
from strategies import assemble_strategy, strategy_class
from strategies.assembly import candidate_mask_token_id
from strategies.dflash.features import CachedFeatures
from strategies.head import make_head_deferrable
from strategies.models import (
    BIDIRECTIONAL_MASK,
    NATIVE,
    add_lora,
    build_model,
    enable_activation_checkpointing,
    load_pretrained,
    resolve_model_path,
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


@dataclass(frozen=True)
class TokenIds:
    """What the builders read from a tokenizer: its length and its special ids. `dllm-flow plan` builds with these
    in place of the data stage's tokenizer, which a plan does not have (docs/planning.md)."""

    size: int
    mask_token_id: int | None = None
    pad_token_id: int | None = 0
    eos_token_id: int | None = 1
    bos_token_id: int | None = None

    def __len__(self) -> int:
        return self.size

    @classmethod
    def planned(cls, options, size: int) -> TokenIds:
        """A vocabulary of `size` whose [MASK] is the configured id, else its last row (where the mask sits does not
        change what a step costs)."""
        return cls(size, int(options.mask_token_id) if options.mask_token_id is not None else size - 1)


# ------------------------------------------------------------------ the model a denoiser trains


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


def own_shape(name: str, options):
    """The model shape `train[name]` trains when it is a transformers model of its own, built from `model:` or its
    checkpoint rather than wrapped around a backbone (block_diffusion's DiffusionGemma); else None."""
    architecture = model_architecture(name, options)
    shape = model_shape(architecture) if architecture is not None else None
    return shape if hasattr(shape, "from_model_spec") else None


def pretrained_config(path: str, key: str, trust_remote_code: bool = False, gguf_file: str | None = None):
    """A pretrained model's config alone (by path, `package:NAME` or a hub id already in the local cache; never its
    weights); a hub id that is not in the local cache (offline) is one clear error naming `key`."""
    where = resolve_model_path(path)
    kwargs = {"trust_remote_code": trust_remote_code, **({"gguf_file": gguf_file} if gguf_file else {})}
    try:
        return AutoConfig.from_pretrained(where, **kwargs)
    except OSError as exc:
        if Path(where).exists():
            raise ConfigError(f"{key} {path!r}: no readable config.json there ({exc})") from None
        raise ConfigError(
            f"{key} {path!r} is neither a local directory nor a hub id in the local cache (HF_HUB_OFFLINE is on): "
            "download its config.json once, or give the directory that holds it"
        ) from None


def model_config(spec: PipelineSpec, name: str, options, tokenizer):
    """The config of the model `train[name]` trains, no weight read: the tiny one `model:` sizes for `tokenizer`'s
    vocabulary (and special ids, for a model of its own), or the checkpoint's config.json at `model.path`."""
    m, shape = spec.model, own_shape(name, options)
    if m.kind == "tiny":
        return shape.tiny_config(spec, tokenizer, options) if shape is not None else tiny_config(spec, len(tokenizer))
    config = pretrained_config(m.path, "model.path", m.trust_remote_code, None if shape is not None else m.gguf_file)
    if shape is not None:
        try:
            shape.check_checkpoint_config(config, m.path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    config._attn_implementation = m.attn_implementation
    return config


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside this block are built in `dtype` (a fake module cannot be cast after: `.to` swaps)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def model_from_config(spec: PipelineSpec, name: str, options, config):
    """The module `config` describes, no weight read: a tiny one initialized from `train.seed`; a pretrained one in
    `model.dtype`, its weights as initialized (what `dllm-flow plan` builds, on fake tensors)."""
    m, shape = spec.model, own_shape(name, options)
    if shape is None and m.kind == "tiny":
        return build_model(config, spec.train.seed)
    if shape is not None:
        dtype = torch.float32 if m.kind == "tiny" else getattr(torch, m.dtype)
        with default_dtype(dtype), torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.train.seed)
            return shape.from_config(config)
    model = AutoModelForCausalLM.from_config(
        config, trust_remote_code=m.trust_remote_code, dtype=getattr(torch, m.dtype)
    )
    native = m.trust_remote_code and getattr(config, "auto_map", None)  # remote-code dLLMs attend on their own
    model.config.dllm_attention = NATIVE if native else BIDIRECTIONAL_MASK
    return model


def denoiser_model(spec: PipelineSpec, name: str, options, tokenizer, config=None):
    """The module `train[name]` trains, before its adapters and strategy: a tiny one from `model:`, or the
    checkpoint at `model.path` with its weights. `config`: built from it alone, no weight read (`dllm-flow plan`
    passes one of fewer layers to trace a deep model)."""
    if config is not None or spec.model.kind == "tiny":
        config = config if config is not None else model_config(spec, name, options, tokenizer)
        return model_from_config(spec, name, options, config)
    shape = own_shape(name, options)
    if shape is not None:
        return shape.from_model_spec(spec, tokenizer, options, spec.train.seed)
    return backbone(spec, tokenizer)


def assembled_denoiser(spec: PipelineSpec, name: str, options, tokenizer, config=None) -> Trainee:
    """`train[name]`'s trainee as `train:` sets it up, uncompiled, where it was built: the model (`denoiser_model`),
    its LoRA adapters and activation checkpointing, the strategy's model shape, the strategy assembled for
    `tokenizer` (the data stage's, or `TokenIds`) and the fused head."""
    model = denoiser_model(spec, name, options, tokenizer, config)
    if spec.train.peft is not None:  # adapters on the backbone; strategy-owned modules stay trainable
        p = spec.train.peft
        add_lora(model, r=p.r, alpha=p.alpha, dropout=p.dropout, target_modules=p.target_modules)
    if spec.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    if own_shape(name, options) is None and getattr(model.config, "dllm_attention", None) != NATIVE:
        mask_id = candidate_mask_token_id(options, tokenizer)  # remote-code dLLMs (NATIVE) keep their own shape
        model = wrap_for_architecture(model, model_architecture(name, options), mask_token_id=mask_id)
    built = assemble_strategy(name, options, model, tokenizer)
    fused = spec.train.fused_head and make_head_deferrable(model, spec.train.head_chunk_rows)
    return Trainee.assembled(model, tokenizer, built, spec.train.precision, fused_head=bool(fused))


def denoiser_trainee(spec: PipelineSpec, name: str, data: StageRef, device: str) -> Trainee:
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    trainee = assembled_denoiser(spec, name, resolve_options(spec, name), tokenizer)
    mask_id = trainee.mask_token_id if strategy_class(name).uses_mask_token else None
    refuse_mask_alias(spec, tokenizer, {f"the mask token id train[{name}] resolves": mask_id})
    set_token_ids(trainee.model.config, tokenizer, mask_id)  # what every folder saved from it names
    if spec.train.compile:
        compile_layers(trainee.model)
    trainee.model.to(device)
    return trainee


def build_trainee(spec: PipelineSpec, name: str, data: StageRef, device: str, inputs: dict | None = None) -> Trainee:
    """The model, tokenizer and assembled strategy `train[name]` trains (`inputs`: its upstream stages)."""
    check_capabilities(spec, name)
    if strategy_class(name).trains == "draft":
        return draft_trainee(spec, name, data, device, inputs or {})
    return denoiser_trainee(spec, name, data, device)


# ------------------------------------------------------------------ the draft a DFlash strategy trains


def draft_options(spec: PipelineSpec, name: str):
    """`train[name]`'s options: the draft setup's, resolved once per config, when it is the strategy that trains the
    draft."""
    setup = DraftSetup.of(spec)
    return setup.options if setup.strategy == name else resolve_options(spec, name)


def assembled_draft(
    spec: PipelineSpec, name: str, target, target_ref: StageRef, tokenizer, *, cache=None, weights: bool = True
) -> Trainee:
    """`train[name]`'s trainee, uncompiled, where it was built: the draft (new from `model:`, or imported from
    `model.path`, checked against `target`) and its strategy over the frozen `target` (`target_ref`: its stage
    entry) and `cache` (the target's cached features; None: a target forward). `tokenizer`: the data stage's, or
    `TokenIds`. `weights=False`: an imported draft from its config alone (`dllm-flow plan`)."""
    setup = DraftSetup.of(spec)  # the options and an imported draft's config, resolved and read once
    options = draft_options(spec, name)
    if spec.model.kind == "pretrained":  # continued, or (train.steps: 0) published as it is to be evaluated
        draft = import_draft(spec, options, target, setup if setup.strategy == name else None, weights=weights)
        mask_id = draft.config.mask_token_id
    else:
        mask_id = candidate_mask_token_id(options, tokenizer)
        check_mask_row(mask_id, target)
        fields = new_draft_fields(spec, options)
        draft = new_draft(spec, target, target_ref, options.block_size, mask_id, options.copy_hint, fields)
    for key, value in tokenizer_token_ids(tokenizer).items():  # the tokenizer's, whatever the target's config says
        setattr(draft.config, key, value)
    built = draft_strategy(name, options, draft, target, mask_token_id=mask_id, cache=cache)
    return Trainee.assembled(draft, tokenizer, built, spec.train.precision)


def draft_trainee(spec: PipelineSpec, name: str, data: StageRef, device: str, inputs: dict) -> Trainee:
    """What `train[name]` trains: the draft, against the target stage's model and (cached) features."""
    if "target" not in inputs:
        raise ValueError(
            f"train[{name}] needs its target stage: run it through the pipeline "
            f"(pretrain_target / target → cache_target → train[{name}])"
        )
    if draft_options(spec, name).attention_backend == "flex_attention" and not str(device).startswith("cuda"):
        raise ValueError(
            "dflash.attention_backend 'flex_attention' trains on CUDA only (flex attention has no CPU "
            "backward in torch 2.13); use 'sdpa' here"
        )
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    target = load_spec_target(spec, inputs["target"].info["model_path"], device)
    cache = CachedFeatures(features_dir(inputs["features"])) if "features" in inputs else None
    trainee = assembled_draft(spec, name, target, inputs["target"], tokenizer, cache=cache)
    mask_id = trainee.model.config.mask_token_id
    refuse_mask_alias(spec, tokenizer, {f"the mask token id train[{name}] resolves": mask_id})
    path = inputs["target"].info["model_path"]
    check_served_before_training(spec.tokenizer.allow_mask_alias, spec.chat_rows, tokenizer, target, path, mask_id)
    if spec.train.compile:
        compile_layers(trainee.model)
    trainee.model.to(device)
    return trainee
