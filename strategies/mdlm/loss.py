"""MDLM's training loss: the masked cross-entropy with the bound's 1/t weights, or flat (docs/strategies.md §5.2)."""

from __future__ import annotations

from torch import Tensor, nn

from strategies.losses import DLLMLossOutput, nll_at


class MDLMCrossEntropyLoss(nn.Module):
    """MDLM / LLaDA loss (docs/strategies.md §5.2).

        L = Σ_i [n_i ∧ ℓ_i] · CE_i · w_i / max(N, 1),   w_i = 1 / max(p_i, 1e-8)

    N = `num_diffusion_tokens` (the step's global supervised count); with N=None the sum is not
    normalized. `weighting="flat"` sets w_i = 1 (a training-speed option; the bound is always
    reported by evaluation). total_loss == dllm_loss.
    """

    def __init__(self, weighting: str = "elbo"):
        super().__init__()
        if weighting not in ("elbo", "flat"):
            raise ValueError(f"weighting must be 'elbo' or 'flat', got {weighting!r}")
        self.weighting = weighting

    def forward(
        self,
        logits: Tensor,
        target_ids: Tensor,
        noise_mask: Tensor,
        p_mask: Tensor,
        loss_mask: Tensor,
        *,
        loss_mask_ar: Tensor | None = None,
        num_diffusion_tokens: int | Tensor | None = None,
        num_ar_tokens: int | Tensor | None = None,
        causal_logits: Tensor | None = None,
        noisy_input_ids: Tensor | None = None,
    ) -> DLLMLossOutput:
        selected = noise_mask.bool() & loss_mask.bool()
        nll = nll_at(logits, selected, target_ids)
        if self.weighting == "elbo":
            nll = nll / p_mask.clamp_min(1e-8).to(nll.dtype)
        total = nll.sum()
        if num_diffusion_tokens is not None:
            total = total / max(int(num_diffusion_tokens), 1)
        return DLLMLossOutput(total, total.detach())
