"""Know before you launch: memory per GPU and time per step of each strategy of a pipeline (docs/planning.md).

Nothing is allocated: the model is built from its config (a tiny one from `model:`, a pretrained one from its
`config.json` alone) under a fake-tensor mode, and one training step of the strategy runs through the loop's own
`run_step` on fake tensors. The step's small integer work (noise draws, masks, token counts) runs for real, so
every data-dependent branch takes the path training takes; everything large is fake, and each fake tensor's bytes
are counted while it is alive. What the step keeps alive at its peak is the activation memory; the weights,
gradients, AdamW state and the data-parallel working set follow from the parameters and `train.parallel`.

    trace        `_Tracer`: fake tensors, live bytes of every allocation, FLOPs of every matmul and attention
    layers       a deep model is traced with 3 decoder layers and its timeline extended to the full depth
                 (`_Timeline`): the middle layer's segments repeat once per missing layer
    memory       per rank: weights + gradients + AdamW (sharded by N under FSDP2) + working set + activations
    time         counted FLOPs ÷ (GPU peak × the assumed utilization)
"""

from __future__ import annotations

import contextlib
import math
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
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
from strategies.options import model_shape, resolve_options
from tasks import dflash_setup
from tasks.common import StageRef
from tasks.distributed import DistInfo
from tasks.loop import run_step, step_context
from tasks.prepare_data import load_tokenizer
from tasks.runtime import Trainee
from tasks.target import _new_target
from tasks.trainee import model_architecture, tiny_config

aten = torch.ops.aten
GB = 1e9
TRACED_LAYERS = 3  # a deeper model is traced with this many decoder layers (first, middle, last)
REAL_LIMIT = 4 << 20  # an intermediate of the step's real (small) work larger than this stays fake
# bytes a row's token the step's real work holds in one tensor, the most over the strategies: fp32 noise drawn per
# token (mdlm), over a row and its clean copy side by side (block_diffusion). A micro-batch of rows × seq_len whose
# work is larger than REAL_LIMIT would select by fake masks, which no fake tensor can size.
TOKEN_BYTES = 8
DEFAULT_MFU = 0.4
# dense peak FLOP/s of one H100/H200 SXM: bf16 tensor cores, and plain fp32 (PyTorch leaves TF32 off for matmuls)
DEFAULT_FLOPS = {"bf16": 989e12, "fp32": 67e12}
DEFAULT_GPU_MEMORY = 80 * GB
CONTEXT_RESERVE = 1.5 * 2**30  # what a CUDA process holds outside PyTorch's allocator (context, cuBLAS, NCCL)
FRAGMENTATION = 0.05  # the caching allocator's share lost to fragmentation


# ------------------------------------------------------------------ the fake step


def _cpu_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm_flops(a, b, *args, out_shape=None, **kwargs) -> int:
    """A mixture of experts' grouped matmul: each group multiplies its own rows, so the work is that of one matmul
    over all rows. 2-D × 2-D (a weight gradient, groups along the contracted dimension) gives one [K, N] per group."""
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * math.prod(out_shape) * a[-1]


# PyTorch's counter knows the CUDA attention kernels but neither the CPU one the trace (and a CPU training step)
# runs nor the experts' grouped matmul; these are their formulas. `torch.utils.flop_counter.FlopCounterMode(
# custom_mapping=...)` takes them as is.
CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
    aten._grouped_mm: _grouped_mm_flops,
}


def _shape(x):
    return x.shape if isinstance(x, torch.Tensor) else x


def _count_flops(func, args, kwargs, out) -> int:
    packet = func._overloadpacket
    formula = flop_registry.get(packet)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    own = CPU_ATTENTION_FLOPS.get(packet)
    if own is None:
        return 0
    shapes = [_shape(a) for a in args]
    return int(own(*shapes, out_shape=_shape(out)))


# internal scratch an operator allocates and frees inside its kernel (invisible to a fake run): logsumexp
# forms `x − max` of its whole input before reducing it (the fused head's per-chunk log-normalizer)
_SCRATCH: dict = {aten.logsumexp.default: lambda args: args[0].untyped_storage().nbytes()}


def _index_list(indices) -> list:
    """Boolean index tensors that hold real data → the integer indices they select (so the fake result has the
    size a real one would); fake or integer ones pass as they are."""
    out: list = []
    for index in indices:
        if isinstance(index, torch.Tensor) and not isinstance(index, FakeTensor) and index.dtype == torch.bool:
            out.extend(torch.nonzero(index, as_tuple=True))
        else:
            out.append(index)
    return out


_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default}


class _Tracer(FakeTensorMode):
    """A fake-tensor mode for one training step. While `tracking`:

    - an operator on real tensors only (noise draws, masks, counts) runs for real when its result is small, so
      every data-dependent branch of the strategy follows the data; a large result (an L × L mask) stays fake;
    - a boolean index that holds real data selects as many rows as it would in training;
    - a fake scalar read by Python (`float(loss)`) reads as 1;
    - every tensor an operator creates is counted from its creation until it is freed (`live`), its FLOPs are
      added up, and `mark` cuts the timeline into segments (`_Timeline`).
    Operators that a fake kernel decomposes are counted once, as the operator (the real kernel is fused)."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.tracking = False
        self._depth = 0
        self.reset()

    def reset(self) -> None:
        self.live: dict[int, int] = {}
        self.now = self.peak = self.flops = 0
        self.timeline = _Timeline()
        self.timeline.start(0)

    def dispatch(self, func, types, args=(), kwargs=None):
        if not self.tracking or func is torch.ops.prim.device.default:
            return super().dispatch(func, types, args, kwargs)
        self._depth += 1
        try:
            out = self._traced(func, types, args, kwargs or {})
            if self._depth == 1:
                self._count(func, args, kwargs or {}, out)
            return out
        finally:
            self._depth -= 1

    def _traced(self, func, types, args, kwargs):
        # real work is an operator the step calls on real tensors; inside a fake operator's decomposition (depth > 1)
        # its parts stay fake, or a tensor it allocates and fills from fake data would be real and uninitialized
        if self._depth == 1 and not any(isinstance(t, FakeTensor) for t in tree_leaves((args, kwargs))):
            return self._real_work(func, types, args, kwargs)
        if func is aten._local_scalar_dense.default:
            return self._scalar(args[0])
        if func in _INDEXED:
            args = (args[0], _index_list(args[1]), *args[2:])
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            return self._grouped_mm(types, args, kwargs)
        return super().dispatch(func, types, args, kwargs)

    def _grouped_mm(self, types, args, kwargs):
        """The experts' grouped matmul in fp32: the CPU kernel runs it, but its fake kernel accepts bf16 only. Its
        shape is found in bf16 (uncounted, inside this operator) and the result is in the inputs' dtype."""
        dtype = args[0].dtype
        low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        return super().dispatch(aten._grouped_mm.default, types, tuple(low), kwargs).to(dtype)

    def _real_work(self, func, types, args, kwargs):
        try:
            fake = super().dispatch(func, types, args, kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            return func(*args, **kwargs)  # its size follows from the data (a nonzero of a mask): small, real
        if _storage_bytes(fake) > REAL_LIMIT:
            return fake
        return func(*args, **kwargs)

    @staticmethod
    def _scalar(tensor):
        if tensor.dtype == torch.bool:
            return True
        return 1.0 if tensor.dtype.is_floating_point else 1

    def _count(self, func, args, kwargs, out) -> None:
        scratch = _SCRATCH.get(func)
        if scratch is not None:
            self._high(self.now + scratch(args))
        returns = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
        for i, t in enumerate(outs):
            if not isinstance(t, torch.Tensor) or (i < len(returns) and returns[i].alias_info is not None):
                continue  # a view or an in-place result owns no new memory
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live:
                continue
            self.live[key] = storage.nbytes()
            self.now += self.live[key]
            weakref.finalize(storage, self._free, key)
        self._high(self.now)
        flops = _count_flops(func, args, kwargs, out)
        self.flops += flops
        self.timeline.flops(flops)

    def _high(self, level: int) -> None:
        self.peak = max(self.peak, level)
        self.timeline.level(level)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def mark(self, layer: int) -> None:
        """A decoder layer's forward or backward starts: a new segment of the timeline."""
        if self.tracking:
            self.timeline.start(self.now, layer)


class Untraceable(ConfigError):
    """A step the planner cannot trace: its per-token work (noise draws, masks, selections), which runs for real
    so that every data-dependent branch follows the data, is larger than `REAL_LIMIT` a tensor."""


def traceable_rows(spec: PipelineSpec) -> int:
    """The most rows of `data.seq_len` tokens whose per-token work the trace keeps real."""
    return REAL_LIMIT // (TOKEN_BYTES * spec.data.seq_len)


def too_long(spec: PipelineSpec, rows: int, why: str = "") -> str:
    """One line that names `data.seq_len` as what makes a micro-batch of `rows` rows impossible to plan."""
    length = spec.data.seq_len
    longest = REAL_LIMIT // (TOKEN_BYTES * rows)
    return (
        f"data.seq_len {length} is too long to plan at {_n(rows, 'row')} per micro-batch{why}: the planner runs a "
        f"step's per-token work (noise draws, masks) for real, at most {size(REAL_LIMIT)} a tensor, which is "
        f"{longest} tokens a row at this micro-batch; lower data.seq_len (or train.micro_batch_size) to plan it"
    )


def _storage_bytes(out) -> int:
    return sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor))


@dataclass
class _Segment:
    layer: int | None  # the decoder layer whose forward or backward began it (None: before the first)
    start: int  # live bytes at its start
    high: int  # the most live bytes within it
    flops: int = 0


@dataclass
class _Timeline:
    """Live bytes over one traced step, cut where a decoder layer's forward or backward starts. A model of N
    identical layers traced with 3 runs each pass as first layer, middle layer, last layer; `extend` repeats each
    run of the middle layer's segments N − 2 times, every level after it raised by what each repetition leaves."""

    segments: list[_Segment] = field(default_factory=list)

    def start(self, level: int, layer: int | None = None) -> None:
        self.segments.append(_Segment(layer, level, level))

    def level(self, level: int) -> None:
        seg = self.segments[-1]
        seg.high = max(seg.high, level)

    def flops(self, n: int) -> None:
        self.segments[-1].flops += n

    def extend(self, end: int, depth: int, traced: int) -> tuple[int, int]:
        """(peak bytes, FLOPs) of the step at `depth` layers, from this timeline of `traced` layers that ended
        with `end` bytes live."""
        if depth == traced:
            return max(s.high for s in self.segments), sum(s.flops for s in self.segments)
        repeat, middle = depth - traced + 1, traced // 2
        peak = flops = level = 0
        run: list[tuple[int, int, int]] = []  # middle-layer segments in a row: (rise to its high, net change, flops)

        def close_run() -> None:
            nonlocal peak, flops, level
            net = high = 0
            for rise, change, n in run:
                high, net, flops = max(high, net + rise), net + change, flops + n * repeat
            peak = max(peak, level + high + max(0, (repeat - 1) * net))  # the last repetition if each adds
            level += repeat * net
            run.clear()

        ends = [s.start for s in self.segments[1:]] + [end]
        for seg, seg_end in zip(self.segments, ends):
            if seg.layer == middle:
                run.append((seg.high - seg.start, seg_end - seg.start, seg.flops))
                continue
            close_run()
            peak = max(peak, level + seg.high - seg.start)
            level, flops = level + seg_end - seg.start, flops + seg.flops
        close_run()
        return peak, flops


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
    """Builds, under one `_Tracer`, the trained module of a strategy the way `tasks.trainee` does, but from configs
    only: fake weights, no checkpoint read."""

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
        return Trainee(model, None, built.strategy, built.loss_fn, built.mask_token_id, spec.train.precision, head)

    def _draft(self) -> Trainee:
        """A DFlash draft against its frozen target: the target from `dflash.target_model_id`'s config or the one
        `pretrain_target` would train; the features from the cache (fake, in the cache's dtype) or the target."""
        spec, d = self.spec, self.spec.dflash
        with _default_dtype(getattr(torch, d.target_torch_dtype)):  # built in its dtype (a fake module cannot `.to`)
            if d.target_model_id is None:
                target = _new_target(spec, self.vocab)
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
            draft = dflash_setup._new_draft(spec, target, ref, size, mask_id, options.copy_hint)
        cached = d.target_features == "cached"
        cache = _FakeFeatures(draft.config, options.distill_top_k, d.cache_dtype) if cached else None
        built = dflash_setup.draft_strategy(self.name, options, draft, target, mask_token_id=mask_id, cache=cache)
        self.frozen = target
        return Trainee(draft, None, built.strategy, built.loss_fn, built.mask_token_id, spec.train.precision)


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


# ------------------------------------------------------------------ one traced step


def synthetic_rows(spec: PipelineSpec, name: str, rows: int, vocab: int, seed: int = 0) -> Microbatch:
    """`rows` training rows of `data.seq_len` uniform random tokens (ids 2 … V − 2, clear of the usual special ids),
    supervised as the config's rows are: all of a pretraining row, all but a prompt otherwise (a dialogue row's
    first quarter, a regenerated row's `dflash.regenerate.prompt_len` tokens). Packed pretraining rows hold one
    document each."""
    length = spec.data.seq_len
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, max(vocab - 1, 3), (rows, length), generator=gen)
    loss_mask = torch.ones(rows, length)
    if strategy_class(name).training_data(spec) == "regenerated":
        loss_mask[:, : spec.dflash.regenerate.prompt_len] = 0
    elif spec.data.shape == "dialogue":
        loss_mask[:, : length // 4] = 0
    documents = torch.zeros(rows, length, dtype=torch.long) if spec.data.shape == "pretrain" else None
    return Microbatch(
        ids, loss_mask, torch.ones(rows, length, dtype=torch.long), torch.arange(rows), "train", documents
    )


@dataclass(frozen=True)
class Trace:
    """One micro-batch's forward and backward at the configured depth: the most bytes it had alive beyond what
    existed before it (activations, logits, the loss's scratch; the gradients too where they were kept) and the
    FLOPs of its matmuls and attention (every pass the strategy runs, recomputation included)."""

    peak: int
    flops: int


def _mark_layers(model: nn.Module, tracer: _Tracer) -> list:
    """Hooks that start a timeline segment where a decoder layer's forward starts (recomputation included) and
    where its backward starts (the gradient of its output arrives)."""

    def on_forward(index):
        def hook(module, args, kwargs):
            tracer.mark(index)

        return hook

    def on_output(index):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: tracer.mark(index))

        return hook

    handles = []
    for index, layer in enumerate(decoder_layers(model)):
        handles.append(layer.register_forward_pre_hook(on_forward(index), with_kwargs=True))
        handles.append(layer.register_forward_hook(on_output(index), with_kwargs=True))
    return handles


def _drop_gradients(params) -> list:
    """Free each gradient as soon as it is accumulated (what FSDP2 does after reducing it to its shard)."""

    def drop(param):
        param.grad = None

    return [p.register_post_accumulate_grad_hook(drop) for p in params]


class _Planner:
    """The traces of one strategy of a pipeline, built from configs only."""

    def __init__(self, spec: PipelineSpec, name: str):
        self.spec, self.name, self.tracer = spec, name, _Tracer()
        self.builder = _Builder(spec, name, self.tracer)

    def trace(
        self, shape: Shape, keep_grads: bool = False, grads_present: bool = False, micro_batches: int = 1
    ) -> Trace:
        """One training step of `micro_batches` micro-batches of `shape.rows` rows (each draws its own noise, as in
        training), gradients freed as they are made unless `keep_grads`."""
        b = self.builder
        depth = b.depth
        # a step of several micro-batches is traced at full depth: what a layer allocates and the end of the
        # micro-batch frees all at once (bf16 autocast's weight casts) would be freed for 3 layers only, and the
        # extended level would drift up by the other layers' share with every micro-batch
        deep = depth is not None and depth > TRACED_LAYERS + 1
        layers = TRACED_LAYERS if deep and micro_batches == 1 else None
        trainee = b.build(shape.fused_head, shape.checkpointing, layers)
        model, tracer = trainee.model, self.tracer
        params = [p for p in model.parameters() if p.requires_grad]
        handles = _mark_layers(model, tracer)
        if not keep_grads:
            handles += _drop_gradients(params)
        if grads_present:
            with tracer:
                for p in params:
                    p.grad = torch.zeros_like(p)
        rows = [synthetic_rows(self.spec, self.name, shape.rows, b.vocab, self.spec.train.seed)] * micro_batches
        tracer.reset()
        tracer.tracking = True
        try:
            with tracer, torch.random.fork_rng(devices=[]):
                ctx = step_context(trainee, 0, self.spec.train.seed, model, DistInfo(), micro_batches)
                try:
                    run_step(trainee, ctx, rows, True)
                except (DynamicOutputShapeException, DataDependentOutputException) as exc:
                    # a selection by a mask too large to have stayed real: its size is unknown to a fake tensor
                    why = f" (a data-dependent size in the trace: {exc.func})"
                    raise Untraceable(too_long(self.spec, shape.rows, why)) from None
            del ctx
            for p in params:  # what the step leaves is the gradients: theirs, not the step's
                p.grad = None
            end = tracer.now
        finally:
            tracer.tracking = False
            for handle in handles:
                handle.remove()
        traced = len(decoder_layers(model))
        peak, flops = tracer.timeline.extend(end, depth if layers else traced, traced)
        return Trace(peak, flops)

    def full_model(self) -> tuple[nn.Module, nn.Module | None]:
        """The trained module at its configured depth (fake) and the frozen module beside it (a DFlash target)."""
        trainee = self.builder.build(self.spec.train.fused_head, False)
        return trainee.model, self.builder.frozen


# ------------------------------------------------------------------ memory per rank and time per step


@dataclass(frozen=True)
class Cluster:
    """The hardware a plan is for: `gpus` data-parallel ranks of `memory` bytes and `flops` peak FLOP/s each,
    running the counted operations at `mfu` of that peak. `device` "cpu" plans a CPU training (the validation)."""

    gpus: int
    memory: float | None = DEFAULT_GPU_MEMORY
    flops: float | None = None  # None: DEFAULT_FLOPS of the training precision
    mfu: float = DEFAULT_MFU
    device: str = "cuda"

    def usable(self) -> float | None:
        """Bytes a training may use: the memory less the allocator's fragmentation and the CUDA context."""
        if self.memory is None:
            return None
        return self.memory * (1 - FRAGMENTATION) - (CONTEXT_RESERVE if self.device == "cuda" else 0)


@dataclass(frozen=True)
class Layout:
    """How a global batch is split: `world` ranks, each `micro_batches` micro-batches of `rows` rows."""

    world: int
    parallel: str  # "single", "ddp" or "fsdp2"
    rows: int
    micro_batches: int


def micro_batch_for(spec: PipelineSpec, gpus: int) -> tuple[PipelineSpec, str | None]:
    """`spec` as it can be planned on `gpus` ranks: where `train.micro_batch_size` does not divide the rows each
    rank gets of the global batch (the config was written for another world size), the largest micro-batch that
    does, with one line that says so; else `spec` as it is (None). A global batch the ranks cannot share evenly is
    left to `layout`, which refuses it."""
    t = spec.train
    if gpus < 1 or t.global_batch_size % gpus:
        return spec, None
    per_rank = t.global_batch_size // gpus
    if per_rank % t.micro_batch_size == 0:
        return spec, None
    rows = max(r for r in range(1, min(t.micro_batch_size, per_rank) + 1) if per_rank % r == 0)
    changed = spec.model_copy(update={"train": t.model_copy(update={"micro_batch_size": rows})})
    return changed, (
        f"on {gpus} GPUs each rank gets {per_rank} of the global batch of {t.global_batch_size} rows, which "
        f"train.micro_batch_size ({t.micro_batch_size}) does not divide: planned with micro-batches of {rows} "
        "(the largest that does; --set train.micro_batch_size=N plans another)"
    )


def layout(spec: PipelineSpec, gpus: int) -> Layout:
    t = spec.train
    per_rank = t.global_batch_size // gpus
    if gpus < 1 or t.global_batch_size % gpus or per_rank % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of {gpus} GPUs × "
            f"train.micro_batch_size ({t.micro_batch_size}) to plan on {gpus} GPUs; change one of them"
        )
    return Layout(gpus, "single" if gpus == 1 else t.parallel, t.micro_batch_size, per_rank // t.micro_batch_size)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Resident:
    """Bytes one rank holds besides the step's activations."""

    parameters: int  # of the trained module (all ranks together)
    trainable: int
    weights: int
    gradients: int
    optimizer: int  # AdamW's two moments
    frozen: int  # a frozen module beside it (the DFlash target), whole on every rank
    working: int  # DDP: the gradient buckets; FSDP2: the unsharded weights and gradients in flight
    update: int  # scratch of the optimizer step

    @classmethod
    def of(cls, model: nn.Module, frozen: nn.Module | None, lay: Layout, device: str) -> Resident:
        params = list(model.parameters())
        trained = [p for p in params if p.requires_grad]
        weights, buffers = _nbytes(params), _nbytes(model.buffers())  # buffers (rotary tables) are never sharded
        grads = _nbytes(trained)
        largest = max((p.numel() * p.element_size() for p in trained), default=0)
        frozen_bytes = 0 if frozen is None else _nbytes(frozen.parameters()) + _nbytes(frozen.buffers())
        count, count_trained = sum(p.numel() for p in params), sum(p.numel() for p in trained)
        if lay.parallel == "fsdp2":
            # each rank keeps 1/N of every weight, gradient and moment; while a step runs it also holds the root
            # module's weights unsharded (not resharded between forward and backward) and their gradients until the
            # end of backward, two decoder layers' all-gathered weights (the current one and the prefetched one)
            # and one layer's unsharded gradients before they are reduce-scattered
            # a model whose layers two modules run (`shares_layers`) is one root unit (`shard_fsdp2`): all of it
            layers = [] if getattr(model, "shares_layers", False) else list(decoder_layers(model))
            layer_w = max((_nbytes(layer.parameters()) for layer in layers), default=0)
            layer_g = max((_nbytes(p for p in layer.parameters() if p.requires_grad) for layer in layers), default=0)
            root_w = weights - sum(_nbytes(layer.parameters()) for layer in layers)
            root_g = grads - sum(_nbytes(p for p in layer.parameters() if p.requires_grad) for layer in layers)
            shard = lambda n: math.ceil(n / lay.world)  # noqa: E731
            working = root_w + root_g + 2 * layer_w + layer_g
            update = shard(grads) if device == "cuda" else 2 * shard(largest)
            sharded = shard(weights) + buffers
            return cls(count, count_trained, sharded, shard(grads), 2 * shard(grads), frozen_bytes, working, update)
        # AdamW on CUDA updates every tensor at once (foreach): one temporary the size of the moments' square root;
        # on CPU one tensor at a time, with two temporaries of it
        update = grads if device == "cuda" else 2 * largest
        working = grads if lay.parallel == "ddp" else 0  # DDP's buckets are a second copy of the gradients
        return cls(count, count_trained, weights + buffers, grads, 2 * grads, frozen_bytes, working, update)


VARIANTS = ((True, False), (False, False), (True, True), (False, True))  # (fused head, activation checkpointing)


@dataclass
class StrategyPlan:
    """One strategy's plan: per rank, at the configured micro-batch unless noted."""

    strategy: str
    layout: Layout
    resident: Resident
    activations: dict[tuple[bool, bool], int | None]  # per (fused head, checkpointing); None: does not apply
    configured: tuple[bool, bool]
    step_activations: int  # the most of them over the step's micro-batches (each draws its own noise)
    peak: int  # per rank, configured settings
    per_row: int  # activation bytes per more row of micro-batch
    max_rows: int | None  # the largest micro-batch that fits (None: no memory given)
    flops_per_token: float
    step_seconds: float
    tokens_per_second: float
    notes: list[str] = field(default_factory=list)


def _phases(res: Resident, lay: Layout, activations: int, with_grads: int | None) -> tuple[int, int]:
    """A rank's most bytes during forward/backward and during the optimizer step. Weights, AdamW moments and a
    frozen module stay; FSDP2 keeps its gradient shards and adds its working set; replicated gradients are made
    during backward and, from a step's second micro-batch on, are all there from its start (`with_grads`: the
    whole step traced with them kept)."""
    base = res.weights + res.optimizer + res.frozen
    if lay.parallel == "fsdp2":
        return base + res.gradients + res.working + activations, base + res.gradients + res.update
    during = with_grads if with_grads is not None else activations + res.gradients
    return base + res.working + during, base + res.working + res.gradients + res.update


def plan_strategy(
    spec: PipelineSpec, name: str, cluster: Cluster, variants: bool = True, sizing: bool = True
) -> StrategyPlan:
    """Trace `name`'s step at the configured micro-batch (every memory setting with `variants`) and size it (the
    largest micro-batch that fits, with `sizing`)."""
    lay = layout(spec, cluster.gpus)
    if lay.rows > traceable_rows(spec):  # refused before any model is built or row drawn
        raise Untraceable(too_long(spec, lay.rows))
    unsized = sizing and lay.rows + 1 > traceable_rows(spec)  # sizing traces one more row
    sizing = sizing and not unsized
    planner = _Planner(spec, name)
    model, frozen = planner.full_model()
    res = Resident.of(model, frozen, lay, cluster.device)
    del model
    t = spec.train
    acts: dict[tuple[bool, bool], int | None] = {}
    traces: dict[tuple[bool, bool], Trace] = {}

    def activations(fused: bool, ckpt: bool) -> int | None:
        if (fused, ckpt) not in acts:
            trace = planner.trace(Shape(fused, ckpt, lay.rows)) if planner.builder.supports(ckpt) else None
            applies = trace is not None and (planner.builder.deferrable or not fused)  # else the same as full logits
            acts[(fused, ckpt)] = trace.peak if applies else None
            traces[(fused, ckpt)] = trace
        return acts[(fused, ckpt)]

    chosen = (t.fused_head, t.activation_checkpointing and planner.builder.supports(t.activation_checkpointing))
    if activations(*chosen) is None:  # the model has no plain linear head to fuse
        chosen = (False, chosen[1])
        activations(*chosen)
    for variant in VARIANTS if variants else ():
        activations(*variant)
    notes = []
    if chosen[1] != t.activation_checkpointing:
        notes.append("train.activation_checkpointing does not apply to it: planned without")
    if chosen[0] != t.fused_head:
        notes.append("its model has no plain linear LM head: planned with full logits")
    if unsized:
        notes.append(f"largest micro-batch not sized: {too_long(spec, lay.rows + 1)}")
    # the whole step (every micro-batch draws its own noise, so how many positions a strategy selects varies)
    shape = Shape(*chosen, lay.rows)
    step = traces[chosen] if lay.micro_batches == 1 else planner.trace(shape, micro_batches=lay.micro_batches)
    act, flops = step.peak, step.flops
    more = 0
    if sizing:  # one more row: what each row adds, which sizes the largest micro-batch
        more = max(0, planner.trace(Shape(*chosen, lay.rows + 1)).peak - acts[chosen])
    with_grads = None
    if lay.parallel != "fsdp2":
        with_grads = planner.trace(shape, keep_grads=True, micro_batches=lay.micro_batches).peak
    during, update = _phases(res, lay, act, with_grads)
    max_rows, usable = None, cluster.usable()
    if usable is not None and sizing:
        room = usable - during
        max_rows = 0 if update > usable else max(0, lay.rows + math.floor(room / more) if more > 0 else lay.rows)
    rate = (cluster.flops or DEFAULT_FLOPS[t.precision]) * cluster.mfu
    seconds = flops / rate
    tokens = spec.data.seq_len
    return StrategyPlan(
        name,
        lay,
        res,
        acts,
        chosen,
        act,
        max(during, update),
        more,
        max_rows,
        flops / (tokens * lay.rows * lay.micro_batches),
        seconds,
        t.global_batch_size * tokens / seconds,
        notes,
    )


def plan(spec: PipelineSpec, cluster: Cluster, variants: bool = True) -> list[StrategyPlan]:
    """A plan for every strategy of the pipeline."""
    return [plan_strategy(spec, name, cluster, variants) for name in spec.pipeline.strategies]


# ------------------------------------------------------------------ what is printed


def size(n: float | None) -> str:
    """Bytes in decimal units, three significant figures: 41.2 GB, 365 MB."""
    if n is None:
        return "n/a"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def count(n: float) -> str:
    """A count in decimal units, three significant figures: 8.03 B (parameters), 4.21 P (FLOPs)."""
    for unit, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f}"


def _n(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else ('es' if what.endswith('h') else 's')}"


def _switches(fused: bool, ckpt: bool) -> str:
    return f"{'fused head' if fused else 'full logits'}{', checkpointing' if ckpt else ''}"


def render(spec: PipelineSpec, cluster: Cluster, plans: list[StrategyPlan], source: str = "") -> str:
    t, lay = spec.train, plans[0].layout
    flops = cluster.flops or DEFAULT_FLOPS[t.precision]
    precision = "bf16 autocast (fp32 weights and AdamW)" if t.precision == "bf16" else "fp32"
    parallel = {"single": "one process", "ddp": "DDP", "fsdp2": "FSDP2"}[lay.parallel]
    memory = "memory not given" if cluster.memory is None else f"{size(cluster.memory)} each"
    lines = [
        f"dllm-flow plan{' ' + source if source else ''}: {model_name(spec)}, sequence {spec.data.seq_len}, "
        f"{precision}",
        f"{cluster.gpus} × {cluster.device.upper()} ({memory}), {parallel}; global batch {t.global_batch_size} = "
        f"{_n(lay.world, 'rank')} × {_n(lay.micro_batches, 'micro-batch')} × {_n(lay.rows, 'row')}",
        f"time at {cluster.mfu:.0%} of {count(flops)}FLOP/s per GPU (an assumed utilization of the counted FLOPs; "
        "benchmarks/gpu_check.py measures it)",
        "",
        "Memory per GPU at the configured settings (activations: the step's peak of activations, logits and loss "
        "scratch; peak: everything at the step's highest point, forward/backward or the optimizer update)",
        "",
        "| strategy | settings | trained params | weights | gradients | AdamW | frozen | working set | activations "
        "| peak | fits | largest micro-batch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    usable = cluster.usable()
    for p in plans:
        r = p.resident
        fits = "?" if usable is None else ("yes" if p.peak <= usable else "**no**")
        largest = "?" if p.max_rows is None else str(p.max_rows)
        lines.append(
            f"| {p.strategy} | {_switches(*p.configured)} | {count(r.trainable)} | {size(r.weights)} "
            f"| {size(r.gradients)} | {size(r.optimizer)} | {size(r.frozen) if r.frozen else '-'} "
            f"| {size(r.working) if r.working else '-'} | {size(p.step_activations)} | {size(p.peak)} "
            f"| {fits} | {largest} |"
        )
    lines += [
        "",
        f"Activations of one micro-batch of {_n(lay.rows, 'row')}, per memory setting (n/a: the strategy or model "
        "has no such setting)",
        "",
        "| strategy | fused head | full logits | fused head + checkpointing | full logits + checkpointing |",
        "|---|---|---|---|---|",
    ]
    for p in plans:
        cells = " | ".join(size(p.activations.get(v)) for v in VARIANTS)
        lines.append(f"| {p.strategy} | {cells} |")
    lines += [
        "",
        "Compute (FLOPs of every pass the strategy runs: forward, backward, recomputation, a frozen target's forward)",
        "",
        "| strategy | FLOPs per token | per GPU per step | step | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for p in plans:
        per_step = p.flops_per_token * spec.data.seq_len * lay.rows * lay.micro_batches
        lines.append(
            f"| {p.strategy} | {count(p.flops_per_token)} | {count(per_step)} | {p.step_seconds:.3g} s "
            f"| {p.tokens_per_second:,.0f} |"
        )
    notes = [f"- {p.strategy}: {note}" for p in plans for note in p.notes]
    if usable is not None:
        context = f" and {size(CONTEXT_RESERVE)} for the CUDA context" if cluster.device == "cuda" else ""
        notes.append(
            f"- fits: peak ≤ {size(usable)} usable ({size(cluster.memory)} less {FRAGMENTATION:.0%} for the "
            f"allocator's fragmentation{context})"
        )
    if t.compile:
        notes.append("- train.compile is not modelled: compiled layers usually need less activation memory")
    return "\n".join(lines + ([""] + notes if notes else []))


def model_name(spec: PipelineSpec) -> str:
    m = spec.model
    if m.kind == "tiny":
        return f"tiny {m.family} (hidden {m.hidden_size}, {m.num_layers} layers)"
    return f"{m.path}{' (' + m.gguf_file + ')' if m.gguf_file else ''}"


# ------------------------------------------------------------------ the command line's quantities


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def quantity(text: str, what: str, suffix: str, example: str) -> float:
    """`80GB`, `80 GiB`, `8e10`, `989T`, `1.98PFLOPS` → a number; anything else is one clear error."""
    match = re.fullmatch(rf"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]i?)?\s*(?:{suffix})?\s*", text, re.IGNORECASE)
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(f"{what} {text!r} is not a positive amount; write it like {example}")
    return float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


def cluster_for(
    spec: PipelineSpec, gpus: int | None, memory: str | None, flops: str | None, mfu: float | None
) -> Cluster:
    """The cluster `dllm-flow plan` sizes for: `gpus` ranks (default: the config's world size) of `memory` bytes
    and `flops` peak FLOP/s each (default: an H100's at the training precision), at `mfu` of that peak."""
    if mfu is not None and not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu} must be in (0, 1]: the share of the GPU's peak FLOP/s a step runs at")
    if gpus is not None and gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be at least 1")
    return Cluster(
        gpus or spec.train.world_size,
        None if memory is None else quantity(memory, "--gpu-memory", "b|bytes", "80GB"),
        None if flops is None else quantity(flops, "--gpu-flops", "flop/s|flops|flop", "989T"),
        DEFAULT_MFU if mfu is None else mfu,
    )


def fit_warnings(spec: PipelineSpec, memory: str | None) -> list[str]:
    """One line per strategy that the plan says will not fit a training GPU of `memory` (else the visible CUDA
    device's; none without one), naming the setting to change."""
    if memory is not None:
        total = quantity(memory, "the GPU memory (--gpu-memory / $DLLM_FLOW_GPU_MEMORY)", "b|bytes", "80GB")
    elif torch.cuda.is_available():
        total = float(torch.cuda.get_device_properties(0).total_memory)
    else:
        return []
    cluster = Cluster(spec.train.world_size, total)
    lines = []
    for name in spec.pipeline.strategies:
        try:
            p = plan_strategy(spec, name, cluster, variants=False, sizing=False)
        except Untraceable as exc:  # a warning that cannot be computed holds the run back no more than none
            lines.append(f"train[{name}] is not planned: {exc}")
            continue
        if p.peak > cluster.usable():
            fix = _fix(spec, name, cluster, p)
            lines.append(
                f"train[{name}] needs about {size(p.peak)} per GPU by the plan (dllm-flow plan), more than the "
                f"{size(cluster.usable())} usable of {size(total)}: {fix}"
            )
    return lines


def _fix(spec: PipelineSpec, name: str, cluster: Cluster, failed: StrategyPlan) -> str:
    """The first of the usual memory settings that makes `name` fit, said as the key to set."""
    t, usable = spec.train, cluster.usable()

    def fits(**train) -> StrategyPlan | None:
        changed = spec.model_copy(update={"train": t.model_copy(update=train)})
        p = plan_strategy(changed, name, cluster, variants=False, sizing=False)
        return p if p.peak <= usable else None

    if not t.activation_checkpointing and strategy_class(name).supports_activation_checkpointing:
        if p := fits(activation_checkpointing=True):
            return f"set train.activation_checkpointing: true (plan: {size(p.peak)})"
    if not t.fused_head and (p := fits(fused_head=True)):
        return f"set train.fused_head: true (plan: {size(p.peak)})"
    per_rank = t.global_batch_size // cluster.gpus
    for rows in sorted((r for r in range(1, t.micro_batch_size) if per_rank % r == 0), reverse=True):
        if p := fits(micro_batch_size=rows):
            return f"lower train.micro_batch_size to {rows} (plan: {size(p.peak)})"
    if cluster.gpus > 1 and t.parallel == "ddp" and (p := fits(parallel="fsdp2")):
        return f"set train.parallel: fsdp2 (plan: {size(p.peak)})"
    return (
        "no single setting is enough (train.micro_batch_size, train.activation_checkpointing, train.fused_head, "
        "train.parallel): run `dllm-flow plan` on this config, and use more GPUs with train.parallel: fsdp2"
    )
