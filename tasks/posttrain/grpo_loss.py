"""The policy objective of GRPO for dLLMs (docs/post-training.md, "GRPO's objective"): group-relative advantages,
the PPO-clipped ratio per completion token, the k3 estimate of the KL divergence to a frozen reference, and the
completion mask up to and including the first EOS. The per-token log-probabilities come from a likelihood
estimator (d1's one-step, DiffuCoder's coupled, …); this module only combines them, so one objective serves them
all. Shao et al. (2024, DeepSeekMath) define GRPO; d1 (Zhao et al., 2025) carries it to masked diffusion."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, scale_by_std: bool = False, eps: float = 1e-4) -> Tensor:
    """`rewards` [P·G] of P prompts' G completions each, prompt-major → advantage r − mean of its group, divided by
    the group's standard deviation (+ `eps`) with `scale_by_std` (the original GRPO; Dr. GRPO argues for the
    unscaled form, our default)."""
    if group_size < 2:
        raise ValueError(f"grpo.group_size must be at least 2 (an advantage compares completions), got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def completion_mask(completion_ids: Tensor, eos_token_id: int) -> Tensor:
    """[B, L] 1 on every completion position up to and including the first EOS (the whole row when none)."""
    is_eos = completion_ids == eos_token_id
    before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()  # EOS seen strictly before each position
    return (before == 0).to(torch.float32)


@dataclass(frozen=True)
class PolicyTerms:
    """The loss to backpropagate and what a step logs of it."""

    loss: Tensor
    kl: float  # mean per-token k3 KL over completion tokens
    clip_fraction: float  # share of completion tokens whose ratio the clip held


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    beta: float = 0.04,
) -> PolicyTerms:
    """GRPO's loss over [B, L] per-token log-probabilities of the completions under the current policy (`logp`,
    with gradient), the policy that drew them (`old_logp`) and the reference (`ref_logp`, None when `beta` is 0):

        ρ = exp(logp − old),  ℓ_t = −min(ρ·A, clip(ρ, 1 − ε, 1 + ε)·A) + β·(exp(ref − logp) − (ref − logp) − 1)

    averaged over each completion's tokens (`mask`), then over completions (the "grpo" reduction of TRL and d1)."""
    adv = advantages.to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros_like(logp)
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("grpo.beta is not 0, so the reference policy's log-probabilities are needed")
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    mask = mask.to(logp.dtype)
    tokens = mask.sum(dim=1).clamp_min(1.0)
    loss = ((per_token * mask).sum(dim=1) / tokens).mean()
    held = ((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + clip_eps) & (adv > 0))
    total = mask.sum().clamp_min(1.0)
    kl, held = kl.detach(), held.to(mask.dtype)
    return PolicyTerms(loss, float((kl * mask).sum() / total), float((held * mask).sum() / total))


def sandwich_loss(elbo: Tensor, eubo: Tensor, advantages: Tensor, mask: Tensor, mix: float = 0.5) -> PolicyTerms:
    """SPG's policy gradient over one group (Wang et al., 2025): each completion's log-likelihood is replaced by its
    ELBO when its advantage is positive and by `mix`·EUBO + (1 − `mix`)·ELBO otherwise (1: the upper bound alone,
    SPG w/ EUBO; 0.5: SPG w/ mixture), so raising a good completion pushes a lower bound up and lowering a bad one
    pushes an upper bound down:

        loss = −Σ_i A_i · ℓ_i · |c_i| / Σ_i |c_i|      (|c_i|: completion tokens through the first EOS)

    No ratio, clip or KL: SPG has none (the stage refuses grpo.beta ≠ 0 with this estimator)."""
    adv = advantages.to(elbo.dtype)
    bound = torch.where(adv > 0, elbo, mix * eubo + (1 - mix) * elbo)
    lengths = mask.to(elbo.dtype).sum(dim=1)
    loss = -(adv * bound * lengths).sum() / lengths.sum().clamp_min(1.0)
    return PolicyTerms(loss, 0.0, 0.0)
