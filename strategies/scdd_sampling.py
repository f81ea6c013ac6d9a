"""SCDD's ancestral posterior sampler (docs/strategies.md §11.5): absorbing and uniform channels, one
multinomial draw per position per step, then a noise-removal pass. The shared machinery (config, result,
windows) is in `strategies.sampling`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from strategies.sampling import (
    Denoiser,
    Denoising,
    Progress,
    SamplerConfig,
    SampleResult,
    prompt_canvas,
    row_windows,
)


@torch.no_grad()
def scdd_ancestral_sample(
    denoise: Denoiser,
    prompts: list[list[int]],
    *,
    mask_token_id: int,
    pad_token_id: int,
    vocab_size: int,
    schedule: Callable[[Tensor], object],
    config: SamplerConfig,
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    on_block: Progress | None = None,
) -> SampleResult:
    """SCDD ancestral posterior sampler (docs/strategies.md §11.5) over the generation window of each row.

    Times 1 = t_0 > … > t_steps = eps. At (t, s): C = clean_t/clean_s, Υ = γ_t/γ_s − C, Ā = 1 − γ_t/γ_s.
    Visible c: w(v) = (clean_s·Υ/K)·p(v) + uniform_s·Υ/K², plus clean_s·C·p(c) + C·uniform_s/K at v = c,
    w([M]) = 0, over uniform_t/K + clean_t·p(c). Masked: ρ = Ā/absorbed_t, w(v) = ρ·(uniform_s/K + clean_s·p(v)),
    w([M]) = absorbed_s/absorbed_t. One multinomial draw per position; prompt positions never move.
    Then one noise-removal forward: argmax (mask excluded) at every window position. NFE = steps + 1.
    `schedule(t)` → an object with clean_mass, uniform_mass, absorbed_mass, gamma (as `scdd_schedule`).
    """
    k = vocab_size - 1
    x, attn, starts, width = prompt_canvas(
        prompts, config.max_new_tokens, mask_token_id, pad_token_id, config.eos_token_id, device
    )
    window = row_windows(x, starts, 0, config.max_new_tokens)
    job = Denoising(denoise, mask_token_id, config, generator)
    times = torch.linspace(1.0, eps, config.steps + 1, dtype=torch.float64)
    for i in range(config.steps):
        step = _AncestralStep.between(schedule(times[i : i + 1]), schedule(times[i + 1 : i + 2]))
        p = _scdd_log_probs(job, x, attn).double().exp()  # [B,T,V]; zero on [MASK]
        weights = _ancestral_weights(p, x, step, k, mask_token_id)
        x = torch.where(window, _draw_positions(weights, x, generator), x)
    final = _scdd_log_probs(job, x, attn).argmax(-1)  # noise removal: clears leftover masks, corrects visible tokens
    x = torch.where(window, final, x)
    if on_block is not None:
        on_block(x)
    return SampleResult(x, starts, width, config.steps + 1)


@dataclass(frozen=True)
class _AncestralStep:
    """The scalar coefficients of one ancestral step t → s (see `scdd_ancestral_sample`)."""

    clean_t: float
    clean_s: float
    unif_t: float
    unif_s: float
    abs_t: float
    abs_s: float
    c: float  # C = clean_t / clean_s
    ups: float  # Υ = γ_t/γ_s − C
    a_bar: float  # Ā = 1 − γ_t/γ_s

    @classmethod
    def between(cls, at_t, at_s) -> _AncestralStep:
        clean_t, clean_s = float(at_t.clean_mass), float(at_s.clean_mass)
        unif_t, unif_s = float(at_t.uniform_mass), float(at_s.uniform_mass)
        abs_t, abs_s = float(at_t.absorbed_mass), float(at_s.absorbed_mass)
        c = clean_t / clean_s
        ups = float(at_t.gamma) / float(at_s.gamma) - c
        a_bar = 1 - float(at_t.gamma) / float(at_s.gamma)
        return cls(clean_t, clean_s, unif_t, unif_s, abs_t, abs_s, c, ups, a_bar)


def _scdd_log_probs(job: Denoising, canvas: Tensor, attn: Tensor) -> Tensor:
    """log p_θ(v) [B,T,V] with [MASK] excluded: a one-hot of the argmax at temperature 0."""
    logits = job.denoise(canvas, attn).float().clone()
    logits[..., job.mask_token_id] = -math.inf
    if job.config.temperature == 0:
        hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).bool()
        return torch.where(hot, 0.0, -math.inf)
    return torch.log_softmax(logits / job.config.temperature, dim=-1)


def _ancestral_weights(p: Tensor, x: Tensor, step: _AncestralStep, k: int, mask_token_id: int) -> Tensor:
    """Unnormalized posterior weights [B,T,V] of every position: the visible rule where x is a token,
    the masked rule where it is [MASK]; clamped at 0."""
    cur = x[..., None]
    p_cur = p.gather(-1, cur)
    visible = (step.clean_s * step.ups / k) * p + step.unif_s * step.ups / k**2
    visible.scatter_add_(-1, cur, step.clean_s * step.c * p_cur + step.c * step.unif_s / k)
    visible[..., mask_token_id] = 0
    visible = visible / (step.unif_t / k + step.clean_t * p_cur).clamp_min(1e-300)
    rho = step.a_bar / max(step.abs_t, 1e-300)
    masked = rho * (step.unif_s / k + step.clean_s * p)
    masked[..., mask_token_id] = step.abs_s / max(step.abs_t, 1e-300)
    is_mask = (x == mask_token_id)[..., None]
    return torch.where(is_mask, masked, visible).clamp_min(0)


def _draw_positions(weights: Tensor, x: Tensor, generator: torch.Generator | None) -> Tensor:
    """One multinomial draw per position with any weight (one batched call); the others keep their token."""
    flat = weights.reshape(-1, weights.shape[-1])
    alive = flat.sum(-1) > 0
    draw = x.reshape(-1).clone()
    if alive.any():
        draw[alive] = torch.multinomial(flat[alive], 1, generator=generator).squeeze(-1)
    return draw.view_as(x)
