"""The absorbing-state sampler for masked dLLMs (docs/strategies.md §11.2): semi-autoregressive blocks, per-block
transfer schedule, low-confidence or random remasking, optional confidence threshold, EOS stop; and the same
window loop filling [MASK] spans anywhere in a prompt (`infill_sample`).

Every strategy whose denoiser reads [MASK]s may offer it (`strategies.registration.ABSORBING`); the hybrid's
sampler completes its causally seeded blocks with `denoise_window`, SCDD's reveals with `select_confident`.
`denoise(x [B,T], attention_mask [B,T]) -> logits [B,T,V]` is any callable, so the sampler is
pure of Prefect and MLflow. Randomness only from the passed generator. When the denoiser is a
`strategies.decoding_cache.ModelDenoiser`, `SamplerConfig.cache` reuses K/V across steps (docs/decoding.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from strategies.decoding_cache import open_decoder
from strategies.sampling import (
    Denoiser,
    Progress,
    SamplerConfig,
    SampleResult,
    all_rows_ended,
    prompt_canvas,
    row_windows,
    truncate,
)


def num_transfer_tokens(mask_count: Tensor, steps: int) -> Tensor:
    """Per-row schedule [B, steps]: m // s each step plus one for the first m mod s steps."""
    base = mask_count // steps
    rem = mask_count % steps
    sched = base[:, None].repeat(1, steps)
    sched += (torch.arange(steps, device=mask_count.device)[None, :] < rem[:, None]).long()
    return sched


def _uniform(shape, generator: torch.Generator | None, device, cols: tuple[int, int] | None, **kw) -> Tensor:
    """U(0,1) draws of `shape` [B, q, ...] for canvas columns [lo, lo + q) of a `width`-wide canvas, `cols` =
    (lo, width): drawn for the whole canvas and sliced, so a cached decoder consumes the generator exactly
    as the uncached one does (same seed, same draws)."""
    if cols is None:
        return torch.rand(shape, generator=generator, device=device, **kw)
    lo, width = cols
    return torch.rand((shape[0], width, *shape[2:]), generator=generator, device=device, **kw)[:, lo : lo + shape[1]]


def draw_proposals(
    logits: Tensor, temperature: float, generator: torch.Generator | None, cols: tuple[int, int] | None = None
) -> Tensor:
    """Gumbel-max sampling: argmax at temperature 0, else argmax(exp(l) / (−log U)^T) in float64."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    u = _uniform(logits.shape, generator, logits.device, cols, dtype=torch.float64).clamp_min(1e-20)
    noisy = logits.double().exp() / (-torch.log(u)) ** temperature
    return noisy.argmax(dim=-1)


def _confidence(
    logits: Tensor, proposals: Tensor, remasking: str, generator: torch.Generator | None, cols=None
) -> Tensor:
    if remasking == "low_confidence":
        probs = torch.softmax(logits.float(), dim=-1)
        return probs.gather(-1, proposals[..., None]).squeeze(-1)
    if remasking == "random":
        return _uniform(proposals.shape, generator, proposals.device, cols)
    raise NotImplementedError(f"unknown remasking {remasking!r}; use 'low_confidence' or 'random'")


def _shift(logits: Tensor, shift: int) -> Tensor:
    """Row p of the used logits is the model's row p − shift (I-DLM decodes with shift 1)."""
    if shift == 0:
        return logits
    out = torch.zeros_like(logits)
    out[:, shift:] = logits[:, :-shift]
    return out


def select_confident(confidence: Tensor, candidates: Tensor, counts: Tensor, threshold: float | None) -> Tensor:
    """Which candidates to reveal this step: top-`counts` by confidence, or top-1 + all ≥ threshold."""
    conf = torch.where(candidates, confidence, torch.full_like(confidence, -math.inf))
    chosen = torch.zeros_like(candidates)
    for row in range(conf.shape[0]):
        n_cand = int(candidates[row].sum())
        if n_cand == 0:
            continue
        order = torch.argsort(conf[row], descending=True, stable=True)  # ties: leftmost first, cached or not
        if threshold is None:
            k = min(int(counts[row]), n_cand)
        else:
            k = max(1, int((conf[row] >= threshold).sum()))
        chosen[row, order[:k]] = True
    return chosen & candidates


@dataclass(frozen=True)
class Denoising:
    """What the absorbing samplers share across windows: the denoiser, the [MASK] id, the sampler
    settings and the generator every draw comes from."""

    denoise: Denoiser
    mask_token_id: int
    config: SamplerConfig
    generator: torch.Generator | None
    decoder: object | None = None  # a cached decoder over `denoise` (strategies.decoding_cache.open_decoder)


def denoise_window(
    job: Denoising,
    x: Tensor,
    attn: Tensor,
    window: Tensor,
    steps: int,
    stop: Callable[[Tensor], bool] | None = None,
) -> tuple[Tensor, int]:
    """Reveal every [MASK] inside `window` [B,T] in at most `steps` forwards (docs/strategies.md §11.2 step 4).

    Candidates are restricted to the window *before* top-k; the per-row transfer schedule spreads the
    window's mask count over the steps. With `threshold`, each forward reveals the top-1 plus every
    candidate at or above it and the loop runs until the window is full (`steps` is then unused).
    `stop(x)` ends the block early (EOS). Returns the canvas and the number of forwards.
    """
    mask_token_id, config, generator = job.mask_token_id, job.config, job.generator
    counts = ((x == mask_token_id) & window).sum(dim=1)
    if config.threshold is not None:  # adaptive (Fast-dLLM): as many forwards as the window needs, ≥ 1 token each
        steps = max(1, int(counts.max()))
    schedule = num_transfer_tokens(counts, steps)
    cached = job.decoder.window(x, window) if job.decoder is not None else None
    nfe = 0
    for s in range(steps):
        candidates = (x == mask_token_id) & window
        if not candidates.any():
            break
        # logits of columns [lo, hi) ⊇ the window: all of them uncached, the window's span with a cache
        lo, logits = cached(x) if cached is not None else (0, _shift(job.denoise(x, attn), config.logit_shift))
        hi, cols = lo + logits.shape[1], (lo, x.shape[1])
        logits = logits.clone()
        logits[..., mask_token_id] = -math.inf  # never "reveal" a position as [MASK] again
        nfe += 1
        # draws come from the truncated distribution; confidence stays the model's own probability
        proposals = draw_proposals(truncate(logits, config.top_k, config.top_p), config.temperature, generator, cols)
        conf = _confidence(logits, proposals, config.remasking, generator, cols)
        chosen = select_confident(conf, candidates[:, lo:hi], schedule[:, s], config.threshold)
        x = torch.cat([x[:, :lo], torch.where(chosen, proposals, x[:, lo:hi]), x[:, hi:]], dim=1)
        if stop is not None and stop(x):
            break
    return x, nfe


@torch.no_grad()
def absorbing_sample(
    denoise: Denoiser,
    prompts: list[list[int]],
    *,
    mask_token_id: int,
    pad_token_id: int,
    config: SamplerConfig,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    on_block: Progress | None = None,
) -> SampleResult:
    """Fill `max_new_tokens` masks after each prompt, block by block (LLaDA low-confidence remasking)."""
    gen_len, bs = config.max_new_tokens, min(config.block_size, config.max_new_tokens)
    n_blocks = math.ceil(gen_len / bs)
    steps_per_block = max(1, math.ceil(config.steps / n_blocks))
    x, attn, starts, width = prompt_canvas(prompts, gen_len, mask_token_id, pad_token_id, config.eos_token_id, device)
    eos = config.eos_token_id
    ended = (lambda c: all_rows_ended(c, starts, eos, mask_token_id)) if eos is not None else None
    job = Denoising(denoise, mask_token_id, config, generator, open_decoder(denoise, config))
    nfe = 0
    for b in range(n_blocks):
        window = row_windows(x, starts, b * bs, min((b + 1) * bs, gen_len))
        x, used = denoise_window(job, x, attn, window, steps_per_block, ended)
        nfe += used
        if on_block is not None:
            on_block(x)
        if ended is not None and ended(x):
            x = torch.where(x == mask_token_id, torch.full_like(x, eos), x)  # all after EOS
            break
    return SampleResult(x, starts, width, nfe)


@torch.no_grad()
def infill_sample(
    denoise: Denoiser,
    sequences: list[list[int]],
    *,
    mask_token_id: int,
    pad_token_id: int,
    config: SamplerConfig,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> SampleResult:
    """Fill the [MASK] tokens already in `sequences`: windows of `block_size` from position 0 over the
    whole sequence, each with its own transfer schedule and in-window candidates (docs/strategies.md §11.2 infill)."""
    width = max(len(s) for s in sequences)
    x = torch.full((len(sequences), width), pad_token_id, dtype=torch.long, device=device)
    attn = torch.zeros_like(x)
    for i, seq in enumerate(sequences):
        x[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
    n_blocks = math.ceil(width / config.block_size)
    steps_per_block = max(1, math.ceil(config.steps / n_blocks))
    job = Denoising(denoise, mask_token_id, config, generator, open_decoder(denoise, config))
    nfe = 0
    for b in range(n_blocks):
        window = row_windows(x, [0] * len(sequences), b * config.block_size, (b + 1) * config.block_size)
        x, used = denoise_window(job, x, attn, window, steps_per_block)
        nfe += used
    return SampleResult(x, [0] * len(sequences), 0, nfe)
