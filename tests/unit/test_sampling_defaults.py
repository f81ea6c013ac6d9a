"""Open-ended sampling (docs/strategies.md §11.7): top-k / nucleus truncation against an element-wise
reference, what it does inside the absorbing and hybrid samplers, and the defaults evaluation and
`generate` share."""

import math

import pytest
import torch

from dllm_common.config import EvalConfig
from strategies.absorbing import absorbing_sample
from strategies.sampling import SamplerConfig, truncate

MASK, PAD, V = 15, 0, 16


def kept_reference(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Element-wise: a token is kept when fewer than k tokens beat it, and the tokens strictly more likely
    than it (among those kept by top-k) hold less than top_p of the top-k-renormalized mass."""
    out = torch.zeros_like(logits, dtype=torch.bool)
    for row in range(logits.shape[0]):
        lv = logits[row].tolist()
        ok_k = [top_k <= 0 or sum(o > x for o in lv) < top_k for x in lv]
        z = sum(math.exp(x) for x, ok in zip(lv, ok_k) if ok)
        for i, x in enumerate(lv):
            above = sum(math.exp(o) for o, ok in zip(lv, ok_k) if ok and o > x) / z
            out[row, i] = ok_k[i] and (top_p >= 1 or above < top_p)
    return out


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.5), (0, 0.9), (5, 0.8), (1, 0.99), (0, 1e-6)])
def test_truncation_keeps_exactly_the_top_k_and_the_nucleus(top_k, top_p):
    gen = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    logits = torch.randn(64, V, generator=gen) * 2
    kept = truncate(logits, top_k, top_p) > -math.inf
    assert torch.equal(kept, kept_reference(logits, top_k, top_p))
    assert kept.gather(-1, logits.argmax(-1, keepdim=True)).all()  # the most likely token always stays
    if top_k == 0 and top_p == 1.0:
        assert truncate(logits, top_k, top_p) is logits
    else:  # kept logits are unchanged, not rescaled
        assert torch.equal(truncate(logits, top_k, top_p)[kept], logits[kept])


def test_nucleus_keeps_tied_tokens_at_the_cut_together():
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]]))
    kept = truncate(logits, 0, 0.5) > -math.inf  # 0.4 alone < 0.5; the next level (0.2) is two tied tokens
    assert kept.tolist() == [[True, True, True, False, False]]


def test_bad_truncation_settings_are_refused():
    for kw, message in (
        ({"top_k": -1}, r"^top_k \(--top-k\) must be ≥ 0 \(0: all tokens\); got -1$"),
        ({"top_p": 0.0}, r"^top_p \(--top-p\) must be in \(0, 1\] \(1: no nucleus cut\); got 0.0$"),
        ({"top_p": 1.5}, r"^top_p \(--top-p\) must be in \(0, 1\] \(1: no nucleus cut\); got 1.5$"),
    ):
        with pytest.raises(ValueError, match=message):
            SamplerConfig(**kw)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"steps": 0}, "steps \\(--steps\\) must be at least 1; got 0"),
        ({"max_new_tokens": -5}, "max_new_tokens \\(--max-new-tokens\\) must be at least 1; got -5"),
        ({"block_size": 0}, "block_size \\(--block-size\\) must be at least 1; got 0"),
        ({"temperature": -1.0}, "temperature \\(--temperature\\) must be ≥ 0"),
        ({"threshold": 1.5}, "threshold \\(--threshold\\) must be in"),
        ({"threshold": 0.0}, "threshold \\(--threshold\\) must be in"),
        ({"lookup_ngram": -1}, "lookup_ngram \\(--lookup-ngram\\) must be in 0..4 \\(0: off; .*\\); got -1"),
        ({"lookup_ngram": 5}, "lookup_ngram \\(--lookup-ngram\\) must be in 0..4 .* at most 4 tokens\\); got 5"),
    ],
)
def test_bad_sampler_settings_are_refused_by_name(kw, message):
    """`dllm-flow generate --steps 0 / --max-new-tokens -5 / --block-size 0 / --temperature -1` and the same in
    the Python API: one error naming the setting, before any model runs."""
    with pytest.raises(ValueError, match=message):
        SamplerConfig(**kw)


def noisy_denoiser(seed: int):
    """A fixed random denoiser whose logits depend on position and token (deterministic per canvas)."""
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 1.5

    def denoise(x, attn=None):
        prev = torch.roll(x, 1, dims=1)
        return table[prev] + 0.1 * torch.arange(x.shape[1])[None, :, None]

    return denoise


def test_top_k_one_at_any_temperature_is_greedy_decoding():
    denoise, prompts = noisy_denoiser(0), [[1, 2], [3]]
    common = dict(mask_token_id=MASK, pad_token_id=PAD)
    greedy = absorbing_sample(denoise, prompts, config=SamplerConfig(steps=8, max_new_tokens=8, block_size=4), **common)
    for temperature in (0.7, 1.0, 3.0):
        cfg = SamplerConfig(steps=8, max_new_tokens=8, block_size=4, temperature=temperature, top_k=1)
        out = absorbing_sample(denoise, prompts, config=cfg, generator=torch.Generator().manual_seed(5), **common)
        assert torch.equal(out.tokens, greedy.tokens)


def test_nucleus_draws_follow_the_renormalized_distribution():
    """One masked position, many seeds: every draw lies in the nucleus and the frequencies match the model's
    probabilities renormalized over it (chi-square, p ≈ 1e-3 threshold)."""
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.05, 0.05] + [0.0] * (V - 6))
    logits = torch.log(probs.clamp_min(1e-12))
    logits[MASK] = -math.inf

    def denoise(x, attn=None):
        return logits.expand(*x.shape, V).clone()

    cfg = SamplerConfig(steps=1, max_new_tokens=1, block_size=1, temperature=1.0, top_p=0.75)
    gen = torch.Generator().manual_seed(0)
    n = 3000
    out = absorbing_sample(denoise, [[1]] * n, mask_token_id=MASK, pad_token_id=PAD, config=cfg, generator=gen)
    drawn = out.tokens[:, -1]
    counts = torch.bincount(drawn, minlength=V).double()
    nucleus = torch.tensor([0.35, 0.25, 0.2]) / 0.8  # 0.35 + 0.25 < 0.75 ≤ 0.8: three tokens
    assert counts[3:].sum() == 0
    expected = nucleus * n
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8  # χ²(2) at p = 0.001


def test_generate_and_evaluation_share_the_open_ended_defaults():
    from tasks.commands.generate import default_temperature, default_top_p

    e = EvalConfig()
    assert e.temperature > 0 and 0 < e.top_p < 1 and e.greedy  # the main table samples, greedy is the second
    assert default_temperature("llada") == e.temperature and default_top_p(e.temperature) == e.top_p
    assert default_temperature("speculative") == 0.0 and default_top_p(0.0) == 1.0
