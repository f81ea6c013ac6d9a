"""Block diffusion's canvas loss with analytic own-token evidence (docs/strategies.md §5.4). With "learned"
evidence the canvas loss is the flat cross-entropy (`strategies.losses.FlatCrossEntropyLoss`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from strategies.losses import DLLMLossOutput, nll_at

if TYPE_CHECKING:  # annotations only (the contract's types, strategies.base)
    from strategies.base import CorruptedBatch, TokenCounts

MIN_LEVEL = 1e-6  # noise levels are clamped to [1e-6, 1 − 1e-6] wherever log q(z | x) is formed


class OwnTokenCanvasLoss(nn.Module):
    """Canvas loss with analytic own-token evidence (docs/strategies.md §5.4): the cross-entropy of the
    posterior π ∝ softmax(logits)·q(z_i | x) at the clean token, per scored token, over `max(N, 1)`.

    q(z | x) = (1 − α)/V·(1 + (e^b − 1)·[x = z]) with b = log(1 + V·α/(1 − α)), α = 1 − t, t = `batch.p_mask`
    (the row's noise level), x = `batch.clean_ids` and z = `batch.noisy_ids` (the canvas), so with
    p_z = softmax(logits)_z

        CE_i = −log π(x_i) = CE(logits, x_i) − b·[x_i = z_i] + log(1 + (e^b − 1)·p_z)

    which needs the logits at two ids only (`nll_at`, so a deferred head stays chunked). Like the flat
    loss, every scored canvas token (`batch.loss_mask`) counts, replaced or not; N = `counts.diffusion`, else
    the local count.
    """

    def forward(
        self, logits: Tensor, batch: CorruptedBatch, counts: TokenCounts, *, causal_logits: Tensor | None = None
    ) -> DLLMLossOutput:
        target_ids, noisy_input_ids, p_mask = batch.clean_ids, batch.noisy_ids, batch.p_mask
        if noisy_input_ids is None or p_mask is None:
            raise ValueError(
                "OwnTokenCanvasLoss needs batch.noisy_ids (the canvas) and batch.p_mask (the noise level t)"
            )
        selected = batch.loss_mask.bool()
        vocab = logits.shape[-1]
        nll_x = nll_at(logits, selected, target_ids)
        nll_z = nll_at(logits, selected, noisy_input_ids)
        alpha = 1 - p_mask.double().clamp(MIN_LEVEL, 1)
        b = torch.log1p(vocab * alpha / (1 - alpha))
        log_expm1_b = b + torch.log(-torch.expm1(-b))  # log(e^b − 1); −inf at b = 0 (t = 1) is harmless
        own = (target_ids == noisy_input_ids).to(b.dtype)
        ce = nll_x + (torch.nn.functional.softplus(log_expm1_b - nll_z.double()) - b * own).to(nll_x.dtype)
        total = torch.where(selected, ce, torch.zeros_like(ce)).sum()
        count = counts.diffusion if counts.diffusion is not None else int(selected.sum())
        total = total / max(int(count), 1)
        return DLLMLossOutput(total, total.detach())
