"""The losses and bounds more than one strategy computes, and the pieces every loss is built from.

A loss module has the common call contract (`strategies.base.DiffusionLoss`, which says what each argument
is and which `CorruptedBatch` fields a loss reads; docs/strategies.md §5.1):
`loss(logits, batch, counts, *, causal_logits=None)` with `batch` a `CorruptedBatch` and `counts` a
`TokenCounts`, returns `DLLMLossOutput(total_loss, dllm_loss, ...)` (those three types are the seed API's, in
`strategies.base`; `DLLMLossOutput` is importable from here too). Denominators are the *global* token counts
of the whole optimizer step (all micro-batches, all-reduced over data-parallel ranks).

Here: per-token and selected-position cross-entropy (`per_token_nll`, `nll_at`), the exact causal NLL
(`causal_nll_rows`) and next-token CE on clean text (`encoder_ar_loss`), the flat cross-entropy
(`FlatCrossEntropyLoss`), the absorbing-kernel bound (`absorbing_nelbo_rows`) and the uniform-noise bound
(`uniform_diffusion_nelbo_terms`). A loss only one strategy uses lives in that strategy's package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from strategies.base import CorruptedBatch, DLLMLossOutput, TokenCounts  # the loss contract
from strategies.corruption import mask_at_level
from strategies.head import HeadProjection, Logits, row_nll


def per_token_nll(logits: Logits, target_ids: Tensor) -> Tensor:
    """Unreduced CE: logits [..., V] (a tensor or a `HeadProjection`), targets [...] → [...] in fp32."""
    return row_nll(logits, target_ids)


GATHER_BELOW = 0.4  # below this fraction of selected rows, copying them out beats one CE over every row


def nll_at(logits: Logits, selected: Tensor, target_ids: Tensor) -> Tensor:
    """CE at the `selected` positions of logits `[..., V]` (targets `[...]`), zero elsewhere, fp32, shaped like
    `selected`. Dense selections run one cross-entropy over every row (unselected targets ignored), sparse ones
    gather their rows first, a `HeadProjection` computes the head only at the selected rows (docs/strategies.md
    §5.9); all three give the same values."""
    selected = selected.bool()
    dense = not isinstance(logits, HeadProjection) and float(selected.float().mean()) >= GATHER_BELOW
    if dense:
        targets = torch.where(selected, target_ids, torch.full_like(target_ids, _IGNORE))
        flat = logits.reshape(-1, logits.shape[-1])
        if flat.dtype in (torch.bfloat16, torch.float16):
            flat = flat.float()
        nll = F.cross_entropy(flat, targets.reshape(-1), reduction="none", ignore_index=_IGNORE)
        return nll.view(selected.shape)
    out = torch.zeros(selected.shape, dtype=torch.float32, device=selected.device)
    return out.index_put((selected,), row_nll(logits[selected], target_ids[selected]))


_IGNORE = -100


def next_token_selection(select: Tensor, target_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Selection and targets for "logit i predicts token i + 1" on unshifted logits `[B, L, V]`: position i is
    selected when `select[:, i + 1]` is (the last position never is) and its target is `target_ids[:, i + 1]`."""
    sel = torch.zeros_like(select, dtype=torch.bool)
    sel[:, :-1] = select[:, 1:].bool()
    targets = torch.zeros_like(target_ids)
    targets[:, :-1] = target_ids[:, 1:]
    return sel, targets


def causal_nll_rows(
    causal_logits: Logits, target_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Exact left-to-right NLL of the supervised tokens (logit i−1 predicts x_i): (Σ nll, count) per row."""
    sel, targets = next_token_selection(loss_mask.bool() & attention_mask.bool(), target_ids)
    return nll_at(causal_logits, sel, targets).sum(dim=1), sel.sum(dim=1)


class FlatCrossEntropyLoss(nn.Module):
    """The flat cross-entropy: L = Σ_i ℓ_i·CE_i / max(N, 1), ℓ = `batch.loss_mask`, N = `counts.diffusion` (the
    global count) or the local Σℓ. No 1/p weight and no noise gating: every supervised token counts, corrupted or
    not (block diffusion's canvas loss with "learned" own-token evidence, DiffusionGemma's, docs/strategies.md
    §5.4).
    """

    def forward(
        self, logits: Tensor, batch: CorruptedBatch, counts: TokenCounts, *, causal_logits: Tensor | None = None
    ) -> DLLMLossOutput:
        selected = batch.loss_mask.bool()
        total = nll_at(logits, selected, batch.clean_ids).sum()
        count = counts.diffusion if counts.diffusion is not None else int(selected.sum())
        total = total / max(int(count), 1)
        return DLLMLossOutput(total, total.detach())


BlockDiffusionCrossEntropyLoss = FlatCrossEntropyLoss  # the name it had as block diffusion's (seed API export)


def encoder_ar_loss(
    encoder_logits: Tensor, input_ids: Tensor, valid_mask: Tensor | None = None, num_tokens: int | Tensor | None = None
) -> Tensor:
    """Next-token CE over the clean sequence (docs/strategies.md §5.5): logits at i predict x_{i+1}, counted where
    valid_i ∧ valid_{i+1}; divided by max(num_tokens or the local count, 1)."""
    valid = torch.ones_like(input_ids, dtype=torch.bool) if valid_mask is None else valid_mask.bool()
    pairs = valid[:, :-1] & valid[:, 1:]
    sel, targets = next_token_selection(torch.nn.functional.pad(pairs, (1, 0)), input_ids)
    total = nll_at(encoder_logits, sel, targets).sum()
    count = num_tokens if num_tokens is not None else int(pairs.sum())
    return total / max(int(count), 1)


def uniform_diffusion_nelbo_terms(
    logits: Tensor, target_ids: Tensor, noisy_ids: Tensor, alpha: Tensor, vocab_size: int
) -> Tensor:
    """Per-token integrand of the continuous-time NELBO of uniform-noise diffusion, linear α_t = 1 − t.

    Forward: q(z_t | x) = α_t·e_x + (1 − α_t)/N. With x̄ = N·α_t·e_x + (1 − α_t) and
    x̄_θ = N·α_t·π_θ + (1 − α_t), the reverse-rate KL at noisy token z is

        (−α'_t / (N·α_t)) · [ N/x̄_θ,z − N/x̄_z + Σ_y (x̄_y/x̄_z)·log( x̄_y·x̄_θ,z / (x̄_z·x̄_θ,y) ) ]

    (the y = z term is 0). Its integral over t ∈ (0, 1) bounds −log p_θ(x) per token (UDLM,
    Schiff et al. 2024); a one-sample estimate at t ~ U(0, 1) is this term. `alpha` is [B] (one
    level per row); returns [B, L] in float64. A perfect denoiser (π_θ = e_x) scores 0.
    """
    n = float(vocab_size)
    a = alpha.double()[:, None, None]
    probs = torch.softmax(logits.double(), dim=-1)
    if probs.shape[-1] != vocab_size:
        raise ValueError(f"logits have {probs.shape[-1]} classes but the noise draws from vocab_size={vocab_size}")
    xbar_theta = n * a * probs + (1 - a)
    xbar = (1 - a) + n * a * torch.nn.functional.one_hot(target_ids, vocab_size).double()
    z = noisy_ids[..., None]
    xbar_z = torch.gather(xbar, -1, z)
    xbar_theta_z = torch.gather(xbar_theta, -1, z)
    log_ratio = torch.log(xbar) - torch.log(xbar_z) + torch.log(xbar_theta_z) - torch.log(xbar_theta)
    inner = ((xbar / xbar_z) * log_ratio).sum(dim=-1)
    bracket = n / xbar_theta_z[..., 0] - n / xbar_z[..., 0] + inner
    return bracket / (n * a[..., 0])  # −α'_t = 1 for the linear schedule


def absorbing_nelbo_rows(
    denoise,
    clean_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    t: Tensor,
    generator: torch.Generator,
    corrupt=mask_at_level,
) -> Tensor:
    """One-sample NELBO estimate per row of the absorbing [MASK] kernel at masking level t [B]:
    (1/t)·Σ_{masked ∧ ℓ} −log p_θ(x|z) (docs/evaluation.md §4.1), with `denoise(x, attention_mask) → logits`.
    `corrupt(clean_ids, loss_mask, mask_token_id, t, generator) → (noisy, noise mask)` is the kernel at level t:
    a strategy's own (`DLLMStrategy.corrupt_at_level`), the absorbing `mask_at_level` by default."""
    noisy, noise = corrupt(clean_ids, loss_mask, mask_token_id, t, generator)
    logits = denoise(noisy, None)
    nll = per_token_nll(logits.float(), clean_ids) * (noise & loss_mask.bool())
    return nll.sum(dim=1) / t
