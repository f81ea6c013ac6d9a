"""The model `dllm-flow plan` traces, built as training builds it but from configs alone: fake weights, no
checkpoint read (a tiny model from `model:`, a pretrained one from its `config.json`, a DFlash draft and target)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from dllm_common.config import ConfigError, PipelineSpec
from strategies import Microbatch, assemble_strategy, strategy_class
from strategies.dflash.draft import DFlashDraftModel
from strategies.dflash.features import TargetOutputs
from strategies.dflash.loss import SoftLabels
from strategies.head import make_head_deferrable
from strategies.models import (
    BIDIRECTIONAL_MASK,
    NATIVE,
    add_lora,
    backbone_lm,
    build_model,
    enable_activation_checkpointing,
    resolve_model_path,
    wrap_for_architecture,
)
from strategies.options import resolve_options
from strategies.registry import model_shape
from tasks.commands.plan.trace import _Tracer
from tasks.common import StageRef
from tasks.data.tokenizer import load_tokenizer
from tasks.speculative import setup as dflash_setup
from tasks.speculative.target import new_target
from tasks.training.runtime import Trainee
from tasks.training.trainee import model_architecture, tiny_config

# ------------------------------------------------------------------ the model, built fake


@dataclass(frozen=True)
class Shape:
    """What is planned: one strategy at one setting of the two memory switches, `rows` rows per micro-batch."""

    fused_head: bool
    checkpointing: bool
    rows: int


def model_config(spec: PipelineSpec, vocab_size: int):
    """The backbone's config as training builds it: `model:` for a tiny one, a pretrained one's config.json
    (by path, `package:NAME` or a hub id already in the local cache; never its weights)."""
    m = spec.model
    if m.kind == "tiny":
        return tiny_config(spec, vocab_size)
    config = pretrained_config(m.path, "model.path", m.trust_remote_code, m.gguf_file)
    config._attn_implementation = m.attn_implementation
    return config


def pretrained_config(path: str, key: str, trust_remote_code: bool = False, gguf_file: str | None = None):
    """A pretrained model's config alone; a hub id that is not in the local cache (offline) is one clear error."""
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


def vocab_size(spec: PipelineSpec) -> int:
    """The tokenizer's size: `tokenizer.vocab_size` for one trained on the data (the size it is trained to; a
    small corpus may give fewer), else the pretrained tokenizer's length."""
    t = spec.tokenizer
    if t.kind == "train_bpe":
        return t.vocab_size
    try:
        return len(load_tokenizer(t.path, t.trust_remote_code, t.gguf_file))
    except OSError as exc:
        raise ConfigError(f"tokenizer.path {t.path!r}: no tokenizer there or in the local cache ({exc})") from None


def _truncated(config, layers: int):
    """A copy of `config` with `layers` decoder layers (per-layer lists, e.g. `layer_types`, cut to match)."""
    config = type(config).from_dict(config.to_dict())
    total = config.num_hidden_layers
    for key, value in vars(config).items():
        if isinstance(value, list) and len(value) == total and key != "architectures":
            setattr(config, key, value[:layers])
    config.num_hidden_layers = layers
    config._attn_implementation = getattr(config, "_attn_implementation", "sdpa")
    return config


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated layers of a backbone (in a strategy's wrapper or not) or of a DFlash draft."""
    lm = backbone_lm(model)
    layers = getattr(lm, "layers", None)
    if layers is None and hasattr(lm.model, "decoder"):  # DiffusionGemma: the encoder's layers are the same ones
        return lm.model.decoder.layers
    return layers if layers is not None else lm.model.layers


class _Stub:
    """What a strategy reads from a tokenizer while it is assembled: the special ids and the length."""

    def __init__(self, size: int, mask_token_id: int | None):
        self.size, self.mask_token_id, self.pad_token_id, self.eos_token_id = size, mask_token_id, 0, 1
        self.bos_token_id = None

    def __len__(self) -> int:
        return self.size


def _mask_id(options, vocab: int) -> int:
    """The configured mask id, else the last row of the embedding (where the mask sits does not change cost)."""
    return int(options.mask_token_id) if options.mask_token_id is not None else vocab - 1


@dataclass
class _Built:
    trainee: Trainee
    layers: int  # decoder layers of the trained module as configured


class _Builder:
    """Builds, under one `_Tracer`, the trained module of a strategy the way `tasks.training.trainee` does, but from
    configs only: fake weights, no checkpoint read."""

    def __init__(self, spec: PipelineSpec, name: str, tracer: _Tracer):
        self.spec, self.name, self.tracer = spec, name, tracer
        self.cls = strategy_class(name)
        self.options = resolve_options(spec, name)
        # a shape that is a transformers model of its own (block_diffusion's DiffusionGemma) is built as training
        # builds it, and traced at its full depth: its layers differ (sliding and full attention, wider global heads)
        architecture = model_architecture(name, self.options)
        shape = model_shape(architecture) if architecture is not None else None
        self.own_model = shape if hasattr(shape, "from_model_spec") else None
        self.vocab = vocab_size(spec) if spec.model.kind == "tiny" or self.cls.trains == "draft" else None
        self.draft = self.cls.trains == "draft"
        self._config = None
        if self.own_model is not None:
            self._config = self._own_config()
        elif not self.draft:
            self._config = model_config(spec, self.vocab or 0)
        if self._config is not None and self.vocab is None:
            self.vocab = int(self._config.get_text_config().vocab_size)
        full_depth = self._config is None or self.own_model is not None
        self.depth = None if full_depth else self._config.num_hidden_layers
        self.deferrable = False  # whether the fused head applies: a plain linear LM head (a draft has none)
        self.frozen: nn.Module | None = None

    def _own_config(self):
        """The config of a model that builds itself: sized from `model:` (tiny), or a checkpoint's config.json."""
        m = self.spec.model
        if m.kind == "tiny":
            return self.own_model.tiny_config(self.spec, _Stub(self.vocab, None), self.options)
        config = pretrained_config(m.path, "model.path", m.trust_remote_code)
        try:
            self.own_model.check_checkpoint_config(config, m.path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        config._attn_implementation = m.attn_implementation
        return config

    def supports(self, checkpointing: bool) -> bool:
        return not checkpointing or self.cls.supports_activation_checkpointing

    def build(self, fused: bool, checkpointing: bool, layers: int | None = None) -> Trainee:
        with self.tracer, torch.random.fork_rng(devices=[]):
            if self.draft:
                return self._draft()
            return self._denoiser(fused, checkpointing, layers)

    def _denoiser(self, fused: bool, checkpointing: bool, layers: int | None) -> Trainee:
        spec, m = self.spec, self.spec.model
        config = self._config if layers is None else _truncated(self._config, layers)
        if self.own_model is not None:
            with _default_dtype(getattr(torch, m.dtype) if m.kind == "pretrained" else torch.float32):
                model = self.own_model.from_config(config)
        elif m.kind == "tiny":
            model = build_model(config, spec.train.seed)
        else:
            native = m.trust_remote_code and getattr(config, "auto_map", None)
            model = AutoModelForCausalLM.from_config(
                config, trust_remote_code=m.trust_remote_code, dtype=getattr(torch, m.dtype)
            )
            model.config.dllm_attention = NATIVE if native else BIDIRECTIONAL_MASK
        if spec.train.peft is not None:
            p = spec.train.peft
            with _moves_by_replacement():  # PEFT moves each new adapter beside its layer with `Module.to`
                add_lora(model, r=p.r, alpha=p.alpha, dropout=p.dropout, target_modules=p.target_modules)
        if checkpointing:
            enable_activation_checkpointing(model)
        mask_id = _mask_id(self.options, self.vocab)
        if self.own_model is None and getattr(model.config, "dllm_attention", None) != NATIVE:
            model = wrap_for_architecture(model, self.cls.model_architecture, mask_token_id=mask_id)
        built = assemble_strategy(self.name, self.options, model, _Stub(self.vocab, mask_id))
        head = make_head_deferrable(model, spec.train.head_chunk_rows) if fused else False
        self.deferrable = head or not fused and self.deferrable
        return Trainee.assembled(model, None, built, spec.train.precision, fused_head=head)

    def _draft(self) -> Trainee:
        """A DFlash draft against its frozen target: the target from `dflash.target_model_id`'s config or the one
        `pretrain_target` would train; the features from the cache (fake, in the cache's dtype) or the target."""
        spec, d = self.spec, self.spec.dflash
        with _default_dtype(getattr(torch, d.target_torch_dtype)):  # built in its dtype (a fake module cannot `.to`)
            if d.target_model_id is None:
                target = new_target(spec, self.vocab)
            else:
                config = pretrained_config(
                    d.target_model_id, "dflash.target_model_id", d.target_trust_remote_code, d.target_gguf_file
                )
                target = AutoModelForCausalLM.from_config(config, trust_remote_code=d.target_trust_remote_code)
        target = target.eval().requires_grad_(False)
        self.vocab = int(target.config.vocab_size)
        mask_id = _mask_id(self.options, self.vocab)
        ref = StageRef("target", "plan", "", info={"num_layers": target.config.num_hidden_layers})
        options = self.options
        if spec.model.kind == "pretrained":
            draft = DFlashDraftModel.from_config_dir(resolve_model_path(spec.model.path))
            options = self.cls.complete_options(options, draft)
        else:
            size = options.block_size or 2
            fields = dflash_setup.new_draft_fields(spec, options)  # DFlash 2's shapes, the attention's (§10.12)
            draft = dflash_setup.new_draft(spec, target, ref, size, mask_id, options.copy_hint, fields)
        cached = d.target_features == "cached"
        cache = _FakeFeatures(draft.config, options.distill_top_k, d.cache_dtype) if cached else None
        built = dflash_setup.draft_strategy(self.name, options, draft, target, mask_token_id=mask_id, cache=cache)
        self.frozen = target
        return Trainee.assembled(draft, None, built, spec.train.precision)


@contextlib.contextmanager
def _moves_by_replacement() -> Iterator[None]:
    """Inside this block `Module.to` (`_apply`) replaces each tensor it changes with the moved one. Torch swaps a
    fake parameter in place instead, which a fake-tensor mode's weak reference to it makes fail ("Couldn't swap");
    replacing is what a real module's `.to` amounts to. For modules that share no tensor with another (a new
    adapter): a tied weight would be replaced on one side only."""
    original = nn.Module._apply

    def apply(module: nn.Module, fn, recurse: bool = True) -> nn.Module:
        for child in module.children() if recurse else ():
            apply(child, fn)
        with torch.no_grad():
            for key, param in module._parameters.items():
                if param is not None and (moved := fn(param)) is not param:
                    module._parameters[key] = nn.Parameter(moved, param.requires_grad)
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = fn(buffer)
        return module

    nn.Module._apply = apply
    try:
        yield
    finally:
        nn.Module._apply = original


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class _FakeFeatures:
    """A feature cache that holds nothing: each micro-batch's target features are made in the traced step, in the
    cache's shape and dtype (what `CachedFeatures` reads from its shards and moves to the device)."""

    def __init__(self, draft_config, top_k: int, dtype: str):
        self.layer_ids, self.top_k = list(draft_config.target_layer_ids), top_k
        self.width = draft_config.num_target_features * draft_config.hidden_size  # the draft is as wide as its target
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]

    def __call__(self, mb: Microbatch, labels: bool = False) -> TargetOutputs:
        b, length = mb.input_ids.shape
        top = None
        if labels and self.top_k:
            ids = torch.zeros(b, length, self.top_k, dtype=torch.int32)
            top = SoftLabels(ids, torch.full((b, length, self.top_k), 1.0 / self.top_k))
        return TargetOutputs(torch.zeros(b, length, self.width, dtype=self.dtype), top)
