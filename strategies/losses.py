"""dLLM loss modules with the common call contract of spec §5.1.

`loss(logits, target_ids, noise_mask, p_mask, loss_mask, *, loss_mask_ar=None,
num_diffusion_tokens=None, num_ar_tokens=None, causal_logits=None, noisy_input_ids=None)`
returns `DLLMLossOutput(total_loss, dllm_loss, ...)`. Denominators are the *global* token counts
of the whole optimizer step (all micro-batches, all-reduced over data-parallel ranks).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DLLMLossOutput(NamedTuple):
    total_loss: Tensor
    dllm_loss: Tensor
    draft_correct_per_pos: Tensor | None = None
    draft_count_per_pos: Tensor | None = None


def per_token_nll(logits: Tensor, target_ids: Tensor) -> Tensor:
    """Unreduced CE: logits [..., V], targets [...] → [...] (in the logits' dtype)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, vocab), target_ids.reshape(-1), reduction="none").view(target_ids.shape)


class MDLMCrossEntropyLoss(nn.Module):
    """MDLM / LLaDA loss (spec §5.2).

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

    def forward(self, logits: Tensor, target_ids: Tensor, noise_mask: Tensor, p_mask: Tensor, loss_mask: Tensor, *,
                loss_mask_ar: Tensor | None = None, num_diffusion_tokens: int | Tensor | None = None,
                num_ar_tokens: int | Tensor | None = None, causal_logits: Tensor | None = None,
                noisy_input_ids: Tensor | None = None) -> DLLMLossOutput:
        selected = noise_mask.bool() & loss_mask.bool()
        nll = per_token_nll(logits[selected], target_ids[selected])  # only the scored rows of the vocab matmul
        if self.weighting == "elbo":
            nll = nll / p_mask[selected].clamp_min(1e-8).to(nll.dtype)
        total = nll.sum()
        if num_diffusion_tokens is not None:
            total = total / max(int(num_diffusion_tokens), 1)
        return DLLMLossOutput(total, total.detach())
