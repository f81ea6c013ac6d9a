"""Posteriors and reverse steps of the uniform-replacement kernel q(z_t | x) = α_t·[z = x] + (1 − α_t)/V
(docs/strategies.md §4.4): its likelihood of a noisy token, the clean-token distribution with a token's own
evidence removed, and the exact reverse step. Used by block diffusion's canvas sampler and bound; any
uniform-noise strategy needs the same.

What the denoiser predicts. Trained by a cross-entropy on every noisy token (block diffusion's canvas loss,
docs/strategies.md §5.4), a model learns the posterior π(x_i) = p(x_i | z_t), which has already read the
token z_t^i it is asked about. The uniform-noise reverse step and the uniform-noise bound are written in terms of a
clean-token distribution x̂ that has *not* seen z_t^i: by Bayes, π(x) ∝ x̂(x)·q(z_t^i | x), so

    x̂(x) ∝ π(x) / q(z_t^i | x),      q(z | x) = α_t·[x = z] + (1 − α_t)/V

(`own_token_removed`). With it, the exact reverse kernel Σ_x π(x)·q(z_s | z_t, x) is
`uniform_posterior(x̂, …)`, and x̂ is what the bound's score ratios need (docs/evaluation.md §4.2).
Plugging π in directly counts the evidence of z_t^i twice: the sampler keeps noise tokens and the
bound comes out above ln V even for good predictions.
"""

from __future__ import annotations

import torch
from torch import Tensor


def uniform_posterior(probs: Tensor, z_t: Tensor, alpha_t: float, alpha_s: float) -> Tensor:
    """Reverse step of uniform-noise diffusion with the denoiser's x̂ plugged in (docs/strategies.md §4.4 kernel):

    p(z_s = j | z_t = i) ∝ (α_{t|s}·[i = j] + (1 − α_{t|s})/V) · (α_s·π_j + (1 − α_s)/V),  α_{t|s} = α_t/α_s
    """
    vocab = probs.shape[-1]
    a_ts = alpha_t / alpha_s
    like = torch.full_like(probs, (1 - a_ts) / vocab)
    like.scatter_add_(-1, z_t[..., None], torch.full_like(z_t[..., None], a_ts, dtype=probs.dtype))
    post = like * (alpha_s * probs + (1 - alpha_s) / vocab)
    return post / post.sum(dim=-1, keepdim=True)


def own_token_log_likelihood(z_t: Tensor, alpha_t: Tensor | float, vocab: int) -> Tensor:
    """log q(z_t^i | x) for every candidate x, float64 `[..., V]`: log(α_t + (1 − α_t)/V) at x = z_t^i and
    log((1 − α_t)/V) elsewhere (the uniform kernel of docs/strategies.md §4.4). `alpha_t` is a float or a
    tensor broadcastable to `z_t` (one level per row: `[B, 1]`); it must be < 1."""
    alpha = torch.as_tensor(alpha_t, dtype=torch.float64, device=z_t.device)
    alpha = alpha.expand(z_t.shape)[..., None]
    out = torch.log((1 - alpha) / vocab).expand(*z_t.shape, vocab).clone()
    own = torch.log(alpha + (1 - alpha) / vocab).expand_as(out)
    return out.scatter_(-1, z_t[..., None], own.gather(-1, z_t[..., None]))


def own_token_removed(log_probs: Tensor, z_t: Tensor, alpha_t: Tensor | float, vocab: int) -> Tensor:
    """Unnormalised log x̂ from the denoiser's posterior log π (module docstring): log π − log q(z_t^i | x),
    in float64. Softmax-invariant, so raw logits can stand for log π."""
    return log_probs.double() - own_token_log_likelihood(z_t, alpha_t, vocab)


def reverse_step(probs: Tensor, z_t: Tensor, alpha_t: float, alpha_s: float) -> Tensor:
    """p(z_s | z_t) = Σ_x π(x)·q(z_s | z_t, x) for a posterior π over the clean token (float64 `[..., V]`):
    `uniform_posterior` of π with the evidence of z_t removed (exact, module docstring). A one-hot π
    (temperature 0) is unchanged by the removal."""
    vocab = probs.shape[-1]
    if alpha_t > 0:
        q_own = torch.full_like(probs, (1 - alpha_t) / vocab)
        q_own.scatter_add_(-1, z_t[..., None], torch.full_like(z_t[..., None], alpha_t, dtype=probs.dtype))
        probs = probs / q_own
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return uniform_posterior(probs, z_t, max(alpha_t, 1e-12), alpha_s)
