"""MDLM's training loss: the masked cross-entropy with the bound's 1/t weights, or flat (docs/strategies.md §5.2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from strategies.losses import DLLMLossOutput, nll_at

if TYPE_CHECKING:  # annotations only (the contract's types, strategies.base)
    from strategies.base import CorruptedBatch, TokenCounts


class MDLMCrossEntropyLoss(nn.Module):
    """MDLM / LLaDA loss (docs/strategies.md §5.2).

        L = Σ_i [n_i ∧ ℓ_i] · CE_i · w_i / max(N, 1),   w_i = 1 / max(p_i, 1e-8)

    n = `batch.noise_mask`, ℓ = `batch.loss_mask`, p = `batch.p_mask`, N = `counts.diffusion` (the step's global
    supervised count); with N=None the sum is not normalized. `weighting="flat"` sets w_i = 1 (a training-speed
    option; the bound is always reported by evaluation). total_loss == dllm_loss.
    """

    def __init__(self, weighting: str = "elbo"):
        super().__init__()
        if weighting not in ("elbo", "flat"):
            raise ValueError(f"weighting must be 'elbo' or 'flat', got {weighting!r}")
        self.weighting = weighting

    def forward(
        self, logits: Tensor, batch: CorruptedBatch, counts: TokenCounts, *, causal_logits: Tensor | None = None
    ) -> DLLMLossOutput:
        selected = batch.noise_mask.bool() & batch.loss_mask.bool()
        nll = nll_at(logits, selected, batch.clean_ids)
        if self.weighting == "elbo":
            nll = nll / batch.p_mask.clamp_min(1e-8).to(nll.dtype)
        total = nll.sum()
        if counts.diffusion is not None:
            total = total / max(int(counts.diffusion), 1)
        return DLLMLossOutput(total, total.detach())
