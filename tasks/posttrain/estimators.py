"""Per-token log-likelihood estimators of a completion under a masked-diffusion policy (docs/post-training.md,
"Likelihood estimators"): a dLLM has no exact left-to-right likelihood, so GRPO's ratio is built from an estimate.
Each takes the strategy's denoiser (`(x [B, T], attention_mask [B, T]) → logits [B, T, V]`, the one its samplers
use), the prompts and completions, the [MASK] id and a generator — the corruption seed one inner update shares
between the old, reference and current policy — and returns log-probabilities [B, Lc] of the completion tokens.

- `one_step` (d1, Zhao et al., 2025): the completion fully masked, each prompt token masked with probability
  `p_mask_prompt`; one forward.
- `coupled` (DiffuCoder, Gong et al., 2025): t ~ U(0.2, 0.8); two complementary views mask the completion tokens
  with u < t and u > t (u uniform per token), a third masks all of them; a token's estimate is
  (p_full + p_own / w) / 2, where p_own comes from the view that masked it and w is that view's mask rate (t or
  1 − t). Three forwards, every token scored twice.
- `exact_ar` (JustGRPO's idea, for a strategy with an exact causal path: hybrid's causal branch, I-DLM's clean
  half): the completion's left-to-right log-likelihood, one causal forward of the clean row (`causal` gives logits
  whose row i − 1 predicts token i). Exact, so no corruption is drawn.
- `elbo_eubo` (SPG, Wang et al., 2025) is not per-token: it returns two bounds of each completion's log-likelihood
  from `draws` block-wise masked views, the ELBO (for completions with a positive advantage) and the Rényi-style
  upper bound EUBO (for the others); `tasks.posttrain.grpo_loss.sandwich_loss` combines them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

COUPLED_RANGE = (0.2, 0.8)  # DiffuCoder's range of the coupled views' mask rate


def _completion_logps(denoise, noisy: Tensor, completion: Tensor) -> Tensor:
    """log p(completion token) at each completion position, from the denoiser's logits on `noisy`."""
    logits = denoise(noisy, torch.ones_like(noisy))
    tail = logits[:, -completion.shape[1] :].float()
    return F.log_softmax(tail, dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)


def one_step(
    denoise, prompt: Tensor, completion: Tensor, mask_id: int, generator: torch.Generator, p_mask_prompt: float = 0.15
) -> Tensor:
    """d1's estimator: one forward of the prompt (each token masked with probability `p_mask_prompt`) followed by
    the fully masked completion."""
    drawn = torch.rand(prompt.shape, generator=generator, device=prompt.device)
    noisy_prompt = torch.where(drawn < p_mask_prompt, torch.full_like(prompt, mask_id), prompt)
    noisy = torch.cat([noisy_prompt, torch.full_like(completion, mask_id)], dim=1)
    return _completion_logps(denoise, noisy, completion)


def coupled(denoise, prompt: Tensor, completion: Tensor, mask_id: int, generator: torch.Generator) -> Tensor:
    """DiffuCoder's coupled estimator (complementary masks at t and 1 − t, plus the fully masked view)."""
    low, high = COUPLED_RANGE
    t = low + (high - low) * float(torch.rand((), generator=generator))
    u = torch.rand(completion.shape, generator=generator, device=completion.device)
    first, second = u < t, u > t
    masked = torch.full_like(completion, mask_id)
    views = [torch.ones_like(first), first, second]
    noisy = torch.cat([torch.cat([prompt, torch.where(m, masked, completion)], dim=1) for m in views])
    full, p_first, p_second = _completion_logps(denoise, noisy, completion.repeat(3, 1)).chunk(3)
    own = torch.where(first, p_first / t, p_second / (1 - t))
    return (full + own) / 2


def exact_ar(causal, prompt: Tensor, completion: Tensor, mask_id: int | None, generator: torch.Generator) -> Tensor:
    """log p(completion token | everything left of it) from one causal forward of prompt + completion."""
    ids = torch.cat([prompt, completion], dim=1)
    logits = causal(ids, torch.ones_like(ids))
    start = prompt.shape[1]
    rows = logits[:, start - 1 : ids.shape[1] - 1].float()  # row i − 1 predicts token i
    return F.log_softmax(rows, dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)


ESTIMATORS = {"one_step": one_step, "coupled": coupled, "exact_ar": exact_ar}


def sandwich_masks(cmask: Tensor, block: int, draws: int, generator: torch.Generator) -> Tensor:
    """SPG's block-wise masking: [draws, B, L] True where a view masks a completion position.

    The completion is cut into blocks of `block` positions (the rollouts' semi-autoregressive blocks). For each row a
    permutation of the blocks, taken modulo the number of blocks holding completion tokens (`cmask`), picks each
    draw's block b: blocks before b stay clean, blocks after b are masked whole, and in b a count m uniform in
    1 … (completion tokens in b) of them is masked at random positions — the state a semi-autoregressive sampler is
    in while it decodes block b. Positions past the first EOS (`cmask` 0) are masked in every view, as the sampler
    never conditions on them."""
    batch, length = cmask.shape
    blocks = -(-length // block)
    masked = torch.zeros(draws, batch, length, dtype=torch.bool, device=cmask.device)
    for i in range(batch):
        tokens = int(cmask[i].sum())
        order = torch.randperm(blocks, generator=generator) % max(-(-tokens // block), 1)
        for j in range(draws):
            b = int(order[j % blocks])
            start, inside = b * block, min(block, tokens - b * block)
            masked[j, i, start + block :] = True
            count = int(torch.randint(1, inside + 1, (), generator=generator))
            chosen = torch.randperm(inside, generator=generator)[:count]
            masked[j, i, start + chosen.to(cmask.device)] = True
    return masked | (cmask == 0).unsqueeze(0)


def sandwich_bounds(logp: Tensor, masked: Tensor, cmask: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """SPG's two bounds of each completion's log-likelihood from `n` views' per-token log-probabilities `logp`
    [n, B, L] and which positions each view masked (`masked` [n, B, L]), over the completion tokens (`cmask` [B, L]):

        ELBO = mean over views of (mean of log p over the view's masked completion tokens)
        EUBO = (1/β) · mean over positions k some view masked of log( (1/n) Σ_j 1[k masked in j] · p_jk^β / t_j )

    with t_j the share of the completion view j masks. The inner mean is a log-sum-exp here (the reference sums
    probabilities, which underflow to 0 for unlikely tokens; the value is the same)."""
    scored = masked & (cmask > 0).unsqueeze(0)
    weight = scored.to(logp.dtype)
    counts = weight.sum(-1)  # [n, B]: ≥ 1, every view masks a token of its block
    elbo = ((logp * weight).sum(-1) / counts.clamp_min(1)).mean(0)
    rate = counts / cmask.sum(-1).clamp_min(1).unsqueeze(0)  # t_j [n, B]
    terms = beta * logp - torch.log(rate.clamp_min(1e-8)).unsqueeze(-1)
    terms = terms.masked_fill(~scored, float("-inf"))
    seen = scored.any(0)  # [B, L]
    per_token = torch.logsumexp(terms, dim=0) - math.log(logp.shape[0])
    per_token = torch.where(seen, per_token, torch.zeros_like(per_token))
    eubo = per_token.sum(-1) / seen.sum(-1).clamp_min(1) / beta
    return elbo, eubo


def elbo_eubo(
    denoise,
    prompt: Tensor,
    completion: Tensor,
    mask_id: int,
    generator: torch.Generator,
    cmask: Tensor,
    block: int,
    draws: int = 2,
    beta: float = 1.5,
) -> tuple[Tensor, Tensor]:
    """SPG's estimate: `draws` block-wise masked views of each completion in one batch → (ELBO [B], EUBO [B])."""
    masked = sandwich_masks(cmask, block, draws, generator)
    noisy = torch.cat([torch.cat([prompt, torch.where(m, mask_id, completion)], dim=1) for m in masked])
    logp = _completion_logps(denoise, noisy, completion.repeat(draws, 1)).view(draws, *completion.shape)
    return sandwich_bounds(logp, masked, cmask, beta)
