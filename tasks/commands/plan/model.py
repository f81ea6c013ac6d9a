"""The model `dllm-flow plan` traces, built by the train stage's own builders (`tasks.training.trainee`:
`assembled_denoiser`, `assembled_draft`; the embedded DFlash target by `tasks.speculative.target.new_target`) under
the tracer's fake-tensor mode, from configs alone: what a plan does not have is given as training's builders take
it (`TokenIds` for the data stage's tokenizer, the target model, a config for a checkpoint's weights)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from dllm_common.config import ConfigError, PipelineSpec
from strategies import Microbatch, strategy_class
from strategies.dflash.features import TargetOutputs
from strategies.dflash.loss import SoftLabels
from strategies.models import backbone_lm
from strategies.options import resolve_options
from tasks.commands.plan.trace import Tracer
from tasks.common import StageRef
from tasks.data.tokenizer import load_tokenizer
from tasks.speculative.setup import layer_ids_for
from tasks.speculative.target import new_target
from tasks.training.runtime import Trainee
from tasks.training.trainee import (
    TokenIds,
    assembled_denoiser,
    assembled_draft,
    default_dtype,
    model_config,
    own_shape,
    pretrained_config,
)

# ------------------------------------------------------------------ the model, built fake


@dataclass(frozen=True)
class Shape:
    """What is planned: one strategy at one setting of the two memory switches, `rows` rows per micro-batch."""

    fused_head: bool
    checkpointing: bool
    rows: int


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


def truncated(config, layers: int):
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


class Builder:
    """Builds, under one `Tracer`, the trained module of a strategy with the train stage's builders, from configs
    only: fake weights, no checkpoint read. A denoiser's config is read once (`model_config`); a deep one is built
    again at fewer layers for the trace (`depth`: its configured depth, None where it is traced whole)."""

    def __init__(self, spec: PipelineSpec, name: str, tracer: Tracer):
        self.spec, self.name, self.tracer = spec, name, tracer
        self.cls = strategy_class(name)
        self.options = resolve_options(spec, name)
        self.draft = self.cls.trains == "draft"
        self.tokens: TokenIds | None = None  # a draft's: the target's vocabulary, known once it is built
        self.config = None
        if not self.draft:
            tiny = spec.model.kind == "tiny"
            tokens = TokenIds.planned(self.options, vocab_size(spec)) if tiny else None
            self.config = model_config(spec, name, self.options, tokens)
            self.tokens = tokens or TokenIds.planned(self.options, int(self.config.get_text_config().vocab_size))
        # a model of its own (block_diffusion's DiffusionGemma) is traced at its full depth: its layers differ
        # (sliding and full attention, wider global heads)
        full_depth = self.config is None or own_shape(name, self.options) is not None
        self.depth = None if full_depth else self.config.num_hidden_layers
        self.deferrable = False  # whether the fused head applies: a plain linear LM head (a draft has none)
        self.frozen: nn.Module | None = None

    @property
    def vocab(self) -> int:
        return self.tokens.size

    def supports(self, checkpointing: bool) -> bool:
        return not checkpointing or self.cls.supports_activation_checkpointing

    def build(self, fused: bool, checkpointing: bool, layers: int | None = None) -> Trainee:
        with self.tracer, torch.random.fork_rng(devices=[]):
            if self.draft:
                return self._draft()
            return self._denoiser(fused, checkpointing, layers)

    def _denoiser(self, fused: bool, checkpointing: bool, layers: int | None) -> Trainee:
        t = self.spec.train
        planned = {"fused_head": fused, "activation_checkpointing": checkpointing}
        spec = self.spec.model_copy(update={"train": t.model_copy(update=planned)})
        config = self.config if layers is None else truncated(self.config, layers)
        with _moves_by_replacement():  # PEFT moves each new adapter beside its layer with `Module.to`
            trainee = assembled_denoiser(spec, self.name, self.options, self.tokens, config)
        self.deferrable = trainee.fused_head or not fused and self.deferrable
        return trainee

    def _draft(self) -> Trainee:
        """A DFlash draft against its frozen target: the one `pretrain_target` would train or
        `dflash.target_model_id`'s config; the features from the cache (fake, in the cache's dtype) or the target."""
        spec, d = self.spec, self.spec.dflash
        with default_dtype(getattr(torch, d.target_torch_dtype)):  # built in its dtype (a fake module cannot `.to`)
            if d.target_model_id is None:
                target = new_target(spec, vocab_size(spec))
            else:
                config = pretrained_config(
                    d.target_model_id, "dflash.target_model_id", d.target_trust_remote_code, d.target_gguf_file
                )
                target = AutoModelForCausalLM.from_config(config, trust_remote_code=d.target_trust_remote_code)
        target = target.eval().requires_grad_(False)
        self.tokens = TokenIds.planned(self.options, int(target.config.vocab_size))
        ref = StageRef("target", "plan", "", info={"num_layers": target.config.num_hidden_layers})
        cache = None
        if d.target_features == "cached":
            layers = layer_ids_for(spec, ref)
            width = len(layers) * target.config.hidden_size  # the draft is as wide as its target
            cache = _FakeFeatures(layers, width, self.options.distill_top_k, d.cache_dtype)
        trainee = assembled_draft(spec, self.name, target, ref, self.tokens, cache=cache, weights=False)
        self.frozen = target
        return trainee


@contextlib.contextmanager
def _moves_by_replacement() -> Iterator[None]:
    """Inside this block `Module.to` (`_apply`) replaces each tensor it changes with the moved one. Torch swaps a
    fake parameter in place instead, which a fake-tensor mode's weak reference to it makes fail ("Couldn't swap");
    replacing is what a real module's `.to` amounts to. A tensor `.to` leaves as it is is kept: the planner builds
    each module in its dtype on one device, so only a new module's tensors change (an adapter's, moved beside its
    layer), and a weight tied across modules is never replaced on one side only."""
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


class _FakeFeatures:
    """A feature cache that holds nothing: each micro-batch's target features are made in the traced step, in the
    cache's shape and dtype (what `CachedFeatures` reads from its shards and moves to the device): `width` features
    per token, the target's hidden states at `layer_ids` side by side."""

    def __init__(self, layer_ids: list[int], width: int, top_k: int, dtype: str):
        self.layer_ids, self.width, self.top_k = list(layer_ids), width, top_k
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]

    def __call__(self, mb: Microbatch, labels: bool = False) -> TargetOutputs:
        b, length = mb.input_ids.shape
        top = None
        if labels and self.top_k:
            ids = torch.zeros(b, length, self.top_k, dtype=torch.int32)
            top = SoftLabels(ids, torch.full((b, length, self.top_k), 1.0 / self.top_k))
        return TargetOutputs(torch.zeros(b, length, self.width, dtype=self.dtype), top)
