"""The tracer behind `dllm-flow plan` (docs/planning.md): fake tensors whose live bytes, matmul and attention
FLOPs are counted while one training step runs, and the timeline that extends a shallow trace to the full depth."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from dllm_common.config import ConfigError, PipelineSpec

aten = torch.ops.aten
GB = 1e9
TRACED_LAYERS = 3  # a deeper model is traced with this many decoder layers (first, middle, last)
REAL_LIMIT = 4 << 20  # an intermediate of the step's real (small) work larger than this stays fake
# bytes a row's token the step's real work holds in one tensor, the most over the strategies: fp32 noise drawn per
# token (mdlm), over a row and its clean copy side by side (block_diffusion). A micro-batch of rows × seq_len whose
# work is larger than REAL_LIMIT would select by fake masks, which no fake tensor can size.
TOKEN_BYTES = 8


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


class Tracer(FakeTensorMode):
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
        f"data.seq_len {length} is too long to plan at {plural(rows, 'row')} per micro-batch{why}: the planner runs a "
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


def plural(n: int, what: str) -> str:
    """`n` of `what`, in the plural where it is not one: 1 row, 3 rows, 2 micro-batches."""
    return f"{n} {what}{'' if n == 1 else ('es' if what.endswith('h') else 's')}"
