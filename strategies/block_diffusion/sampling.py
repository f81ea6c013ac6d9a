"""The block-diffusion canvas sampler (docs/strategies.md §11.6): uniform-noise canvases decoded block by block,
with low-confidence settling or the exact reverse step of the uniform kernel (`strategies.posteriors`). The
shared machinery (config, result, truncation) is in `strategies.sampling`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from strategies.block_diffusion.model import BlockDiffusionLM
from strategies.decoding_cache import EncoderCache, cacheable
from strategies.masks import build_block_diffusion_training_mask
from strategies.posteriors import own_token_log_likelihood, reverse_step
from strategies.sampling import (
    Progress,
    SamplerConfig,
    SampleResult,
    per_row_result,
    truncate,
)


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
    own_token_evidence: str = "analytic",
) -> SampleResult:
    """Block-diffusion canvas decoding for a `BlockDiffusionLM` or a `DiffusionGemmaCanvas` (uniform noise, no
    [MASK]).

    Per block: the canvas starts as uniform random tokens; for k = 0..K−1 the model (encoder over the
    clean context, canvas under the block-causal mask, previous step's logits as self-conditioning)
    predicts the posterior π over each clean token, tempered and truncated (top-k / top-p) as for the
    other samplers, and the canvas moves from t = 1 − k/K to s = 1 − (k+1)/K: with `remasking:
    low_confidence` (the default) the ⌊(k+1)·bs/K⌋ most confident proposals are kept and the rest of the
    canvas is fresh noise (`_confident_step`); with `random` by the exact reverse step
    Σ_x π(x)·q(z_s | z_t, x) (`reverse_step`). Temperature 0 proposes the argmax. The finished block
    joins the clean context. `own_token_evidence` says what the logits are
    (strategies/block_diffusion/strategy.py): "analytic", log x̂, to which log q(z_t | x) at the step's
    level is added to get log π; "learned", log π itself. Stops after a block
    that contains EOS. One NFE = one model call. Unless `config.cache` is "none", the encoder's K/V of the
    context are computed once per block and extended by each finished block (exact, docs/decoding.md): the
    model's `encoder_cache()` keeps them (DiffusionGemma: its own cache, as its generation keeps it).
    """
    if own_token_evidence not in ("analytic", "learned"):
        raise ValueError(f"own_token_evidence must be 'analytic' or 'learned', got {own_token_evidence!r}")
    job = _CanvasDecoding(
        model, vocab_size, block_size, pad_token_id, config, generator, device, own_token_evidence == "analytic"
    )
    n_blocks = math.ceil(config.max_new_tokens / block_size)
    steps = max(1, config.steps // n_blocks)
    nfe, rows = 0, []
    for prompt in prompts:
        row, used = _canvas_decode_row(job, prompt, n_blocks, steps, on_block)
        nfe += used
        rows.append(row)
    return per_row_result(prompts, rows, config, pad_token_id, device, nfe)


@dataclass(frozen=True)
class _CanvasDecoding:
    """What stays fixed while `block_canvas_sample` decodes: the model, the vocabulary and block sizes,
    the pad id, the sampler settings, the generator every draw comes from, the device and whether the
    logits leave out the evidence of the token they score (`own_token_evidence` "analytic")."""

    model: object
    vocab_size: int
    block_size: int
    pad_token_id: int
    config: SamplerConfig
    generator: torch.Generator | None
    device: torch.device | str
    add_own_token: bool = True


class _CanvasInputs(NamedTuple):
    enc: Tensor  # [1, P + bs] clean context then pad (encoder input)
    pad_mask: Tensor  # [1, P + bs] bool: the padded tail
    masks: dict  # block-causal canvas masks {"full_attention", "sliding_attention"}


def encoder_cache(model):
    """The exact encoder cache the sampler decodes over (docs/decoding.md): the model's own where it keeps one
    (DiffusionGemma's `encoder_cache()`), `EncoderCache` over a `BlockDiffusionLM` whose backbone can be cached;
    None: every step re-encodes the context."""
    own = getattr(model, "encoder_cache", None)
    if own is not None:
        return own()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper: its model
    return EncoderCache(base) if isinstance(base, BlockDiffusionLM) and cacheable(base.lm) else None


def _canvas_decode_row(
    job: _CanvasDecoding, prompt: list[int], n_blocks: int, steps: int, on_block: Progress | None
) -> tuple[Tensor, int]:
    """One prompt, block by block until `n_blocks` or a block that contains EOS → (its generated tokens
    cut to `max_new_tokens`, the model calls it took)."""
    context = torch.tensor(prompt, dtype=torch.long, device=job.device)
    produced: list[Tensor] = []
    nfe = 0
    encoder = encoder_cache(job.model) if job.config.cache != "none" else None
    for _ in range(n_blocks):
        canvas, used = _canvas_decode_block(job, context, steps, encoder)
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
    full, sliding = build_block_diffusion_training_mask(
        torch.tensor([p_len], device=device),
        block_size,
        p_len + block_size,
        block_size,
        sliding_window=getattr(job.model, "canvas_sliding_window", None),
        device=device,
    )
    return _CanvasInputs(enc, pad_mask, {"full_attention": full, "sliding_attention": sliding})


def _canvas_step(job: _CanvasDecoding, context: Tensor, encoder):
    """`(canvas, previous logits) → logits` of one model call in the block after `context`: the whole model
    (encoder re-run on the context every step) or, with `encoder` (the model's `encoder_cache()`), the
    decoder pass alone over the context's encoder K/V computed once for the block (`decode_cached`)."""
    model = job.model
    positions = (context.shape[0] + torch.arange(job.block_size, device=job.device))[None]
    if encoder is None:
        inputs = _canvas_inputs(job, context)
        return lambda canvas, previous: (
            model(
                input_ids=inputs.enc,
                canvas_ids=canvas,
                decoder_attention_mask=inputs.masks,
                encoder_padding_mask=inputs.pad_mask,
                decoder_position_ids=positions,
                self_conditioning_logits=previous,
            ).logits
        )
    state = encoder.extend(context[None])
    return lambda canvas, previous: model.decode_cached(state, canvas, positions, previous)


def _canvas_decode_block(job: _CanvasDecoding, context: Tensor, steps: int, encoder=None) -> tuple[Tensor, int]:
    """One block: a uniform random canvas [1, bs] moved from t = 1 to t = 0 in `steps` steps → (the canvas,
    the model calls it took). Each step turns the logits into the posterior π at the step's level and
    moves the canvas by `_ancestral_step` (`remasking: random`) or `_confident_step` (`low_confidence`)."""
    if job.config.remasking not in ("low_confidence", "random"):
        raise NotImplementedError(f"canvas sampler: unknown remasking {job.config.remasking!r}")
    step = _canvas_step(job, context, encoder)
    canvas = torch.randint(0, job.vocab_size, (1, job.block_size), generator=job.generator, device=job.device)
    settled = torch.zeros_like(canvas, dtype=torch.bool)
    previous = None
    nfe = 0
    for k in range(steps):
        logits = step(canvas, previous).double()
        nfe += 1
        previous = logits  # self-conditioning reads the raw logits, as in training (docs/strategies.md §9.5)
        alpha_t, alpha_s = k / steps, (k + 1) / steps  # α = 1 − t
        if job.config.remasking == "random":
            logits = _posterior_logits(job, logits, canvas, alpha_t, None)
            canvas = _ancestral_step(job, logits, canvas, alpha_t, alpha_s, last=k == steps - 1)
        else:
            logits = _posterior_logits(job, logits, canvas, alpha_t, ~settled)
            canvas, settled = _confident_step(job, logits, ((k + 1) * job.block_size) // steps)
    return canvas, nfe


def _posterior_logits(job: _CanvasDecoding, logits: Tensor, canvas: Tensor, alpha_t: float, noise: Tensor | None):
    """log π (up to a constant per position) from the model's logits at level α_t. Positions in `noise`
    [1, bs] are known to hold fresh noise, so their token is no evidence and π = x̂ there; elsewhere the
    token is evidence, weighed by q(z | x) (module docstring)."""
    evidence = own_token_log_likelihood(canvas, alpha_t, job.vocab_size)
    with_own, without_own = (logits + evidence, logits) if job.add_own_token else (logits, logits - evidence)
    return with_own if noise is None else torch.where(noise[..., None], without_own, with_own)


def _ancestral_step(job: _CanvasDecoding, logits: Tensor, canvas: Tensor, alpha_t: float, alpha_s: float, last: bool):
    """The exact reverse step: z_s ~ Σ_x π(x)·q(z_s | z_t, x) (`reverse_step`); every position may move,
    chosen at random. At temperature 0 π is one-hot and the last step takes its argmax directly."""
    probs = _canvas_probs(logits, job.vocab_size, job.config)
    if last and job.config.temperature == 0:
        return probs.argmax(-1)
    post = reverse_step(probs, canvas, alpha_t, alpha_s)
    return torch.multinomial(post[0], 1, generator=job.generator).T


def _confident_step(job: _CanvasDecoding, logits: Tensor, settled: int) -> tuple[Tensor, Tensor]:
    """Low-confidence remasking on the uniform canvas (the absorbing sampler's rule, docs/strategies.md
    §11.2, with fresh noise in place of [MASK]): every position proposes x̃ from π (argmax at temperature
    0, else a tempered, truncated draw); the `settled` positions whose proposal has the highest
    posterior probability keep it, and every other position gets a fresh uniform random token, as the
    forward process at the next level has it → (canvas, settled mask). A settled token is proposed again
    next step and stays only while it stays among the most confident, so the sampler can revise it; the
    last step settles all."""
    probs = _canvas_probs(logits, job.vocab_size, job.config)
    if job.config.temperature == 0:
        proposal = probs.argmax(-1)
    else:
        proposal = torch.multinomial(probs[0], 1, generator=job.generator).T
    keep = torch.zeros_like(proposal, dtype=torch.bool)
    if settled >= job.block_size:
        return proposal, ~keep
    confidence = torch.softmax(logits, dim=-1).gather(-1, proposal[..., None])[..., 0]
    keep[0, confidence[0].topk(settled).indices] = True
    noise = torch.randint(0, job.vocab_size, proposal.shape, generator=job.generator, device=proposal.device)
    return torch.where(keep, proposal, noise), keep


def _canvas_probs(logits: Tensor, vocab_size: int, config: SamplerConfig) -> Tensor:
    """π of one step in float64: one-hot of the argmax at temperature 0, else the tempered softmax over
    the tokens `top_k` / `top_p` keep (docs/decoding.md §2)."""
    if config.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab_size).double()
    return torch.softmax(truncate(logits, config.top_k, config.top_p) / config.temperature, dim=-1)
