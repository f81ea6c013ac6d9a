"""The hybrid's sampler (docs/strategies.md §11.4): blocks seeded by the causal branch, completed by the
diffusion branch with the absorbing sampler's window loop (`strategies.absorbing.denoise_window`)."""

from __future__ import annotations

import math

import torch

from strategies.absorbing import Denoising, denoise_window, draw_proposals
from strategies.decoding_cache import CausalPrefix, bidirectional_denoiser, cacheable, open_decoder
from strategies.sampling import Progress, SamplerConfig, SampleResult, per_row_result, truncate


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
            seed = draw_proposals(truncate(seed_logits, config.top_k, config.top_p), config.temperature, generator)
            nfe += 1
            x = torch.cat([context, seed, torch.full((1, size - 1), mask_token_id, dtype=torch.long, device=device)], 1)
            window = torch.zeros_like(x, dtype=torch.bool)
            window[:, context.shape[1] :] = True
            x, used = denoise_window(job, x, torch.ones_like(x), window, steps_per_block)
            nfe += used
            context = x
            if on_block is not None:
                on_block(context)
            if eos is not None and bool((x[0, len(prompt) :] == eos).any()):
                break
        rows.append(context[0, len(prompt) :])
    return per_row_result(prompts, rows, config, pad_token_id, device, nfe)
