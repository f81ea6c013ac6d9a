"""The hybrid's training loss: the masked diffusion term plus the causal branch's next-token term
(docs/strategies.md §5.3)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from strategies.losses import DLLMLossOutput, next_token_selection, nll_at


def _maybe_divide(total: Tensor, count: int | Tensor | None) -> Tensor:
    return total if count is None else total / max(int(count), 1)


class HybridDiffusionLLMLoss(nn.Module):
    """Diffusion + AR loss of the hybrid (Nemotron-Labs-Diffusion) strategy (docs/strategies.md §5.3).

        L_diff = Σ_i [n_i ∧ ℓ_i]·CE_i·w_i / max(N_diff, 1),   w_i = nan_to_num(1/max(p_i, 1e-8)) (±inf → 1)
        L_AR   = Σ_{i≥1} ℓ^AR_i · CE(causal_{i−1}, x_i) / max(N_AR, 1)   (only with causal logits and ℓ^AR)
        total  = α·L_diff + L_AR,   dllm_loss = α·L_diff

    A legacy `[B, 2L, V]` logits tensor is split into diffusion (first L) and causal (rest) halves.
    Each division happens only when its count is given.
    """

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.alpha = alpha

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
        length = target_ids.shape[1]
        if causal_logits is None and logits.shape[1] > length:
            logits, causal_logits = logits[:, :length], logits[:, length:]
        selected = noise_mask.bool() & loss_mask.bool()
        weight = torch.nan_to_num(1.0 / p_mask.clamp_min(1e-8), posinf=1.0, neginf=1.0)
        diffusion = _maybe_divide((nll_at(logits, selected, target_ids) * weight).sum(), num_diffusion_tokens)
        total = self.alpha * diffusion
        dllm = total.detach()
        if causal_logits is not None and loss_mask_ar is not None:
            ar = nll_at(causal_logits, *next_token_selection(loss_mask_ar, target_ids)).sum()
            total = total + _maybe_divide(ar, num_ar_tokens)
        return DLLMLossOutput(total, dllm)
