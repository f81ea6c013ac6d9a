"""The block-diffusion canvas sampler (docs/strategies.md §11.6) and the reverse step of uniform-noise
diffusion it uses. SCDD's sampler is in `strategies.scdd_sampling`. The shared machinery (config, result,
windows, transfer schedule) is in `strategies.sampling`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from strategies.decoding_cache import EncoderCache, cacheable
from strategies.masks import build_block_diffusion_training_mask
from strategies.sampling import (
    Progress,
    SamplerConfig,
    SampleResult,
    per_row_result,
)


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
    that contains EOS. One NFE = one model call. Unless `config.cache` is "none", the encoder's K/V of the
    context are computed once per block and extended by each finished block (exact, docs/decoding.md).
    """
    job = _CanvasDecoding(model, vocab_size, block_size, pad_token_id, config, generator, device)
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
    lm = getattr(job.model, "lm", None)
    encoder = EncoderCache(job.model) if job.config.cache != "none" and cacheable(lm) else None
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
    mask, _ = build_block_diffusion_training_mask(
        torch.tensor([p_len], device=device), block_size, p_len + block_size, block_size, device=device
    )
    positions = (p_len + torch.arange(block_size, device=device))[None]
    return _CanvasInputs(enc, pad_mask, mask, positions)


def _canvas_step(job: _CanvasDecoding, context: Tensor, encoder: EncoderCache | None):
    """`(canvas, previous logits) → logits` of one model call in the block after `context`: the whole model
    (encoder re-run on the context every step) or, with `encoder`, the decoder pass alone over the context's
    encoder K/V computed once for the block (its padded tail, which the mask hides, is left out)."""
    inputs, model = _canvas_inputs(job, context), job.model
    if encoder is None:
        return lambda canvas, previous: (
            model(
                input_ids=inputs.enc,
                canvas_ids=canvas,
                decoder_attention_mask=inputs.mask,
                encoder_padding_mask=inputs.pad_mask,
                decoder_position_ids=inputs.positions,
                self_conditioning_logits=previous,
            ).logits
        )
    kv, p_len = encoder.extend(context[None]), context.shape[0]
    mask = torch.cat([inputs.mask[..., :p_len], inputs.mask[..., p_len + job.block_size :]], dim=-1)
    soft = lambda previous: None if previous is None else model._soft_embedding(previous)  # noqa: E731
    return lambda canvas, previous: model.decode(kv, canvas, mask, inputs.positions, soft(previous))


def _canvas_decode_block(
    job: _CanvasDecoding, context: Tensor, steps: int, encoder: EncoderCache | None = None
) -> tuple[Tensor, int]:
    """One block: a uniform random canvas [1, bs] moved from t = 1 to t = 0 in `steps` posterior steps
    (the last one greedy at temperature 0) → (the canvas, the model calls it took)."""
    step = _canvas_step(job, context, encoder)
    canvas = torch.randint(0, job.vocab_size, (1, job.block_size), generator=job.generator, device=job.device)
    previous = None
    nfe = 0
    for k in range(steps):
        logits = step(canvas, previous).double()
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
