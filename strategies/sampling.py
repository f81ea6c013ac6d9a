"""Absorbing-state sampler for masked dLLMs (docs/strategies.md §11.2): semi-autoregressive blocks, per-block
transfer schedule, low-confidence or random remasking, optional confidence threshold, EOS stop.

`denoise(x [B,T], attention_mask [B,T]) -> logits [B,T,V]` is any callable, so the sampler is
pure of models, Prefect and MLflow. Randomness only from the passed generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from strategies.masks import build_block_diffusion_training_mask

Denoiser = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class SamplerInfo:
    """What `dllm-flow generate` needs to know of a sampler."""

    summary: str
    infills: bool = False  # fills [MASK] spans anywhere in the prompt (`infill_sample`)
    default_temperature: float = 0.0


ABSORBING = "llada"  # the absorbing [MASK] sampler over any strategy's bidirectional denoiser
SPECULATIVE = "speculative"  # a draft proposes a block, the frozen target verifies it
SAMPLERS: dict[str, SamplerInfo] = {
    ABSORBING: SamplerInfo("absorbing [MASK] sampler (mdlm; also scdd and the hybrid's diffusion branch)", True),
    "idlm": SamplerInfo("absorbing sampler with logit shift 1 (idlm)", True),
    "scdd": SamplerInfo("ancestral posterior sampler with the final noise-removal pass (scdd)", False, 1.0),
    "hybrid": SamplerInfo("blocks seeded by the causal branch, completed by diffusion (hybrid)"),
    "canvas": SamplerInfo("uniform-noise canvas decoding (block_diffusion)"),
    SPECULATIVE: SamplerInfo("DFlash: the draft proposes, the target verifies; the target's own greedy text"),
}


@dataclass(frozen=True)
class SamplerConfig:
    steps: int = 128
    max_new_tokens: int = 128
    block_size: int = 32
    temperature: float = 0.0
    remasking: str = "low_confidence"
    threshold: float | None = None
    eos_token_id: int | None = None
    logit_shift: int = 0


@dataclass(frozen=True)
class SampleResult:
    tokens: Tensor  # [B, P_max + G] canvas (prompt left-aligned per row)
    prompt_lengths: list[int]
    prompt_width: int
    nfe: float  # denoiser forwards per sequence (a batched forward counts once; per-row loops are averaged)

    def generated(self, row: int) -> Tensor:
        start = self.prompt_lengths[row]
        return self.tokens[row, start : start + self.tokens.shape[1] - self.prompt_width]


def num_transfer_tokens(mask_count: Tensor, steps: int) -> Tensor:
    """Per-row schedule [B, steps]: m // s each step plus one for the first m mod s steps."""
    base = mask_count // steps
    rem = mask_count % steps
    sched = base[:, None].repeat(1, steps)
    sched += (torch.arange(steps, device=mask_count.device)[None, :] < rem[:, None]).long()
    return sched


def _proposals(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """Gumbel-max sampling: argmax at temperature 0, else argmax(exp(l) / (−log U)^T) in float64."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64).clamp_min(1e-20)
    noisy = logits.double().exp() / (-torch.log(u)) ** temperature
    return noisy.argmax(dim=-1)


def _confidence(logits: Tensor, proposals: Tensor, remasking: str, generator: torch.Generator | None) -> Tensor:
    if remasking == "low_confidence":
        probs = torch.softmax(logits.float(), dim=-1)
        return probs.gather(-1, proposals[..., None]).squeeze(-1)
    if remasking == "random":
        return torch.rand(proposals.shape, generator=generator, device=proposals.device)
    raise NotImplementedError(f"unknown remasking {remasking!r}; use 'low_confidence' or 'random'")


def _shift(logits: Tensor, shift: int) -> Tensor:
    """Row p of the used logits is the model's row p − shift (I-DLM decodes with shift 1)."""
    if shift == 0:
        return logits
    out = torch.zeros_like(logits)
    out[:, shift:] = logits[:, :-shift]
    return out


def _select(confidence: Tensor, candidates: Tensor, counts: Tensor, threshold: float | None) -> Tensor:
    """Which candidates to reveal this step: top-`counts` by confidence, or top-1 + all ≥ threshold."""
    conf = torch.where(candidates, confidence, torch.full_like(confidence, -math.inf))
    chosen = torch.zeros_like(candidates)
    for row in range(conf.shape[0]):
        n_cand = int(candidates[row].sum())
        if n_cand == 0:
            continue
        order = torch.argsort(conf[row], descending=True)
        if threshold is None:
            k = min(int(counts[row]), n_cand)
        else:
            k = max(1, int((conf[row] >= threshold).sum()))
        chosen[row, order[:k]] = True
    return chosen & candidates


Progress = Callable[[Tensor], None]  # called with the canvas after each finished block (streaming)


@dataclass(frozen=True)
class _Denoising:
    """What the absorbing samplers share across windows: the denoiser, the [MASK] id, the sampler
    settings and the generator every draw comes from."""

    denoise: Denoiser
    mask_token_id: int
    config: SamplerConfig
    generator: torch.Generator | None


def _denoise_window(
    job: _Denoising,
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
    nfe = 0
    for s in range(steps):
        candidates = (x == mask_token_id) & window
        if not candidates.any():
            break
        logits = _shift(job.denoise(x, attn), config.logit_shift).clone()
        logits[..., mask_token_id] = -math.inf  # never "reveal" a position as [MASK] again
        nfe += 1
        proposals = _proposals(logits, config.temperature, generator)
        conf = _confidence(logits, proposals, config.remasking, generator)
        chosen = _select(conf, candidates, schedule[:, s], config.threshold)
        x = torch.where(chosen, proposals, x)
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
    x, attn, starts, width = _canvas(prompts, gen_len, mask_token_id, pad_token_id, config.eos_token_id, device)
    eos = config.eos_token_id
    ended = (lambda c: _all_rows_ended(c, starts, eos, mask_token_id)) if eos is not None else None
    job = _Denoising(denoise, mask_token_id, config, generator)
    nfe = 0
    for b in range(n_blocks):
        window = _row_windows(x, starts, b * bs, min((b + 1) * bs, gen_len))
        x, used = _denoise_window(job, x, attn, window, steps_per_block, ended)
        nfe += used
        if on_block is not None:
            on_block(x)
        if ended is not None and ended(x):
            x = torch.where(x == mask_token_id, torch.full_like(x, eos), x)  # all after EOS
            break
    return SampleResult(x, starts, width, nfe)


def _canvas(
    prompts: list[list[int]], gen_len: int, mask_token_id: int, pad_token_id: int, eos_token_id: int | None, device
) -> tuple[Tensor, Tensor, list[int], int]:
    """Canvas [B, P_max + G] filled with EOS (or pad): row i is its prompt then G masks; attention on both."""
    width = max(len(p) for p in prompts)
    fill = eos_token_id if eos_token_id is not None else pad_token_id
    x = torch.full((len(prompts), width + gen_len), fill, dtype=torch.long, device=device)
    attn = torch.zeros_like(x)
    for i, p in enumerate(prompts):
        x[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        x[i, len(p) : len(p) + gen_len] = mask_token_id
        attn[i, : len(p) + gen_len] = 1
    return x, attn, [len(p) for p in prompts], width


def _row_windows(x: Tensor, starts: list[int], lo: int, hi: int) -> Tensor:
    """Bool [B,T]: each row's own window [start + lo, start + hi)."""
    window = torch.zeros_like(x, dtype=torch.bool)
    for i, start in enumerate(starts):
        window[i, start + lo : start + hi] = True
    return window


def _per_row_result(
    prompts: list[list[int]],
    generated: list[Tensor],
    config: SamplerConfig,
    pad_token_id: int,
    device,
    forwards: int,
) -> SampleResult:
    """The canvas of samplers that decode one row at a time: each prompt then what it generated, the
    rest EOS (or pad); NFE is the forwards per sequence. The canvas is `config.max_new_tokens` wide
    after the prompts."""
    gen_len, eos_token_id = config.max_new_tokens, config.eos_token_id
    fill = eos_token_id if eos_token_id is not None else pad_token_id
    out, _, starts, width = _canvas(prompts, gen_len, fill, pad_token_id, eos_token_id, device)  # nothing masked
    for row, (start, ids) in enumerate(zip(starts, generated)):
        out[row, start : start + len(ids)] = ids
    return SampleResult(out, starts, width, forwards / len(prompts))


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
    job = _Denoising(denoise, mask_token_id, config, generator)
    nfe = 0
    for b in range(n_blocks):
        window = _row_windows(x, [0] * len(sequences), b * config.block_size, (b + 1) * config.block_size)
        x, used = _denoise_window(job, x, attn, window, steps_per_block)
        nfe += used
    return SampleResult(x, [0] * len(sequences), 0, nfe)


@torch.no_grad()
def hybrid_sample(
    model,
    prompts: list[list[int]],
    *,
    mask_token_id: int,
    pad_token_id: int,
    config: SamplerConfig,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    on_block: Progress | None = None,
) -> SampleResult:
    """Nemotron-Labs-Diffusion decoding for a `HybridLM`: semi-autoregressive blocks, each seeded by the
    causal branch (the block's first token is the causal forward's next-token prediction given the
    context) and then completed by the diffusion branch over context + block (no future masks).
    NFE counts both kinds of forward."""
    gen_len, bs = config.max_new_tokens, min(config.block_size, config.max_new_tokens)
    n_blocks = math.ceil(gen_len / bs)
    steps_per_block = max(1, math.ceil(config.steps / n_blocks))
    eos = config.eos_token_id
    denoise = lambda x, attn: model(input_ids=x).logits  # noqa: E731  (diffusion branch, ids carry [MASK])
    job = _Denoising(denoise, mask_token_id, config, generator)
    nfe, rows = 0, []
    for prompt in prompts:
        context = torch.tensor(prompt, dtype=torch.long, device=device)[None]
        for b in range(n_blocks):
            size = min(bs, gen_len - b * bs)
            seed_logits = model.causal_logits(context)[:, -1:].clone()
            seed_logits[..., mask_token_id] = -math.inf
            seed = _proposals(seed_logits, config.temperature, generator)  # [1,1]
            nfe += 1
            x = torch.cat([context, seed, torch.full((1, size - 1), mask_token_id, dtype=torch.long, device=device)], 1)
            window = torch.zeros_like(x, dtype=torch.bool)
            window[:, context.shape[1] :] = True
            x, used = _denoise_window(job, x, torch.ones_like(x), window, steps_per_block)
            nfe += used
            context = x
            if on_block is not None:
                on_block(context)
            if eos is not None and bool((x[0, len(prompt) :] == eos).any()):
                break
        rows.append(context[0, len(prompt) :])
    return _per_row_result(prompts, rows, config, pad_token_id, device, nfe)


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
    x, attn, starts, width = _canvas(
        prompts, config.max_new_tokens, mask_token_id, pad_token_id, config.eos_token_id, device
    )
    window = _row_windows(x, starts, 0, config.max_new_tokens)
    job = _Denoising(denoise, mask_token_id, config, generator)
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


def _scdd_log_probs(job: _Denoising, canvas: Tensor, attn: Tensor) -> Tensor:
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


def _all_rows_ended(x: Tensor, starts: list[int], eos: int, mask: int) -> bool:
    """Every row has generated an EOS with no mask before it: whatever follows is moot."""
    for row in (x[i, start:] for i, start in enumerate(starts)):
        hits = (row == eos).nonzero()
        if not len(hits) or (row[: int(hits[0])] == mask).any():
            return False
    return True


def trim_at_eos(tokens: Tensor, eos_token_id: int | None) -> list[int]:
    ids = tokens.tolist()
    if eos_token_id is not None and eos_token_id in ids:
        ids = ids[: ids.index(eos_token_id)]
    return ids


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


@torch.no_grad()
def block_canvas_sample(
    model,
    prompts: list[list[int]],
    *,
    vocab_size: int,
    block_size: int,
    pad_token_id: int,
    config: SamplerConfig,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    on_block: Progress | None = None,
) -> SampleResult:
    """Block-diffusion canvas decoding for a `BlockDiffusionLM` (uniform noise, no [MASK]).

    Per block: the canvas starts as uniform random tokens; for k = 0..K−1 the model (encoder over the
    clean context, canvas under the block-causal mask, previous step's logits as self-conditioning)
    predicts x̂ and the canvas moves from t = 1 − k/K to s = 1 − (k+1)/K by the posterior above;
    temperature 0 uses a greedy x̂. The finished block joins the clean context. Stops after a block
    that contains EOS. One NFE = one model call.
    """
    job = _CanvasDecoding(model, vocab_size, block_size, pad_token_id, config, generator, device)
    n_blocks = math.ceil(config.max_new_tokens / block_size)
    steps = max(1, config.steps // n_blocks)
    nfe, rows = 0, []
    for prompt in prompts:
        row, used = _canvas_decode_row(job, prompt, n_blocks, steps, on_block)
        nfe += used
        rows.append(row)
    return _per_row_result(prompts, rows, config, pad_token_id, device, nfe)


@dataclass(frozen=True)
class _CanvasDecoding:
    """What stays fixed while `block_canvas_sample` decodes: the model, the vocabulary and block sizes,
    the pad id, the sampler settings, the generator every draw comes from and the device."""

    model: object
    vocab_size: int
    block_size: int
    pad_token_id: int
    config: SamplerConfig
    generator: torch.Generator | None
    device: torch.device | str


class _CanvasInputs(NamedTuple):
    enc: Tensor  # [1, P + bs] clean context then pad (encoder input)
    pad_mask: Tensor  # [1, P + bs] bool: the padded tail
    mask: Tensor  # block-causal canvas mask (full layers)
    positions: Tensor  # [1, bs] canvas positions P..P+bs−1


def _canvas_decode_row(
    job: _CanvasDecoding, prompt: list[int], n_blocks: int, steps: int, on_block: Progress | None
) -> tuple[Tensor, int]:
    """One prompt, block by block until `n_blocks` or a block that contains EOS → (its generated tokens
    cut to `max_new_tokens`, the model calls it took)."""
    context = torch.tensor(prompt, dtype=torch.long, device=job.device)
    produced: list[Tensor] = []
    nfe = 0
    for _ in range(n_blocks):
        canvas, used = _canvas_decode_block(job, context, steps)
        nfe += used
        produced.append(canvas[0])
        context = torch.cat([context, canvas[0]])
        if on_block is not None:
            on_block(context[None])
        if job.config.eos_token_id is not None and bool((canvas == job.config.eos_token_id).any()):
            break
    return torch.cat(produced)[: job.config.max_new_tokens], nfe


def _canvas_inputs(job: _CanvasDecoding, context: Tensor) -> _CanvasInputs:
    """The model inputs for the block after `context` [P] that do not change across its steps."""
    p_len, block_size, device = context.shape[0], job.block_size, job.device
    enc = torch.cat([context, torch.full((block_size,), job.pad_token_id, dtype=torch.long, device=device)])[None]
    pad_mask = torch.zeros_like(enc, dtype=torch.bool)
    pad_mask[:, p_len:] = True
    mask, _ = build_block_diffusion_training_mask(
        torch.tensor([p_len], device=device), block_size, p_len + block_size, block_size, device=device
    )
    positions = (p_len + torch.arange(block_size, device=device))[None]
    return _CanvasInputs(enc, pad_mask, mask, positions)


def _canvas_decode_block(job: _CanvasDecoding, context: Tensor, steps: int) -> tuple[Tensor, int]:
    """One block: a uniform random canvas [1, bs] moved from t = 1 to t = 0 in `steps` posterior steps
    (the last one greedy at temperature 0) → (the canvas, the model calls it took)."""
    inputs = _canvas_inputs(job, context)
    canvas = torch.randint(0, job.vocab_size, (1, job.block_size), generator=job.generator, device=job.device)
    previous = None
    nfe = 0
    for k in range(steps):
        logits = job.model(
            input_ids=inputs.enc,
            canvas_ids=canvas,
            decoder_attention_mask=inputs.mask,
            encoder_padding_mask=inputs.pad_mask,
            decoder_position_ids=inputs.positions,
            self_conditioning_logits=previous,
        ).logits.double()
        nfe += 1
        previous = logits
        probs = _canvas_probs(logits, job.vocab_size, job.config.temperature)
        alpha_t, alpha_s = k / steps, (k + 1) / steps  # α = 1 − t
        if k == steps - 1 and job.config.temperature == 0:
            return probs.argmax(-1), nfe
        post = uniform_posterior(probs, canvas, max(alpha_t, 1e-12), alpha_s)
        canvas = torch.multinomial(post[0], 1, generator=job.generator).T
    return canvas, nfe


def _canvas_probs(logits: Tensor, vocab_size: int, temperature: float) -> Tensor:
    """x̂ of one step in float64: one-hot of the argmax at temperature 0, else the tempered softmax."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab_size).double()
    return torch.softmax(logits / temperature, dim=-1)
