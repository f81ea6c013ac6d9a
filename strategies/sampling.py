"""Absorbing-state sampler for masked dLLMs (docs/strategies.md §11.2): semi-autoregressive blocks, per-block
transfer schedule, low-confidence or random remasking, optional confidence threshold, EOS stop.

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

from strategies.decoding_cache import CausalPrefix, bidirectional_denoiser, cacheable, check_cache_mode, open_decoder
from strategies.dflash import LOOKUP_MAX_NGRAM

Denoiser = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class SamplerInfo:
    """What `dllm-flow generate` needs to know of a sampler."""

    summary: str
    infills: bool = False  # fills [MASK] spans anywhere in the prompt (`infill_sample`)
    # None: the open-ended defaults of evaluation (`eval.temperature`, `eval.top_p`; docs/strategies.md §11.7)
    default_temperature: float | None = None


ABSORBING = "llada"  # the absorbing [MASK] sampler over any strategy's bidirectional denoiser
SPECULATIVE = "speculative"  # a draft proposes a block, the frozen target verifies it
SAMPLERS: dict[str, SamplerInfo] = {
    ABSORBING: SamplerInfo("absorbing [MASK] sampler (mdlm; also scdd and the hybrid's diffusion branch)", True),
    "idlm": SamplerInfo("absorbing sampler with logit shift 1 (idlm)", True),
    "isd": SamplerInfo("introspective strided decoding: propose with the diffusion half, verify causally (idlm)"),
    "scdd": SamplerInfo("ancestral posterior sampler with the final noise-removal pass (scdd)"),
    "hybrid": SamplerInfo("blocks seeded by the causal branch, completed by diffusion (hybrid)"),
    "canvas": SamplerInfo("uniform-noise canvas decoding (block_diffusion)"),
    # greedy by default: the target's own greedy text, token for token (T > 0 samples the target's distribution)
    SPECULATIVE: SamplerInfo("DFlash: the draft proposes, the target verifies; the target's own text", False, 0.0),
}


@dataclass(frozen=True)
class SamplerConfig:
    steps: int = 128
    max_new_tokens: int = 128
    block_size: int = 32
    temperature: float = 0.0
    # at temperature > 0, draw only from the `top_k` most likely tokens (0: all) and from the smallest set
    # whose probability reaches `top_p` (nucleus sampling; 1.0: all) — docs/strategies.md §11.7
    top_k: int = 0
    top_p: float = 1.0
    remasking: str = "low_confidence"
    threshold: float | None = None
    eos_token_id: int | None = None
    logit_shift: int = 0
    # K/V reuse across steps (docs/decoding.md §5): "none", "exact" (causal parts only, tokens unchanged),
    # "prefix" / "dual" (also Fast-dLLM's approximate caches for bidirectional decoding)
    cache: str = "exact"
    # which of the strategy's samplers `DLLMStrategy.sample` runs ("auto": its first, see `samplers`)
    sampler: str = "auto"
    # speculative decoding only: propose from the context when its last n…4 tokens recur (0: off; §10.8)
    lookup_ngram: int = 0

    def __post_init__(self) -> None:
        # each message names the field and its `dllm-flow generate` flag, so it reads right from either
        check_cache_mode(self.cache)
        if self.top_k < 0:
            raise ValueError(f"top_k (--top-k) must be ≥ 0 (0: all tokens); got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p (--top-p) must be in (0, 1] (1: no nucleus cut); got {self.top_p}")
        for name in ("steps", "max_new_tokens", "block_size"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} ({flag}) must be at least 1; got {getattr(self, name)}")
        if not 0 <= self.lookup_ngram <= LOOKUP_MAX_NGRAM:
            raise ValueError(
                f"lookup_ngram (--lookup-ngram) must be in 0..{LOOKUP_MAX_NGRAM} (0: off; the lookup matches "
                f"suffixes of at most {LOOKUP_MAX_NGRAM} tokens); got {self.lookup_ngram}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature (--temperature) must be ≥ 0 (0: greedy); got {self.temperature}")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise ValueError(f"threshold (--threshold) must be in (0, 1] (a confidence) or unset; got {self.threshold}")


@dataclass(frozen=True)
class SampleResult:
    tokens: Tensor  # [B, P_max + G] canvas (prompt left-aligned per row)
    prompt_lengths: list[int]
    prompt_width: int
    nfe: float  # denoiser forwards per sequence (a batched forward counts once; per-row loops are averaged)
    # generated tokens per sequence that a sampler able to revise (SCDD) changed after first placing them
    revised: float | None = None

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


def _uniform(shape, generator: torch.Generator | None, device, cols: tuple[int, int] | None, **kw) -> Tensor:
    """U(0,1) draws of `shape` [B, q, ...] for canvas columns [lo, lo + q) of a `width`-wide canvas, `cols` =
    (lo, width): drawn for the whole canvas and sliced, so a cached decoder consumes the generator exactly
    as the uncached one does (same seed, same draws)."""
    if cols is None:
        return torch.rand(shape, generator=generator, device=device, **kw)
    lo, width = cols
    return torch.rand((shape[0], width, *shape[2:]), generator=generator, device=device, **kw)[:, lo : lo + shape[1]]


def truncate(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """`logits` with every token outside the top-k and outside the nucleus set to −inf (docs/strategies.md §11.7).

    The nucleus is the smallest set of most likely tokens whose probability reaches `top_p`; the most likely
    token is always kept, ties at the cut are kept together. `top_k` 0 and `top_p` 1 return `logits` itself."""
    if top_k <= 0 and top_p >= 1:
        return logits
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        keep &= logits >= kth
    if top_p < 1:
        probs = torch.softmax(logits.float().masked_fill(~keep, -math.inf), dim=-1)
        sorted_p, _ = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the strictly more likely tokens
        cut = sorted_p.masked_fill(before >= top_p, math.inf).amin(dim=-1, keepdim=True)
        keep &= probs >= cut
    return logits.masked_fill(~keep, -math.inf)


def _proposals(
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


Progress = Callable[[Tensor], None]  # called with the canvas after each finished block (streaming)


@dataclass(frozen=True)
class Denoising:
    """What the absorbing samplers share across windows: the denoiser, the [MASK] id, the sampler
    settings and the generator every draw comes from."""

    denoise: Denoiser
    mask_token_id: int
    config: SamplerConfig
    generator: torch.Generator | None
    decoder: object | None = None  # a cached decoder over `denoise` (strategies.decoding_cache.open_decoder)


def _denoise_window(
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
        proposals = _proposals(truncate(logits, config.top_k, config.top_p), config.temperature, generator, cols)
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
        x, used = _denoise_window(job, x, attn, window, steps_per_block, ended)
        nfe += used
        if on_block is not None:
            on_block(x)
        if ended is not None and ended(x):
            x = torch.where(x == mask_token_id, torch.full_like(x, eos), x)  # all after EOS
            break
    return SampleResult(x, starts, width, nfe)


def prompt_canvas(
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


def row_windows(x: Tensor, starts: list[int], lo: int, hi: int) -> Tensor:
    """Bool [B,T]: each row's own window [start + lo, start + hi)."""
    window = torch.zeros_like(x, dtype=torch.bool)
    for i, start in enumerate(starts):
        window[i, start + lo : start + hi] = True
    return window


def per_row_result(
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
    out, _, starts, width = prompt_canvas(prompts, gen_len, fill, pad_token_id, eos_token_id, device)  # nothing masked
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
    job = Denoising(denoise, mask_token_id, config, generator, open_decoder(denoise, config))
    nfe = 0
    for b in range(n_blocks):
        window = row_windows(x, [0] * len(sequences), b * config.block_size, (b + 1) * config.block_size)
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
    NFE counts both kinds of forward. Caches (docs/decoding.md): the causal branch keeps the context's K/V
    (exact); with cache "prefix"/"dual" the diffusion branch keeps them through a block (approximate)."""
    gen_len, bs = config.max_new_tokens, min(config.block_size, config.max_new_tokens)
    n_blocks = math.ceil(gen_len / bs)
    steps_per_block = max(1, math.ceil(config.steps / n_blocks))
    eos = config.eos_token_id
    denoise = lambda x, attn: model(input_ids=x).logits  # noqa: E731  (diffusion branch, ids carry [MASK])
    lm = getattr(model, "lm", None)
    if cacheable(lm):
        denoise = bidirectional_denoiser(model, lm, call=denoise)
    job = Denoising(denoise, mask_token_id, config, generator, open_decoder(denoise, config))
    nfe, rows = 0, []
    for prompt in prompts:
        context = torch.tensor(prompt, dtype=torch.long, device=device)[None]
        seeder = CausalPrefix(lm).last_logits if cacheable(lm) and config.cache != "none" else model.causal_logits
        for b in range(n_blocks):
            size = min(bs, gen_len - b * bs)
            seed_logits = seeder(context)[:, -1:].clone()
            seed_logits[..., mask_token_id] = -math.inf
            seed = _proposals(truncate(seed_logits, config.top_k, config.top_p), config.temperature, generator)
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
    return per_row_result(prompts, rows, config, pad_token_id, device, nfe)


def all_rows_ended(x: Tensor, starts: list[int], eos: int, mask: int) -> bool:
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
