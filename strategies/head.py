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

A soft cap after the head (Gemma's `final_logit_softcapping` c: logits = c·tanh(hWᵀ/c)) is part of the
projection where the model that owns the head declares that it reads capped logits from a projection
(`SOFTCAP_IN_HEAD`, DiffusionGemma in block_diffusion): every chunk is capped after its matmul and the
rebuilt backward multiplies by the cap's derivative 1 − tanh². A model whose own forward caps the head's
output (a stock Gemma causal LM) keeps its plain head.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DEFAULT_CHUNK_ELEMENTS = 1 << 24  # logits elements per chunk: 64 MiB of fp32 (512 rows at V = 32k)

# configs whose logits are not `lm_head(hidden)` as is (a soft cap or a scale applied after the head)
SOFTCAP = "final_logit_softcapping"
_POST_HEAD_KEYS = (SOFTCAP, "logit_scale", "logits_scaling", "output_multiplier_scale")
# a module attribute: True where the module calls its own head and caps a plain tensor itself, so a deferred
# head may return the capped projection (strategies/block_diffusion/gemma.py)
SOFTCAP_IN_HEAD = "softcap_in_head"


class HeadProjection:
    """Logits `hidden @ weight.T (+ bias)` not yet computed, soft-capped to c·tanh(·/c) where `softcap` = c is
    given. Index it like the logits (leading dims)."""

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None = None,
        chunk_rows: int | None = None,
        softcap: float | None = None,
    ):
        self.hidden, self.weight, self.bias, self.softcap = hidden, weight, bias, softcap
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
        return HeadProjection(hidden, self.weight, self.bias, self.chunk_rows, self.softcap)

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
        return _chunk_logits(hidden, self.weight, self.bias, _matmul_dtype(hidden), self.softcap)

    def rowwise(self, kernel: RowKernel, *row_args: Tensor) -> tuple[Tensor, ...]:
        """`kernel` over row chunks of the flattened logits, fused with the head (`FusedHeadRows`): the
        per-row outputs, concatenated. `row_args` are per-row tensors (targets, coefficients)."""
        hidden = self.hidden.reshape(-1, self.hidden.shape[-1])
        flat_args = tuple(a.reshape(-1) for a in row_args)
        return FusedHeadRows.apply(hidden, self.weight, self.bias, (kernel, self.softcap), self.chunk_rows, *flat_args)

    def softmax_matmul(self, matrix: Tensor) -> Tensor:
        """softmax(logits) @ matrix, chunk by chunk: [..., V] × [V, D] → [..., D]. The softmax is a constant
        (no gradient to the logits, as `softmax(logits.detach()) @ matrix`); `matrix` gets its gradient
        softmaxᵀ @ ∂out, the softmax rebuilt chunk by chunk in backward."""
        hidden = self.hidden.detach().reshape(-1, self.hidden.shape[-1])
        out = _SoftmaxMatmul.apply(hidden, matrix, self)
        return out.reshape(*self.hidden.shape[:-1], matrix.shape[-1])

    def _softmax_chunks(self, hidden: Tensor, dtype: torch.dtype):
        for rows in _chunks(hidden.shape[0], self.chunk_rows):
            yield rows, torch.softmax(self.logits_of(hidden[rows]), dim=-1).to(dtype)


class _SoftmaxMatmul(torch.autograd.Function):
    """`HeadProjection.softmax_matmul`: never more than one chunk of the softmax in memory, either pass."""

    @staticmethod
    def forward(ctx, hidden, matrix, projection):
        ctx.projection = projection
        ctx.save_for_backward(hidden)
        with torch.no_grad():
            out = [probs @ matrix for _, probs in projection._softmax_chunks(hidden, matrix.dtype)]
        return torch.cat(out) if out else hidden.new_zeros(0, matrix.shape[-1], dtype=matrix.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (hidden,) = ctx.saved_tensors
        grad = torch.zeros(ctx.projection.weight.shape[0], grad_out.shape[-1], dtype=grad_out.dtype)
        grad = grad.to(grad_out.device)
        with torch.no_grad():
            for rows, probs in ctx.projection._softmax_chunks(hidden, grad_out.dtype):
                grad.addmm_(probs.t(), grad_out[rows])
        return None, grad, None


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
    matmuls run in the autocast dtype in both passes, the kernel in fp32. `head` is (kernel, soft cap c or
    None): with a cap the kernel sees c·tanh(logits/c), and its gradient is multiplied by 1 − tanh².
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, head, chunk, *args):
        kernel, softcap = head
        ctx.compute_dtype = _matmul_dtype(hidden)
        outs, saved = [], []
        for rows in _chunks(hidden.shape[0], chunk):
            logits = _chunk_logits(hidden[rows], weight, bias, ctx.compute_dtype, softcap)
            out, keep = kernel.forward(logits, *(a[rows] for a in args))
            outs.append(out)
            saved.append(keep)
        ctx.kernel, ctx.softcap, ctx.chunk, ctx.nargs = kernel, softcap, chunk, len(args)
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
            logits = _chunk_logits(hidden[rows], weight, bias, ctx.compute_dtype, ctx.softcap)
            # d(c·tanh(u/c))/du = 1 − tanh²: taken before the kernel, whose backward may reuse `logits` in place
            slope = None if ctx.softcap is None else 1 - (logits / ctx.softcap).square()
            chunk_grads = tuple(g[rows] for g in grads)
            g_logits = ctx.kernel.backward(logits, keep, tuple(a[rows] for a in args), chunk_grads)
            if slope is not None:
                g_logits = g_logits * slope
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


def _chunk_logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, softcap: float | None = None
) -> Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        b = None if bias is None else bias.to(dtype)
        logits = F.linear(hidden.to(dtype), weight.to(dtype), b).float()
    return logits if softcap is None else softcap_logits(logits, softcap)


def softcap_logits(logits: Tensor, softcap: float) -> Tensor:
    """c·tanh(logits/c) in fp32, as Gemma's heads compute it."""
    return torch.tanh(logits.to(torch.float32) / softcap) * softcap


class DeferrableHead(nn.Linear):
    """An `nn.Linear` LM head that returns a `HeadProjection` while its model is inside `deferred_logits`
    (soft-capped by `softcap` where its model reads capped projections; outside, plain `hidden @ Wᵀ`)."""

    deferred: bool = False
    chunk_rows: int | None = None
    softcap: float | None = None

    def forward(self, hidden: Tensor):
        if self.deferred:
            return HeadProjection(hidden, self.weight, self.bias, self.chunk_rows, self.softcap)
        return super().forward(hidden)


def _post_head(config) -> dict:
    """The post-head settings a config (or its text part, where a multimodal config keeps them) sets."""
    found = {}
    for part in (config, getattr(config, "get_text_config", lambda: None)()):
        for key in _POST_HEAD_KEYS:
            value = getattr(part, key, None)
            if value not in (None, 1, 1.0):
                found[key] = value
    return found


def make_head_deferrable(model: nn.Module, chunk_rows: int | None = None) -> bool:
    """Turn the LM head(s) of `model` into `DeferrableHead`s in place (same parameters); False where the
    model's logits are not a plain linear head (a soft cap or scale after it), which then stay as they are,
    except a soft cap the owning module declares it takes from the projection (`SOFTCAP_IN_HEAD`)."""
    changed = False
    for module in model.modules():
        config = getattr(module, "config", None)
        head = getattr(module, "lm_head", None)
        if config is None or type(head) not in (nn.Linear, DeferrableHead):
            continue
        post = _post_head(config)
        softcap = post.pop(SOFTCAP, None) if getattr(module, SOFTCAP_IN_HEAD, False) else None
        if post:
            continue
        head.__class__ = DeferrableHead
        head.chunk_rows, head.softcap = chunk_rows, softcap
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
