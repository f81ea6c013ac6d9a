"""`DLLMStrategy.corrupt_at_level`: each strategy's own corruption of clean rows at a given noise level t (one per
row), element by element — the corrupted share of the supervised positions tracks the level, nothing else is
touched, the same generator gives the same rows — and the likelihood rows that corrupt through it give the
numbers they gave when they corrupted by hand."""

import pytest
import torch

from strategies import get_dllm_strategy
from strategies.corruption import mask_at_level
from strategies.losses import absorbing_nelbo_rows
from strategies.registry import REGISTRY

V, M, L = 50, 49, 4000
LEVELS = torch.tensor([0.0, 0.1, 0.35, 0.6, 0.9, 1.0])
OPTIONS = {"scdd": {"vocab_size": V, "mask_token_id": M}, "block_diffusion": {"vocab_size": V}}
NO_LEVEL = {"idlm": "masks every supervised token", "dflash": "anchor blocks"}


def _strategy(name):
    return get_dllm_strategy(name, OPTIONS.get(name, {"mask_token_id": M}))


def _rows(n=6):  # one row per level of LEVELS
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, M, (n, L), generator=g)
    loss_mask = torch.ones(n, L)
    loss_mask[:, : L // 4] = 0  # a prompt: never corrupted
    loss_mask[:, -7:] = 0
    return ids, loss_mask


def _expected_share(strategy, t):
    """The probability that the kernel at level t corrupts a supervised position."""
    if strategy.name == "scdd":  # the absorbing and the "different token" channels' masses at t
        mask_prob, uniform_prob = strategy._channel_probs(t)
        return mask_prob + uniform_prob
    return t


LEVELLED = sorted(set(REGISTRY) - set(NO_LEVEL))


def test_every_registered_strategy_is_covered():
    assert set(LEVELLED) | set(NO_LEVEL) == set(REGISTRY)


@pytest.mark.parametrize("name", LEVELLED)
def test_the_corrupted_share_tracks_the_level_and_only_supervised_positions_move(name):
    s = _strategy(name)
    ids, loss_mask = _rows()
    noisy, noise = s.corrupt_at_level(ids, loss_mask, M, LEVELS, torch.Generator().manual_seed(1))
    assert noisy.shape == ids.shape and noise.dtype == torch.bool and noisy.dtype == ids.dtype
    assert not (noise & ~loss_mask.bool()).any()  # the loss mask is respected
    assert torch.equal(noisy[~noise], ids[~noise])  # clean positions untouched
    supervised = loss_mask.bool()
    share = (noise & supervised).sum(1).float() / supervised.sum(1).float()
    expected = _expected_share(s, LEVELS).float()
    assert torch.allclose(share, expected, atol=0.03), (share, expected)
    assert share[0] == expected[0] == 0 or name == "scdd"  # level 0: nothing corrupted
    if name in ("mdlm", "hybrid"):  # the absorbing kernel writes [MASK], and only [MASK]
        assert (noisy[noise] == M).all() and not (noisy[~noise] == M).any()
    if name == "scdd":  # the mixed kernel: [MASK] or a token different from the clean one
        assert ((noisy[noise] == M) | (noisy[noise] != ids[noise])).all()


@pytest.mark.parametrize("name", LEVELLED)
def test_the_same_generator_gives_the_same_rows_and_another_does_not(name):
    s = _strategy(name)
    ids, loss_mask = _rows()
    t = torch.full((len(ids),), 0.5)
    first = s.corrupt_at_level(ids, loss_mask, M, t, torch.Generator().manual_seed(7))
    again = s.corrupt_at_level(ids, loss_mask, M, t, torch.Generator().manual_seed(7))
    other = s.corrupt_at_level(ids, loss_mask, M, t, torch.Generator().manual_seed(8))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[1], other[1])


@pytest.mark.parametrize("name", sorted(NO_LEVEL))
def test_a_kernel_without_a_level_says_why(name):
    ids, loss_mask = _rows(2)
    with pytest.raises(NotImplementedError, match=NO_LEVEL[name]):
        _strategy(name).corrupt_at_level(ids, loss_mask, M, torch.tensor([0.3, 0.6]), torch.Generator())


def test_the_absorbing_level_kernel_is_mask_at_level_draw_for_draw():
    """The base hook is `mask_at_level` itself: the same draws in the same order."""
    ids, loss_mask = _rows()
    ours = _strategy("mdlm").corrupt_at_level(ids, loss_mask, M, LEVELS, torch.Generator().manual_seed(3))
    theirs = mask_at_level(ids, loss_mask, M, LEVELS, torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


class _Logits(torch.nn.Module):
    """A denoiser stand-in: fixed random logits per position, whatever the input."""

    def __init__(self, length):
        super().__init__()
        self.table = torch.randn(length, V, generator=torch.Generator().manual_seed(5))

    def forward(self, x, attn):
        return self.table[: x.shape[1]].expand(x.shape[0], -1, -1)


@pytest.mark.parametrize("name", ["mdlm", "hybrid"])
def test_the_absorbing_bound_through_the_hook_is_the_bound_it_was(name):
    """`nelbo_rows` of the base evaluator corrupts through `corrupt_at_level`: the same numbers as the bound over
    `mask_at_level` with the same generator."""
    s = _strategy(name)
    ids, loss_mask = _rows(3)
    ids, loss_mask = ids[:, :64], loss_mask[:, :64]
    t = torch.tensor([0.2, 0.5, 0.9])
    denoise = _Logits(64)
    s.evaluator.denoiser = lambda model: denoise  # the bound over a known denoiser
    ours = s.nelbo_rows(None, ids, loss_mask, M, t, torch.Generator().manual_seed(11))
    before = absorbing_nelbo_rows(denoise, ids, loss_mask, M, t, torch.Generator().manual_seed(11))
    assert torch.equal(ours, before)
