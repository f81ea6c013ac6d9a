"""Cached decoding (docs/decoding.md): exact caches give the uncached tokens (I-DLM's causal prefix, the hybrid's
causal seeding branch, the block-diffusion encoder); Fast-dLLM's approximate prefix/dual caches over a
bidirectional denoiser are exact at a block's first step, count their forwards and refresh at block boundaries."""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from strategies import BlockDiffusionStrategy, HybridStrategy, IDLMStrategy, MDLMStrategy
from strategies.absorbing import absorbing_sample
from strategies.base_evaluation import SampleRequest
from strategies.block_diffusion.model import BlockDiffusionLM
from strategies.decoding_cache import (
    BidirectionalDecoder,
    CausalDecoder,
    EncoderCache,
    ModelDenoiser,
    open_decoder,
    visible_mask,
)
from strategies.hybrid.model import HybridLM
from strategies.models import NATIVE, build_model, model_logits, tiny_model_config
from strategies.sampling import SamplerConfig, row_windows

V, M, PAD = 48, 47, 0
PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]  # different lengths: per-row windows at different columns


def _lm(family="llama", seed=0):
    return build_model(tiny_model_config(family, V, 64, 32, 2, 4, 2, None, family == "llama"), seed).eval()


def _sample(strategy, model, config, seed=0):
    return strategy.sample(model, SampleRequest(PROMPTS, M, PAD, config, torch.Generator().manual_seed(seed), "cpu"))


SETTINGS = [
    {},  # greedy, low-confidence remasking
    {"temperature": 1.0},
    {"temperature": 1.0, "remasking": "random"},
    {"threshold": 0.3},
]


def test_cache_mode_is_validated():
    with pytest.raises(ValueError, match="cache='kv'.*'none'.*'exact'.*'prefix'.*'dual'"):
        SamplerConfig(cache="kv")
    assert SamplerConfig().cache == "exact"


# ------------------------------------------------------------------ exact caches: identical tokens


@pytest.mark.parametrize("extra", SETTINGS)
def test_idlm_causal_prefix_cache_gives_the_uncached_tokens(extra):
    model, strategy = _lm("qwen3"), IDLMStrategy()
    base = SamplerConfig(steps=12, max_new_tokens=12, block_size=4, logit_shift=strategy.logit_shift, **extra)
    plain = _sample(strategy, model, dataclasses.replace(base, cache="none"))
    cached = _sample(strategy, model, dataclasses.replace(base, cache="exact"))
    assert torch.equal(plain.tokens, cached.tokens) and plain.nfe == cached.nfe
    assert not (cached.tokens == M).any()


def test_idlm_decoder_forwards_only_the_window_rows_after_the_first():
    """Causal: nothing after the window is forwarded, and the final prefix is forwarded once."""
    model = _lm("qwen3")
    seen = []
    model.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    cfg = SamplerConfig(steps=8, max_new_tokens=8, block_size=4, logit_shift=1)
    res = _sample(IDLMStrategy(), model, cfg)
    assert len(seen) == res.nfe == 8
    # block 1 spans columns [2, 9) → rows [1, 8): all 8 rows first, then from the kept column 0 on;
    # block 2 spans [6, 13) → rows [5, 12): the now-final columns 1..4 join the kept prefix, then 7 rows a step
    assert seen == [8, 7, 7, 7, 11, 7, 7, 7]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hybrid_causal_seed_cache_gives_the_uncached_tokens(temperature):
    model, strategy = HybridLM(_lm(), M), HybridStrategy()
    base = SamplerConfig(steps=12, max_new_tokens=12, block_size=4, temperature=temperature)
    plain = _sample(strategy, model, dataclasses.replace(base, cache="none"))
    cached = _sample(strategy, model, dataclasses.replace(base, cache="exact"))
    assert torch.equal(plain.tokens, cached.tokens) and plain.nfe == cached.nfe


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_block_diffusion_encoder_cache_gives_the_uncached_tokens(temperature):
    model = BlockDiffusionLM(_lm()).eval()
    strategy = BlockDiffusionStrategy({"block_size": 4, "vocab_size": V})
    base = SamplerConfig(steps=12, max_new_tokens=12, block_size=4, temperature=temperature)
    plain = _sample(strategy, model, dataclasses.replace(base, cache="none"))
    cached = _sample(strategy, model, dataclasses.replace(base, cache="exact"))
    assert torch.equal(plain.tokens, cached.tokens) and plain.nfe == cached.nfe


def test_encoder_cache_extends_with_the_new_block_only_and_equals_a_fresh_encode():
    model = BlockDiffusionLM(_lm()).eval()
    cache = EncoderCache(model)
    context = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    cache.extend(context[:, :3])
    kv = cache.extend(context)
    assert cache.positions == 7 and cache.forwards == 2  # 3 prompt columns, then the 4 new ones
    _, fresh = model.encode(context, None, None)
    for (k, v), (fk, fv) in zip(kv, fresh):
        torch.testing.assert_close(k, fk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, fv, atol=1e-5, rtol=1e-5)


def test_exact_mode_leaves_bidirectional_decoding_uncached():
    model, strategy = _lm(), MDLMStrategy()
    assert open_decoder(strategy.denoiser(model), SamplerConfig(cache="exact")) is None
    assert isinstance(open_decoder(IDLMStrategy().denoiser(model), SamplerConfig(cache="exact")), CausalDecoder)
    assert open_decoder(lambda x, attn: x, SamplerConfig(cache="dual")) is None  # any callable: uncached


def test_a_model_that_attends_on_its_own_is_decoded_uncached_with_a_warning():
    model = _lm()
    model.config.dllm_attention = NATIVE
    with pytest.warns(UserWarning, match="cannot be cached"):
        assert open_decoder(MDLMStrategy().denoiser(model), SamplerConfig(cache="prefix")) is None


# ------------------------------------------------------------------ approximate (Fast-dLLM) caches


def _canvas():
    x = torch.tensor([[1, 2, 3, 4, 5] + [M] * 8, [6, 7] + [M] * 8 + [PAD] * 3])
    return x, row_windows(x, [5, 2], 0, 8)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_first_step_of_a_block_equals_the_uncached_logits(mode):
    """One block spanning the whole generation: the first step is the exact full forward."""
    model = _lm()
    x, window = _canvas()
    decoder = BidirectionalDecoder(model, mode, 0)
    lo, logits = decoder.window(x, window)(x)
    full = model_logits(model, {"input_ids": x})
    assert lo == 2 and logits.shape[1] == 11  # columns 2..12: the union of both rows' windows
    torch.testing.assert_close(logits, full[:, 2:13], atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_one_step_per_block_gives_the_uncached_tokens(mode):
    """With one step per block every forward is a block's first: exact."""
    model, strategy = _lm(), MDLMStrategy()
    base = SamplerConfig(steps=3, max_new_tokens=12, block_size=4)
    plain = _sample(strategy, model, dataclasses.replace(base, cache="none"))
    cached = _sample(strategy, model, dataclasses.replace(base, cache=mode))
    assert torch.equal(plain.tokens, cached.tokens)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_forwards_are_counted_and_later_steps_forward_less(mode):
    model, strategy = _lm(), MDLMStrategy()
    seen = []
    model.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    cfg = SamplerConfig(steps=12, max_new_tokens=12, block_size=4, cache=mode)
    res = _sample(strategy, model, cfg)
    width = max(map(len, PROMPTS)) + 12
    assert res.nfe == len(seen) == 12 and 12 / res.nfe == 1.0  # one forward per step, each counted once
    assert seen[0::4] == [width] * 3  # every block starts with the whole canvas (the refresh)
    # later steps: the block's column span (rows start at 2..5 → span 4 + 3), plus the suffix with "prefix"
    spans = [s for i, s in enumerate(seen) if i % 4]
    expected = [width - (2 + 4 * b) for b in range(3) for _ in range(3)] if mode == "prefix" else [7] * 9
    assert spans == expected
    assert not (res.tokens == M).any()
    for row, p in enumerate(PROMPTS):
        assert res.tokens[row, : len(p)].tolist() == p


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_the_cache_is_refreshed_when_a_block_finishes(mode):
    """The K/V kept for a new block are those of a fresh full forward of the canvas as it then is."""
    model = _lm()
    x, _ = _canvas()
    decoder = BidirectionalDecoder(model, mode, 0)
    first = row_windows(x, [5, 2], 0, 4)
    step = decoder.window(x, first)
    step(x)
    x = torch.where(first, torch.full_like(x, 11), x)  # block 1 finishes
    step(x)  # a later step reads the K/V kept at the block's start
    stale = decoder.kv[-1][0].clone()  # the last layer: its K/V depend on the context
    decoder.window(x, row_windows(x, [5, 2], 4, 8))(x)  # block 2's first step
    cache = DynamicCache(config=model.config)  # a fresh forward of the whole canvas, through transformers' cache
    model(input_ids=x, attention_mask=visible_mask(2, x.shape[1], x.shape[1], "cpu"), cache=cache, use_cache=True)
    lo, hi = 6, 13  # block 2's columns: row 1 from 2 + 4, row 0 up to 5 + 8

    def kept(t):
        return t[:, :, :lo] if mode == "prefix" else torch.cat([t[:, :, :lo], t[:, :, hi:]], dim=2)

    for (k, v), layer in zip(decoder.kv, cache.layers):
        torch.testing.assert_close(k, kept(layer.keys))
        torch.testing.assert_close(v, kept(layer.values))
    assert not torch.allclose(stale[:, :, :2], decoder.kv[-1][0][:, :, :2])  # the prompt's K/V moved with the canvas


def test_approximate_caches_fill_every_mask_and_keep_the_prompts_for_the_hybrid_and_infill():
    model = HybridLM(_lm(), M)
    res = _sample(HybridStrategy(), model, SamplerConfig(steps=12, max_new_tokens=12, block_size=4, cache="dual"))
    assert not (res.tokens == M).any()
    for row, p in enumerate(PROMPTS):
        assert res.tokens[row, : len(p)].tolist() == p


def test_model_denoiser_is_a_plain_denoiser_too():
    model = _lm()
    denoise = MDLMStrategy().denoiser(model)
    x, _ = _canvas()
    assert isinstance(denoise, ModelDenoiser)
    torch.testing.assert_close(denoise(x, None), model_logits(model, {"input_ids": x}))
    cfg = SamplerConfig(steps=4, max_new_tokens=4, block_size=4, cache="none")
    res = absorbing_sample(denoise, PROMPTS, mask_token_id=M, pad_token_id=PAD, config=cfg)
    assert not (res.tokens == M).any()
