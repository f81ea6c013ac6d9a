"""SCDD's ancestral posterior sampler (docs/strategies.md §11.5): absorbing and uniform channels, one
multinomial draw per position per step, then a noise-removal pass. The shared machinery (config, result,
windows) is in `strategies.sampling`, the confident-first reveal in `strategies.absorbing`.

Times 1 = t_0 > … > t_steps = eps. At (t, s): C = clean_t/clean_s, Υ = γ_t/γ_s − C, Ā = 1 − γ_t/γ_s, and
with p = p_θ(· | canvas) ([MASK] excluded) the exact posterior of one position is
  visible c:  w(v) = (clean_s·Υ/K)·p(v) + uniform_s·Υ/K², plus clean_s·C·p(c) + C·uniform_s/K at v = c,
              w([M]) = 0, over uniform_t/K + clean_t·p(c);
  masked:     w(v) = (Ā/absorbed_t)·(uniform_s/K + clean_s·p(v)),  w([M]) = absorbed_s/absorbed_t.
`tempering="draws"` (default) draws each position in two parts: whether it moves (a [MASK] is revealed,
a visible token is revised) with the probability the exact posterior gives under the model's own p, then
where to, from q = p at the sampler's temperature, top-k and top-p over the tokens it may move to (never
[MASK], never the token already there; at temperature 0 the argmax). At temperature 1 with no top-k/top-p
the destination is the posterior's, ∝ clean_s·p(v) + uniform_s/K, and the step is the exact posterior; any
tempering or truncation also leaves out the uniform channel's random tokens (uniform_s/K): they are not
tokens the settings accept, and placing them only to revise them later costs quality (docs/strategies.md
§11.5). `tempering="weights"` puts the tempered p into the weights themselves, as the reference does: at
temperature 0 p is one-hot, p(c) = 0 for every visible c that is not the argmax, and the posterior then
revises such tokens to the argmax (the canvas collapses onto it); top-k and top-p are not applied there.

Then one noise-removal forward at t = eps: `"posterior"` (default) takes at every window position the most
probable clean token given the canvas, argmax_v p(v)·q(z = c | x = v) — the argmax of p at a [MASK], and at
a visible c the weight clean_t + uniform_t/K for v = c against uniform_t/K for any other v, so a
visible token is replaced only where the model all but rules it out. `"argmax"` (the reference) takes the
argmax of p everywhere, which discards the visible tokens: p at a visible position is the model's guess
from the other positions alone (the token's own evidence enters only through q(z_t | x)), so the pass
overwrites the canvas with context guesses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from strategies.absorbing import Denoising, select_confident
from strategies.base_evaluation import SampleRequest
from strategies.sampling import (
    Denoiser,
    SampleResult,
    prompt_canvas,
    row_windows,
    truncate,
)

NOISE_REMOVAL = ("posterior", "argmax")
TEMPERING = ("draws", "weights")


@dataclass(frozen=True)
class SCDDProcess:
    """What the SCDD sampler needs of the trained process besides the request (docs/strategies.md §11.5):
    the vocabulary (K = vocab_size − 1 real tokens), the schedule (`schedule(t)` → clean, uniform and absorbed
    masses and γ, as `scdd_schedule`), the last time `eps`, whether the denoiser takes each row's time
    (`time_input`: `denoise(x, attn, t [B])`, a time-conditioned backbone), the noise-removal pass and the
    tempering (below)."""

    vocab_size: int
    schedule: Callable[[Tensor], object]
    eps: float = 1e-3
    time_input: bool = False
    noise_removal: str = "posterior"
    tempering: str = "draws"

    def __post_init__(self) -> None:
        if self.noise_removal not in NOISE_REMOVAL:
            raise ValueError(f"noise_removal={self.noise_removal!r}: use one of {NOISE_REMOVAL}")
        if self.tempering not in TEMPERING:
            raise ValueError(f"tempering={self.tempering!r}: use one of {TEMPERING}")


@torch.no_grad()
def scdd_ancestral_sample(denoise: Denoiser, request: SampleRequest, process: SCDDProcess) -> SampleResult:
    """SCDD ancestral posterior sampler over the generation window of each row (`request`: the prompts, ids,
    settings, generator, device and streaming callback; `process`: the trained process, `SCDDProcess`). The
    maths of each step, the two temperings and the two noise-removal passes are in the module's docstring and
    docs/strategies.md §11.5. NFE = steps + 1; prompt positions never move. `revised` of the result: generated
    tokens per sequence changed after first being placed (positions, each counted once however often it changed).
    """
    config, mask_token_id, generator = request.config, request.mask_token_id, request.generator
    if config.remasking not in ("low_confidence", "random"):
        raise NotImplementedError(f"unknown remasking {config.remasking!r}; use 'low_confidence' or 'random'")
    k = process.vocab_size - 1
    x, attn, starts, width = prompt_canvas(
        request.prompts, config.max_new_tokens, mask_token_id, request.pad_token_id, config.eos_token_id, request.device
    )
    window = row_windows(x, starts, 0, config.max_new_tokens)
    job = Denoising(denoise, mask_token_id, config, generator)
    times = torch.linspace(1.0, process.eps, config.steps + 1, dtype=torch.float64)
    revised = torch.zeros_like(window)

    def logits_at(t: Tensor) -> Tensor:
        if not process.time_input:
            return _masked_logits(job.denoise(x, attn), mask_token_id)
        rows = torch.full((x.shape[0],), float(t), dtype=torch.float32, device=x.device)
        return _masked_logits(job.denoise(x, attn, rows), mask_token_id)

    schedule = process.schedule
    for i in range(config.steps):
        step = _AncestralStep.between(schedule(times[i : i + 1]), schedule(times[i + 1 : i + 2]))
        logits = logits_at(times[i])
        if process.tempering == "draws":
            new = _tempered_draw(logits, x, step, k, job, window)
        else:
            p = _tempered_log_probs(logits, config.temperature).double().exp()
            new = _draw_positions(_ancestral_weights(p, x, step, k, mask_token_id), x, generator)
        x, revised = _commit(x, new, window, revised, mask_token_id)
    final = _noise_removal(logits_at(times[-1]), x, schedule(times[-1:]), k, mask_token_id, process.noise_removal)
    x, revised = _commit(x, final, window, revised, mask_token_id)
    if request.on_block is not None:
        request.on_block(x)
    per_row = revised.sum(dim=1).double().mean().item() if len(request.prompts) else 0.0
    return SampleResult(x, starts, width, config.steps + 1, revised=per_row)


def _commit(x: Tensor, new: Tensor, window: Tensor, revised: Tensor, mask_token_id: int) -> tuple[Tensor, Tensor]:
    """The canvas with `new` inside the window, and the positions revised so far: a visible token replaced
    by another ([MASK] is never re-entered, so any change at a visible position is a revision)."""
    changed = window & (new != x)
    return torch.where(window, new, x), revised | (changed & (x != mask_token_id))


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


def _masked_logits(logits: Tensor, mask_token_id: int) -> Tensor:
    """float32 logits with the [MASK] column at −∞ (p_θ lives on the K non-mask tokens)."""
    logits = logits.float().clone()
    logits[..., mask_token_id] = -math.inf
    return logits


def _tempered_log_probs(logits: Tensor, temperature: float) -> Tensor:
    """log p at a temperature: a one-hot of the argmax at temperature 0 (the reference's tempering)."""
    if temperature == 0:
        hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).bool()
        return torch.where(hot, 0.0, -math.inf)
    return torch.log_softmax(logits / temperature, dim=-1)


def _tempered_draw(
    logits: Tensor, x: Tensor, step: _AncestralStep, k: int, job: Denoising, window: Tensor | None = None
) -> Tensor:
    """One ancestral step with `tempering="draws"` (see `scdd_ancestral_sample`): whether each position moves,
    from the exact posterior under the model's own p; where to, from the tempered, truncated p.
    `remasking="low_confidence"`: which [MASK]s inside `window` are revealed is the most confident proposals',
    as many as the posterior reveals in expectation (stochastically rounded); destinations come from q alone."""
    config, mask_id, generator = job.config, job.mask_token_id, job.generator
    exact = config.remasking == "random"
    p = torch.softmax(logits.double(), dim=-1)
    is_mask = x == mask_id
    p_cur = p.gather(-1, x[..., None])[..., 0]  # 0 at a [MASK]
    revise = (step.ups / k) * (step.clean_s * (1 - p_cur) + step.unif_s * (k - 1) / k)
    revise = revise / (step.unif_t / k + step.clean_t * p_cur).clamp_min(1e-300)
    reveal = 1 - step.abs_s / max(step.abs_t, 1e-300)
    moves = torch.where(is_mask, torch.full_like(revise, reveal), revise).clamp(0, 1)
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float64)
    # where to: never [MASK], never the token already there
    allowed = logits.scatter(-1, x[..., None], -math.inf)  # at a [MASK] this is the [MASK] column, already −∞
    if config.temperature == 0:
        dest = allowed.argmax(-1)
    else:
        if exact and config.temperature == 1 and config.top_k <= 0 and config.top_p >= 1:  # the exact posterior:
            # clean_s·p(v) + uniform_s/K with p over the whole vocabulary, not renormalized without the token here
            weights = step.clean_s * p.scatter(-1, x[..., None], 0.0) + (step.unif_s / k) * torch.isfinite(allowed)
        else:
            weights = torch.softmax(truncate(allowed, config.top_k, config.top_p).double() / config.temperature, -1)
        dest = torch.multinomial(weights.reshape(-1, weights.shape[-1]), 1, generator=generator).view_as(x)
    if exact:
        return torch.where(u < moves, dest, x)
    candidates = is_mask if window is None else is_mask & window
    expected = candidates.sum(dim=1).double() * reveal
    counts = torch.floor(
        expected + torch.rand(expected.shape, generator=generator, device=x.device, dtype=torch.float64)
    )
    chosen = select_confident(p.gather(-1, dest[..., None])[..., 0], candidates, counts.long(), None)
    return torch.where(chosen | (~is_mask & (u < moves)), dest, x)


def _noise_removal(logits: Tensor, x: Tensor, at_t, k: int, mask_token_id: int, rule: str) -> Tensor:
    """The final pass's token at every position (see `scdd_ancestral_sample`)."""
    if rule == "argmax":
        return logits.argmax(-1)
    log_p = torch.log_softmax(logits.double(), dim=-1)
    clean, unif = float(at_t.clean_mass), float(at_t.uniform_mass)
    other = math.log(max(unif / k, 1e-300))  # q(z = c | x = v) for v ≠ c
    own = math.log(max(clean + unif / k, 1e-300))  # q(z = c | x = c)
    visible = (x != mask_token_id)[..., None].double()  # a [MASK] carries no evidence: plain argmax of p
    score = (log_p + other * visible).scatter_add(-1, x[..., None], (own - other) * visible)
    return score.argmax(-1)


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
