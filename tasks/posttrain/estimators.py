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
  whose row i − 1 predicts token i). Exact, so no corruption is drawn."""

from __future__ import annotations

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
