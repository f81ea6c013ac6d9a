"""DFlash's losses (docs/strategies.md §5.7): the decay-weighted block loss and D-PACE, hard or soft (top-k)
labels, and the teacher-forced acceptance they imply.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from strategies.dflash.prefix import prefix_decay_weights
from strategies.losses import DLLMLossOutput

PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFlash paper App. A.1 decay γ by block size


def default_gamma(block_size: int) -> float:
    return PAPER_GAMMA.get(block_size, max(2.0, block_size / 2))


class DFlashDecayLoss(nn.Module):
    """Σ w_k · block_mask · CE(logits, target) with w_k = exp(−(k−1)/γ) (k = 1 right after the anchor).

    `normalize="tokens"`: ÷ max(num_tokens, 1) when given, else unnormalized; `"mean"`: ÷ (Σ W + 1e-6).
    Returns `DLLMLossOutput` with per-offset correct/count sums when the block layout is known.
    `prefix` (`[B, N]`, `loss_type: variable_prefix`): block n of row b showed the draft its first p tokens after
    the anchor; those predictions weigh 0 and the decay restarts after them, `exp(−(k − 1 − p)/γ)`
    (`strategies.dflash.prefix.prefix_decay_weights`; p = 0 everywhere is the plain decay).
    Subclasses change only the position weights (`position_weights`; D-PACE: `DFlashDPACELoss`).
    """

    def __init__(
        self,
        loss_gamma: float | None = 7.0,
        use_fused_linear_ce: bool = False,
        chunk_size: int = 1024,
        normalize: str = "tokens",
    ):
        super().__init__()
        if normalize not in ("tokens", "mean"):
            raise ValueError(f"normalize must be 'tokens' or 'mean', got {normalize!r}")
        self.loss_gamma, self.use_fused_linear_ce = loss_gamma, use_fused_linear_ce
        self.chunk_size, self.normalize = chunk_size, normalize

    def weights(self, length: int, block_size: int | None, device) -> Tensor:
        if self.loss_gamma is None:
            return torch.ones(length, device=device)
        per = (block_size - 1) if block_size else length
        w = torch.exp(-torch.arange(per, device=device, dtype=torch.float32) / self.loss_gamma)
        return w.repeat(math.ceil(length / per))[:length]

    def position_weights(
        self, nll: Tensor, block_mask: Tensor, block_size: int | None, prefix: Tensor | None = None
    ) -> Tensor:
        """Weight of every predicted position, `[1 or B, T]`, before the block mask: the fixed decay, restarted
        after each block's shown prefix when `prefix` is given."""
        if prefix is None:
            return self.weights(nll.shape[1], block_size, nll.device)[None]
        if not block_size or nll.shape[1] != prefix.shape[1] * (block_size - 1):
            raise ValueError(
                f"prefix lengths need the block layout: {nll.shape[1]} predictions, {prefix.shape[1]} blocks, "
                f"block size {block_size}"
            )
        return prefix_decay_weights(prefix.to(nll.device), block_size, self.loss_gamma)

    def _reduce(
        self,
        nll: Tensor,
        correct: Tensor,
        block_mask: Tensor,
        num_tokens,
        block_size,
        ce: Tensor | None = None,
        prefix: Tensor | None = None,
    ) -> DLLMLossOutput:
        """`nll`: −log q(true token) per prediction (it sets D-PACE's weights); `ce`: the term summed (the soft-label
        cross-entropy when the target's distribution is the label, else `nll` itself)."""
        w = self.position_weights(nll, block_mask, block_size, prefix) * block_mask.float()
        total = ((nll if ce is None else ce).float() * w).sum()
        if self.normalize == "mean":
            total = total / (w.sum() + 1e-6)
        elif num_tokens is not None:
            total = total / max(int(num_tokens), 1)
        per_correct = per_count = None
        if block_size and block_size > 1 and nll.shape[1] % (block_size - 1) == 0:
            shape = (nll.shape[0], -1, block_size - 1)
            m = block_mask.float().reshape(shape)
            per_correct = (correct.float().reshape(shape) * m).sum(dim=(0, 1))
            per_count = m.sum(dim=(0, 1))
        return DLLMLossOutput(total, total.detach(), per_correct, per_count)

    def forward(
        self,
        logits: Tensor,
        target_ids: Tensor,
        block_mask: Tensor,
        num_tokens=None,
        block_size: int | None = None,
        soft: SoftLabels | None = None,
        prefix: Tensor | None = None,
    ) -> DLLMLossOutput:
        nll, ce, correct = self.token_losses(logits, target_ids, soft)
        return self._reduce(nll, correct, block_mask, num_tokens, block_size, ce, prefix)

    def token_losses(self, logits: Tensor, target_ids: Tensor, soft: SoftLabels | None):
        """Per prediction: −log q(true token), the term the loss sums, and whether the draft's argmax is the true
        token (`_token_losses`; the forward-KL loss sums its divergence instead)."""
        return _token_losses(logits, target_ids, soft)

    def forward_fused(
        self,
        hidden: Tensor,
        lm_head_weight: Tensor,
        target_ids: Tensor,
        block_mask: Tensor,
        num_tokens=None,
        block_size: int | None = None,
        lm_head_bias: Tensor | None = None,
        soft: SoftLabels | None = None,
        prefix: Tensor | None = None,
    ) -> DLLMLossOutput:
        """Chunks of `chunk_size` rows through linear + CE under activation checkpointing: the
        [B·T, V] logits never stay alive for backward."""
        return self.forward_chunked(
            lambda h: (F.linear(h, lm_head_weight, lm_head_bias),),
            (hidden,),
            target_ids,
            block_mask,
            num_tokens=num_tokens,
            block_size=block_size,
            soft=soft,
            prefix=prefix,
        )[0]

    def forward_chunked(
        self,
        make_logits,
        inputs: tuple[Tensor, ...],
        target_ids: Tensor,
        block_mask: Tensor,
        num_tokens=None,
        block_size: int | None = None,
        soft: SoftLabels | None = None,
        prefix: Tensor | None = None,
    ) -> list[DLLMLossOutput]:
        """One loss per logits `make_logits(*chunk)` returns (a tuple) from chunks of `chunk_size` rows of `inputs`
        (each `[B, T, …]`), under activation checkpointing: only a chunk's `[rows, V]` logits ever exist, none stays
        alive for backward, and the work they share is done once per chunk (`forward_fused`: the head alone;
        Domino: the head plus its correction, and in its curriculum the head's own logits beside them)."""
        flat, tgt = [x.flatten(0, 1) for x in inputs], target_ids.flatten()
        flat_soft = None if soft is None else SoftLabels(soft.ids.flatten(0, 1), soft.probs.flatten(0, 1))
        n = len(flat)

        def chunk(t, *args):
            labels = SoftLabels(*args[n:]) if args[n:] else None
            return tuple(part for logits in make_logits(*args[:n]) for part in self.token_losses(logits, t, labels))

        parts = []
        for start in range(0, tgt.shape[0], self.chunk_size):
            rows = slice(start, start + self.chunk_size)
            labels = () if flat_soft is None else (flat_soft.ids[rows], flat_soft.probs[rows])
            parts.append(checkpoint(chunk, tgt[rows], *(x[rows] for x in flat), *labels, use_reentrant=False))
        joined = [torch.cat(p).view_as(target_ids) for p in zip(*parts)]  # (nll, ce, correct) per logits
        return [
            self._reduce(nll, correct, block_mask, num_tokens, block_size, ce, prefix)
            for nll, ce, correct in zip(joined[0::3], joined[1::3], joined[2::3])
        ]


class SoftLabels(NamedTuple):
    """The target's next-token distribution as a label (EAGLE's and DistillSpec's distillation target): its
    `k` most probable tokens `ids` `[..., k]` and their probabilities `probs` (renormalized over the k)."""

    ids: Tensor
    probs: Tensor


def _token_losses(logits: Tensor, target_ids: Tensor, soft: SoftLabels | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per prediction: −log q(true token), the term the loss sums (the same, or the cross-entropy to the soft
    label, −Σ_j p_j log q(id_j)), and whether the draft's argmax is the true token."""
    logp = logits.float().log_softmax(dim=-1)
    nll = -logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    ce = nll if soft is None else -(soft.probs * logp.gather(-1, soft.ids.long())).sum(dim=-1)
    return nll, ce, logp.argmax(dim=-1) == target_ids


def top_k_labels(logits: Tensor, k: int) -> SoftLabels:
    """The `k` most probable next tokens under `logits` `[..., V]` and their (full-softmax) probabilities."""
    probs, ids = logits.float().softmax(dim=-1).topk(k, dim=-1)
    return SoftLabels(ids.to(torch.int32), probs)


def block_soft_labels(top: SoftLabels, anchors: Tensor, block_size: int, k: int) -> SoftLabels:
    """The soft labels of every block prediction, `[B, N·(bs − 1), k]`: prediction k of an anchor at A is the
    token at A + k, whose distribution the target gave at position A + k − 1 (clamped to the row, like the
    targets; masked there). The first `k` of the stored ones, renormalized to sum to 1."""
    bsz, length = top.ids.shape[:2]
    pos = (anchors[:, :, None] + torch.arange(block_size - 1, device=anchors.device)).clamp_max(length - 1)
    flat = pos.reshape(bsz, -1, 1).expand(-1, -1, k)
    ids = top.ids[..., :k].gather(1, flat)
    probs = top.probs[..., :k].float().gather(1, flat)
    return SoftLabels(ids, probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-12))


DPACE_ALPHA = 0.5  # D-PACE's confidence smoothing α (Wu et al. 2026, arXiv 2605.18810, Eq. 7), the paper's default


def dpace_weights(nll: Tensor, block_mask: Tensor, block_size: int, alpha: float = DPACE_ALPHA) -> Tensor:
    """D-PACE position weights (Wu et al. 2026, "D-PACE: Dynamic Position-Aware Cross-Entropy for Parallel
    Speculative Drafting", arXiv 2605.18810, Eq. 7-8), detached, `[B, T]` for `T = N·(bs − 1)` predictions.

    Within each block, with `q_k = exp(−nll_k)` the draft's probability of the true token at offset k:
    `q̃_k = α + (1 − α)·q_k` (1 where the block mask is 0, so a masked slot neither shrinks nor counts),
    `C_m = Π_{k ≤ m} q̃_k` (the chance the block is still accepted at m) and `w_k = Σ_{m ≥ k} C_m` (the
    accepted length still riding on position k). Masked positions get weight 0."""
    per = block_size - 1
    if nll.shape[1] % per:
        raise ValueError(f"D-PACE weights need whole blocks: {nll.shape[1]} predictions, block size {block_size}")
    with torch.no_grad():
        shape = (nll.shape[0], -1, per)
        valid = block_mask.reshape(shape) > 0
        q = torch.exp(-nll.detach().float()).reshape(shape)
        smooth = torch.where(valid, alpha + (1.0 - alpha) * q, torch.ones_like(q))
        reach = torch.cumprod(smooth, dim=-1) * valid
        after = reach.flip(-1).cumsum(-1).flip(-1)  # Σ_{m ≥ k} C_m
        return (after * valid).reshape(nll.shape)


class DFlashDPACELoss(DFlashDecayLoss):
    """D-PACE in place of the fixed decay: `Σ w_k · block_mask · CE / max(num_tokens, 1)`, with the detached
    weights of `dpace_weights` recomputed from the draft's own confidences at every call (docs/strategies.md
    §5.7). The strategy passes the global number of scored blocks as `num_tokens`, so the loss is the weighted
    CE per block. Needs the block layout (`block_size`); the gradient flows through CE only."""

    def __init__(self, alpha: float = DPACE_ALPHA, use_fused_linear_ce: bool = False, chunk_size: int = 1024):
        super().__init__(None, use_fused_linear_ce, chunk_size, "tokens")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"the D-PACE smoothing alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)

    def position_weights(
        self, nll: Tensor, block_mask: Tensor, block_size: int | None, prefix: Tensor | None = None
    ) -> Tensor:
        if prefix is not None:
            raise ValueError("the D-PACE loss has no shown prefix: loss_type is dpace or variable_prefix, not both")
        if not block_size or block_size < 2:
            raise ValueError("the D-PACE loss needs the block size (block_size=...) to find each block")
        return dpace_weights(nll, block_mask, block_size, self.alpha)


class DFlashForwardKLLoss(DFlashDecayLoss):
    """JetSpec's objective (arXiv 2606.18394, §2.3, Eq. 8-9; docs/strategies.md §10.14): every
    supervised prediction weighs 1 (no decay) and the term summed is `T² · KL(p_T ‖ q_T)`, the forward KL from the
    target's next-token distribution to the draft's, both at temperature `T` (the T² keeps the gradient's scale
    independent of T, as in Hinton et al. 2015), ÷ max(num_tokens, 1) like the other DFlash losses.

    The target's distribution is the soft label (`dflash.distill_top_k`): its top k tokens, `p_T ∝ p^(1/T)`
    renormalized over them; with k = V it is the target's full `softmax(logits / T)`, the reference's teacher
    exactly. `q_T = softmax(draft logits / T)` over the whole vocabulary."""

    def __init__(self, temperature: float = 1.0, use_fused_linear_ce: bool = False, chunk_size: int = 1024):
        super().__init__(None, use_fused_linear_ce, chunk_size, "tokens")
        if not temperature > 0:
            raise ValueError(f"the forward-KL temperature must be positive, got {temperature}")
        self.temperature = float(temperature)

    def token_losses(self, logits: Tensor, target_ids: Tensor, soft: SoftLabels | None):
        if soft is None:
            raise ValueError(
                "the forward-KL loss distills the target's distribution: set dflash.distill_top_k (the target's top-k "
                "tokens kept as the teacher, e.g. 32)"
            )
        t = self.temperature
        logq = logits.float().log_softmax(dim=-1)
        nll = -logq.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
        teacher = (soft.probs.float().clamp_min(1e-30).log() / t).log_softmax(dim=-1)  # log p_T over the k
        # log q_T at the k (at T = 1 it is logq: the [rows, V] log-softmax is taken once)
        logq_t = logq if t == 1.0 else (logits.float() / t).log_softmax(dim=-1)
        student = logq_t.gather(-1, soft.ids.long())
        kl = (teacher.exp() * (teacher - student)).sum(dim=-1)
        return nll, (t * t) * kl, logq.argmax(dim=-1) == target_ids


def scored_blocks(block_mask: Tensor, block_size: int) -> int:
    """Blocks with at least one supervised prediction in a `[B, N·(bs − 1)]` block mask (D-PACE's count)."""
    return int((block_mask.reshape(block_mask.shape[0], -1, block_size - 1) > 0).any(dim=-1).sum())


def acceptance_from_correct(correct: Tensor, block_mask: Tensor, block_size: int) -> tuple[float, list[float]]:
    """Teacher-forced τ_sim = mean over kept blocks of 1 + Σ_k Π_{j≤k} correct_j, and acc_k per offset."""
    shape = (-1, block_size - 1)
    c, m = correct.float().reshape(shape), block_mask.float().reshape(shape)
    kept = m[:, 0] > 0
    run = torch.cumprod(c * (m > 0), dim=1)
    tau = float((1 + run.sum(dim=1))[kept].mean()) if kept.any() else float("nan")
    acc = ((c * m).sum(0) / m.sum(0).clamp_min(1)).tolist()
    return tau, acc
