"""Block diffusion's canvas loss with analytic own-token evidence (docs/strategies.md §5.4). With "learned"
evidence the canvas loss is the flat cross-entropy (`strategies.losses.FlatCrossEntropyLoss`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from strategies.losses import DLLMLossOutput, nll_at

MIN_LEVEL = 1e-6  # noise levels are clamped to [1e-6, 1 − 1e-6] wherever log q(z | x) is formed


class OwnTokenCanvasLoss(nn.Module):
    """Canvas loss with analytic own-token evidence (docs/strategies.md §5.4): the cross-entropy of the
    posterior π ∝ softmax(logits)·q(z_i | x) at the clean token, per scored token, over `max(N, 1)`.

    q(z | x) = (1 − α)/V·(1 + (e^b − 1)·[x = z]) with b = log(1 + V·α/(1 − α)), α = 1 − t and t = `p_mask`
    (the row's noise level), so with p_z = softmax(logits)_z

        CE_i = −log π(x_i) = CE(logits, x_i) − b·[x_i = z_i] + log(1 + (e^b − 1)·p_z)

    which needs the logits at two ids only (`nll_at`, so a deferred head stays chunked). Like the flat
    loss, every scored canvas token counts, replaced or not.
    """

    def forward(
        self,
        logits,
        target_ids: Tensor,
        noise_mask: Tensor | None,
        p_mask: Tensor | None,
        loss_mask: Tensor,
        *,
        loss_mask_ar: Tensor | None = None,
        num_diffusion_tokens: int | Tensor | None = None,
        num_ar_tokens: int | Tensor | None = None,
        causal_logits: Tensor | None = None,
        noisy_input_ids: Tensor | None = None,
    ) -> DLLMLossOutput:
        if noisy_input_ids is None or p_mask is None:
            raise ValueError("OwnTokenCanvasLoss needs noisy_input_ids (the canvas) and p_mask (the noise level t)")
        selected = loss_mask.bool()
        vocab = logits.shape[-1]
        nll_x = nll_at(logits, selected, target_ids)
        nll_z = nll_at(logits, selected, noisy_input_ids)
        alpha = 1 - p_mask.double().clamp(MIN_LEVEL, 1)
        b = torch.log1p(vocab * alpha / (1 - alpha))
        log_expm1_b = b + torch.log(-torch.expm1(-b))  # log(e^b − 1); −inf at b = 0 (t = 1) is harmless
        own = (target_ids == noisy_input_ids).to(b.dtype)
        ce = nll_x + (torch.nn.functional.softplus(log_expm1_b - nll_z.double()) - b * own).to(nll_x.dtype)
        total = torch.where(selected, ce, torch.zeros_like(ce)).sum()
        count = num_diffusion_tokens if num_diffusion_tokens is not None else int(selected.sum())
        total = total / max(int(count), 1)
        return DLLMLossOutput(total, total.detach())
