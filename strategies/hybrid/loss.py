"""The hybrid's training loss: the masked diffusion term plus the causal branch's next-token term
(docs/strategies.md §5.3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from strategies.losses import DLLMLossOutput, next_token_selection, nll_at

if TYPE_CHECKING:  # annotations only (the contract's types, strategies.base)
    from strategies.base import CorruptedBatch, TokenCounts


def _maybe_divide(total: Tensor, count: int | Tensor | None) -> Tensor:
    return total if count is None else total / max(int(count), 1)


class HybridDiffusionLLMLoss(nn.Module):
    """Diffusion + AR loss of the hybrid (Nemotron-Labs-Diffusion) strategy (docs/strategies.md §5.3).

        L_diff = Σ_i [n_i ∧ ℓ_i]·CE_i·w_i / max(N_diff, 1),   w_i = nan_to_num(1/max(p_i, 1e-8)) (±inf → 1)
        L_AR   = Σ_{i≥1} ℓ_i · CE(causal_{i−1}, x_i) / max(N_AR, 1)   (only with causal logits)
        total  = α·L_diff + L_AR,   dllm_loss = α·L_diff

    x = `batch.clean_ids`, n = `batch.noise_mask`, ℓ = `batch.loss_mask` (both terms supervise it), p =
    `batch.p_mask`, N_diff / N_AR = `counts.diffusion` / `counts.ar`; each division happens only when its count
    is given. A legacy `[B, 2L, V]` logits tensor is split into diffusion (first L) and causal (rest) halves.
    """

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.alpha = alpha

    def forward(
        self, logits: Tensor, batch: CorruptedBatch, counts: TokenCounts, *, causal_logits: Tensor | None = None
    ) -> DLLMLossOutput:
        target_ids = batch.clean_ids
        length = target_ids.shape[1]
        if causal_logits is None and logits.shape[1] > length:
            logits, causal_logits = logits[:, :length], logits[:, length:]
        selected = batch.noise_mask.bool() & batch.loss_mask.bool()
        weight = torch.nan_to_num(1.0 / batch.p_mask.clamp_min(1e-8), posinf=1.0, neginf=1.0)
        diffusion = _maybe_divide((nll_at(logits, selected, target_ids) * weight).sum(), counts.diffusion)
        total = self.alpha * diffusion
        dllm = total.detach()
        if causal_logits is not None:
            ar = nll_at(causal_logits, *next_token_selection(batch.loss_mask, target_ids)).sum()
            total = total + _maybe_divide(ar, counts.ar)
        return DLLMLossOutput(total, dllm)
