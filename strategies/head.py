"""Logits only where a loss uses them (docs/strategies.md §5.9).

A training step of most dLLM losses scores a subset of positions (the corrupted ones, a response, a
canvas), yet `lm_head(hidden)` builds the whole `[B, L, V]` fp32 logits tensor and keeps it for
backward: 0.5 GB at B = 8, L = 512, V = 32k. `HeadProjection` stands for those logits without computing
them: it holds the final hidden states and the head's weight, is indexed like the logits tensor
(leading dimensions only), and the losses reduce it chunk by chunk — each chunk's logits are built,
reduced and dropped, and rebuilt in backward (`FusedHeadRows`: one extra matmul, the reduction's own
closed-form gradient), so peak memory holds one `[chunk, V]` block instead of the whole tensor.

`DeferrableHead` is the model's own `nn.Linear` head with one switch: inside `deferred_logits(model)` it
returns a `HeadProjection` instead of logits. Parameters, state dict and every other caller are
unchanged, and because the head still runs inside the model's forward, DDP and FSDP2 see it as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DEFAULT_CHUNK_ELEMENTS = 1 << 24  # logits elements per chunk: 64 MiB of fp32 (512 rows at V = 32k)

# configs whose logits are not `lm_head(hidden)` as is (a soft cap or a scale applied after the head)
_POST_HEAD_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class HeadProjection:
    """Logits `hidden @ weight.T (+ bias)` not yet computed. Index it like the logits (leading dims)."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None = None, chunk_rows: int | None = None):
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.chunk_rows = chunk_rows or max(1, DEFAULT_CHUNK_ELEMENTS // weight.shape[0])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    @property
    def dtype(self) -> torch.dtype:
        return self.hidden.dtype

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def _like(self, hidden: Tensor) -> HeadProjection:
        return HeadProjection(hidden, self.weight, self.bias, self.chunk_rows)

    def __getitem__(self, index) -> HeadProjection:
        if isinstance(index, tuple) and index and index[-1] is Ellipsis:
            index = index[:-1]
        return self._like(self.hidden[index])

    def reshape(self, *shape: int) -> HeadProjection:
        """Reshape the leading dims; the last entry must be the vocabulary size (or −1 for it)."""
        if shape[-1] not in (-1, self.weight.shape[0]):
            raise ValueError(f"HeadProjection.reshape keeps the vocabulary last: got {shape}")
        return self._like(self.hidden.reshape(*shape[:-1], self.hidden.shape[-1]))

    def float(self) -> HeadProjection:  # chunks are always reduced in fp32
        return self

    def materialize(self) -> Tensor:
        """The whole logits tensor (fp32): what the model would have returned."""
        return self.logits_of(self.hidden)

    def logits_of(self, hidden: Tensor) -> Tensor:
        return _chunk_logits(hidden, self.weight, self.bias, _matmul_dtype(hidden))

    def rowwise(self, kernel: RowKernel, *row_args: Tensor) -> tuple[Tensor, ...]:
        """`kernel` over row chunks of the flattened logits, fused with the head (`FusedHeadRows`): the
        per-row outputs, concatenated. `row_args` are per-row tensors (targets, coefficients)."""
        hidden = self.hidden.reshape(-1, self.hidden.shape[-1])
        flat_args = tuple(a.reshape(-1) for a in row_args)
        return FusedHeadRows.apply(hidden, self.weight, self.bias, kernel, self.chunk_rows, *flat_args)

    def softmax_matmul(self, matrix: Tensor) -> Tensor:
        """softmax(logits) @ matrix (no gradient), chunk by chunk: [..., V] × [V, D] → [..., D]."""
        hidden = self.hidden.reshape(-1, self.hidden.shape[-1])
        with torch.no_grad():
            out = [
                torch.softmax(self.logits_of(hidden[i : i + self.chunk_rows]), dim=-1).to(matrix.dtype) @ matrix
                for i in range(0, hidden.shape[0], self.chunk_rows)
            ]
        return torch.cat(out).reshape(*self.hidden.shape[:-1], matrix.shape[-1])


Logits = Tensor | HeadProjection


def row_nll(logits: Logits, target_ids: Tensor) -> Tensor:
    """Per-row CE of logits `[..., V]` against targets `[...]` in fp32, for a tensor or a projection."""
    if isinstance(logits, HeadProjection):
        (nll,) = logits.rowwise(CROSS_ENTROPY, target_ids)
        return nll.view(target_ids.shape)
    vocab = logits.shape[-1]
    if logits.dtype in (torch.bfloat16, torch.float16):  # mixed precision: the softmax runs in fp32
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, vocab), target_ids.reshape(-1), reduction="none").view(target_ids.shape)


class RowKernel:
    """A per-row reduction of logits with its own backward: `forward(logits [n, V] fp32, *args) → (outputs,
    saved)` and `backward(logits, saved, args, grads) → ∂/∂logits [n, V] fp32`."""

    def forward(self, logits: Tensor, *args: Tensor) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        raise NotImplementedError

    def backward(self, logits: Tensor, saved: tuple, args: tuple, grads: tuple) -> Tensor:
        raise NotImplementedError


class _CrossEntropyRows(RowKernel):
    """nll = logsumexp(logits) − logits[target]; ∂nll/∂logits = softmax − one_hot(target)."""

    def forward(self, logits, targets):
        lse = torch.logsumexp(logits, dim=1)
        return (lse - logits.gather(1, targets[:, None])[:, 0],), (lse,)

    def backward(self, logits, saved, args, grads):
        (lse,), (targets,), (g,) = saved, args, grads
        grad = logits.sub_(lse[:, None]).exp_().mul_(g[:, None])
        return grad.scatter_add_(1, targets[:, None], -g[:, None])


CROSS_ENTROPY = _CrossEntropyRows()


class FusedHeadRows(torch.autograd.Function):
    """Linear head + per-row kernel, `chunk` rows at a time, never holding more than one chunk's logits.

    Forward builds each chunk's logits, reduces them with `kernel.forward` and drops them, keeping only the
    kernel's per-row values. Backward rebuilds each chunk's logits (one extra matmul), takes the kernel's
    closed-form gradient and folds it straight into ∂hidden, ∂weight and ∂bias. Under autocast the chunk
    matmuls run in the autocast dtype in both passes, the kernel in fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, kernel, chunk, *args):
        ctx.compute_dtype = _matmul_dtype(hidden)
        outs, saved = [], []
        for rows in _chunks(hidden.shape[0], chunk):
            logits = _chunk_logits(hidden[rows], weight, bias, ctx.compute_dtype)
            out, keep = kernel.forward(logits, *(a[rows] for a in args))
            outs.append(out)
            saved.append(keep)
        ctx.kernel, ctx.chunk, ctx.nargs = kernel, chunk, len(args)
        ctx.save_for_backward(hidden, weight, bias, *args)
        ctx.kept = saved
        if not outs:
            return (hidden.new_zeros(0, dtype=torch.float32),)
        return tuple(torch.cat(parts) for parts in zip(*outs))

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, bias, *args = ctx.saved_tensors
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        # an output nobody used gets no gradient from autograd: it counts as zero
        grads = tuple(hidden.new_zeros(hidden.shape[0], dtype=torch.float32) if g is None else g.float() for g in grads)
        for rows, keep in zip(_chunks(hidden.shape[0], ctx.chunk), ctx.kept):
            logits = _chunk_logits(hidden[rows], weight, bias, ctx.compute_dtype)
            chunk_grads = tuple(g[rows] for g in grads)
            g_logits = ctx.kernel.backward(logits, keep, tuple(a[rows] for a in args), chunk_grads)
            if grad_h is not None:
                grad_h[rows] = (g_logits @ weight.float()).to(hidden.dtype)
            grad_w.addmm_(g_logits.t(), hidden[rows].float())
            if grad_b is not None:
                grad_b += g_logits.sum(dim=0)
        grad_w = grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None and ctx.needs_input_grad[2] else None
        return (grad_h, grad_w, grad_b, None, None) + (None,) * ctx.nargs


def _chunks(total: int, chunk: int):
    return (slice(i, min(i + chunk, total)) for i in range(0, total, chunk))


def _matmul_dtype(hidden: Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        b = None if bias is None else bias.to(dtype)
        return F.linear(hidden.to(dtype), weight.to(dtype), b).float()


class DeferrableHead(nn.Linear):
    """An `nn.Linear` LM head that returns a `HeadProjection` while its model is inside `deferred_logits`."""

    deferred: bool = False
    chunk_rows: int | None = None

    def forward(self, hidden: Tensor):
        if self.deferred:
            return HeadProjection(hidden, self.weight, self.bias, self.chunk_rows)
        return super().forward(hidden)


def make_head_deferrable(model: nn.Module, chunk_rows: int | None = None) -> bool:
    """Turn the LM head(s) of `model` into `DeferrableHead`s in place (same parameters); False where the
    model's logits are not a plain linear head (a soft cap or scale after it), which then stay as they are."""
    changed = False
    for module in model.modules():
        config = getattr(module, "config", None)
        head = getattr(module, "lm_head", None)
        if config is None or type(head) not in (nn.Linear, DeferrableHead):
            continue
        if any(getattr(config, key, None) not in (None, 1, 1.0) for key in _POST_HEAD_KEYS):
            continue
        head.__class__ = DeferrableHead
        head.chunk_rows = chunk_rows
        changed = True
    return changed


@contextmanager
def deferred_logits(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside this block the model's `DeferrableHead`s return `HeadProjection`s (no-op when not enabled)."""
    heads = [m for m in model.modules() if isinstance(m, DeferrableHead)] if enabled else []
    for head in heads:
        head.deferred = True
    try:
        yield
    finally:
        for head in heads:
            head.deferred = False
