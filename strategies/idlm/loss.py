"""I-DLM's training loss over the `[x_t ‖ x_0]` logits (docs/strategies.md §5.6)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from strategies.losses import DLLMLossOutput, next_token_selection, nll_at


class IDLMLoss(nn.Module):
    """Introspective diffusion loss over `[x_t ‖ x_0]` logits (docs/strategies.md §5.6).

    Q = logits[:, :L] (noisy half), P = logits[:, L:2L] (clean half); the logit at i−1 predicts x_i.
        S_i = answer_i ∧ valid_i (i ≥ 1),  D = max(num_diffusion_tokens, 1) or max(ΣS, 1)
        CE_noisy = Σ S_i·CE(Q_{i−1}, x_i)/D,   CE_clean = Σ S_i·CE(P_{i−1}, x_i)/D
        α = clean_loss_weight, or stopgrad(CE_noisy / max(CE_clean, 1e-6)) with auto_balance
        total = CE_noisy + α·CE_clean,   dllm_loss = CE_noisy
    """

    def __init__(self, clean_loss_weight: float = 0.2, auto_balance: bool = False):
        super().__init__()
        self.clean_loss_weight, self.auto_balance = clean_loss_weight, auto_balance

    def forward(
        self,
        logits: Tensor,
        target_ids: Tensor,
        answer_mask: Tensor,
        valid_mask: Tensor,
        *,
        seq_len: int,
        num_diffusion_tokens: int | Tensor | None = None,
    ) -> DLLMLossOutput:
        sel, targets = next_token_selection(answer_mask.bool() & valid_mask.bool(), target_ids)
        denom = max(int(num_diffusion_tokens), 1) if num_diffusion_tokens is not None else max(int(sel.sum()), 1)
        # both halves in one pass over the [B, 2L, V] logits: no slice copies of the vocabulary axis
        nll = nll_at(logits, torch.cat([sel, sel], dim=1), torch.cat([targets, targets], dim=1))
        ce_noisy = nll[:, :seq_len].sum() / denom
        ce_clean = nll[:, seq_len : 2 * seq_len].sum() / denom
        alpha = (ce_noisy / ce_clean.clamp_min(1e-6)).detach() if self.auto_balance else self.clean_loss_weight
        return DLLMLossOutput(ce_noisy + alpha * ce_clean, ce_noisy.detach())
