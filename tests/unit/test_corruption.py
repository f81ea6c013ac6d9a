"""Corruption kernels of strategies/corruption.py (docs/strategies.md §4) against the properties of §14.1
(fixture: B=4, L=32, mask 999, ids < 100, first 24 positions supervised)."""

import pytest
import torch

from strategies.corruption import (
    corrupt_all_masked,
    corrupt_blockwise,
    corrupt_mix,
    corrupt_uniform,
    corrupt_uniform_random,
    gumbel_topk,
    gumbel_topk_rows,
    replace_at_level,
)
from strategies.scdd.schedule import scdd_grid_times
from strategies.seeding import seeded_generator as gen

MASK = 999


@pytest.fixture
def batch():
    ids = torch.randint(0, 100, (4, 32), generator=gen(0))
    loss = torch.zeros(4, 32)
    loss[:, :24] = 1
    return ids, loss


# ------------------------------------------------------------------ Gumbel top-k


@pytest.mark.parametrize("k", [1, 5, 25, 50])
def test_gumbel_topk_exact_k(k):
    chosen = gumbel_topk(torch.zeros(50), k, gen(k))
    assert chosen.dtype == torch.bool and int(chosen.sum()) == k


def test_gumbel_topk_rows_respects_k_zero_and_neg_inf():
    log_w = torch.zeros(3, 6)
    log_w[1, 4:] = float("-inf")
    chosen = gumbel_topk_rows(log_w, torch.tensor([0, 6, 2]), gen(0))
    assert chosen.sum(1).tolist() == [0, 4, 2] and not chosen[1, 4:].any()


def test_gumbel_topk_follows_weights():
    """Plackett–Luce with k=1: P(i) ∝ exp(log_w_i)."""
    log_w = torch.log(torch.tensor([1.0, 2.0, 7.0]))
    g = gen(3)
    counts = sum(gumbel_topk(log_w, 1, g).long() for _ in range(4000))
    assert torch.allclose(counts / 4000, torch.tensor([0.1, 0.2, 0.7]), atol=0.03)


# ------------------------------------------------------------------ corrupt_uniform


def test_corrupt_uniform_contract(batch):
    ids, loss = batch
    noisy, noise, p = corrupt_uniform(ids, loss, MASK, eps=0.01, generator=gen(1))
    assert noisy.shape == ids.shape and noise.dtype == torch.bool and p.dtype == torch.float32
    assert not (noise & ~loss.bool()).any()  # noise ⊆ supervised
    assert (noisy[noise] == MASK).all() and torch.equal(noisy[~noise], ids[~noise])
    assert (p >= 0.01).all() and (p <= 1).all()
    assert torch.equal(p, p[:, :1].expand_as(p))  # one level per row


def test_corrupt_uniform_level_formula_and_draw_order(batch):
    ids, loss = batch
    eps = 0.05
    _, noise, p = corrupt_uniform(ids, loss, MASK, eps=eps, generator=gen(7))
    g = gen(7)
    t = torch.rand(4, generator=g)
    u = torch.rand(4, 32, generator=g)
    assert torch.allclose(p[:, 0], (1 - eps) * t + eps)
    assert torch.equal(noise, (u < p[:, :1]) & loss.bool())


def test_same_seed_same_output_and_global_rng_untouched(batch):
    ids, loss = batch
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = corrupt_uniform(ids, loss, MASK, generator=gen(5))
    b = corrupt_uniform(ids, loss, MASK, generator=gen(5))
    c = corrupt_uniform(ids, loss, MASK, generator=gen(6))
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], c[1])


# ------------------------------------------------------------------ the other kernels


def _common_contract(ids, loss, noisy, noise, p):
    assert noisy.shape == ids.shape and noise.dtype == torch.bool and p.dtype == torch.float32
    assert not (noise & ~loss.bool()).any()
    assert torch.equal(noisy[~noise], ids[~noise])


def test_corrupt_all_masked(batch):
    ids, loss = batch
    noisy, noise, p = corrupt_all_masked(ids, loss, MASK)
    assert torch.equal(noise, loss.bool()) and (noisy[:, :24] == MASK).all()
    assert torch.equal(noisy[:, 24:], ids[:, 24:]) and torch.equal(p, torch.ones(4, 32))


@pytest.mark.parametrize("bs", [None, 8])
def test_corrupt_blockwise_contract(batch, bs):
    ids, loss = batch
    noisy, noise, p = corrupt_blockwise(ids, loss, MASK, block_size=bs, eps=0.01, generator=gen(1))
    _common_contract(ids, loss, noisy, noise, p)
    assert (noisy[noise] == MASK).all() and (p >= 0.01).all() and (p <= 1).all()
    if bs is None:
        assert torch.equal(p, p[:, :1].expand_as(p))


def test_corrupt_blockwise_levels_differ_across_blocks(batch):
    ids, loss = batch
    _, _, p = corrupt_blockwise(ids, loss, MASK, block_size=8, eps=0.01, generator=gen(123))
    assert len(set(p[0, ::8].tolist())) > 1
    assert torch.equal(p[:, :8], p[:, :1].expand(4, 8))  # constant inside a block


def test_corrupt_blockwise_exact_k_on_fully_supervised_rows():
    ids = torch.randint(0, 100, (64, 20), generator=gen(2))
    loss = torch.ones(64, 20)
    _, noise, p = corrupt_blockwise(ids, loss, MASK, block_size=8, eps=0.01, generator=gen(2))
    for row in range(64):
        for start, length in ((0, 8), (8, 8), (16, 4)):  # last block is short
            m = p[row, start].item()
            assert int(noise[row, start : start + length].sum()) == min(max(round(m * length), 0), length)


def test_corrupt_blockwise_prefers_later_positions_when_few_are_masked():
    ids = torch.zeros(4000, 32, dtype=torch.long)
    noisy, noise, p = corrupt_blockwise(
        ids, torch.ones(4000, 32), MASK, eps=0.01, half_life_ratio=0.25, generator=gen(4)
    )
    light = p[:, 0] < 0.3
    assert noise[light][:, 24:].float().mean() > 2 * noise[light][:, :8].float().mean()


def test_corrupt_uniform_random(batch):
    ids, loss = batch
    noisy, noise, p = corrupt_uniform_random(ids, loss, 500, eps=0.01, generator=gen(5))
    _common_contract(ids, loss, noisy, noise, p)
    assert torch.equal(p, torch.ones(4, 32)) and noisy.dtype == ids.dtype
    assert len(set(noisy[noise].tolist())) > 1
    small, changed, _ = corrupt_uniform_random(ids % 10, loss, 10, eps=0.999, generator=gen(6))
    assert small.max() < 10 and (small != ids % 10).any()


def test_corrupt_uniform_random_block_levels_differ():
    ids = torch.zeros(1, 64, dtype=torch.long)
    _, noise, _ = corrupt_uniform_random(ids, torch.ones(1, 64), 50, block_size=16, eps=0.01, generator=gen(8))
    fractions = noise.view(4, 16).float().mean(1)
    assert len(set(fractions.tolist())) > 1


def _probs(b, value):
    return torch.full((b,), value)


def test_corrupt_mix_channels_and_contract(batch):
    ids, loss = batch
    z, n = corrupt_mix(ids, loss, MASK, 1000, mask_prob=_probs(4, 0.3), uniform_prob=_probs(4, 0.5), generator=gen(9))
    assert torch.equal(n, z != ids) and not (n & ~loss.bool()).any()
    z, n = corrupt_mix(ids, loss, MASK, 1000, mask_prob=_probs(4, 0.0), uniform_prob=_probs(4, 1.0), generator=gen(9))
    sup = loss.bool()
    assert n[sup].all() and (z[sup] != MASK).all() and (z[sup] != ids[sup]).all() and z.max() < 1000


def test_corrupt_mix_replacement_is_uniform_over_the_other_tokens():
    ids = torch.zeros(1, 60000, dtype=torch.long)
    z, _ = corrupt_mix(
        ids, torch.ones(1, 60000), 7, 8, mask_prob=_probs(1, 0.0), uniform_prob=_probs(1, 1.0), generator=gen(10)
    )
    counts = torch.bincount(z[0], minlength=8).float() / 60000
    assert counts[0] == 0 and counts[7] == 0
    assert torch.allclose(counts[1:7], torch.full((6,), 1 / 6), rtol=0.05)


@pytest.mark.parametrize("mp,up", [(0.3, 0.5), (0.1, 0.2)])
def test_corrupt_mix_channel_rates(mp, up):
    ids = torch.randint(0, 50, (8, 20000), generator=gen(11))
    z, _ = corrupt_mix(
        ids,
        torch.ones_like(ids, dtype=torch.float),
        99,
        100,
        mask_prob=_probs(8, mp),
        uniform_prob=_probs(8, up),
        generator=gen(12),
    )
    assert abs((z == 99).float().mean().item() - mp) < 0.01
    assert abs(((z != 99) & (z != ids)).float().mean().item() - up) < 0.01


def test_corrupt_mix_never_transitions_a_clean_mask_token():
    ids = torch.full((2, 500), 7)
    z, n = corrupt_mix(
        ids, torch.ones(2, 500), 7, 8, mask_prob=_probs(2, 0.0), uniform_prob=_probs(2, 1.0), generator=gen(13)
    )
    assert not n.any() and z.max() < 8


def test_corrupt_mix_errors_and_boundary():
    ids, loss = torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4)
    with pytest.raises(ValueError, match="corrupt_mix: vocab_size must be an integer >= 3, got 2"):
        corrupt_mix(ids, loss, 1, 2, mask_prob=_probs(1, 0.1), uniform_prob=_probs(1, 0.1))
    with pytest.raises(ValueError, match=r"mask_prob \+ uniform_prob <= 1"):
        corrupt_mix(ids, loss, 1, 10, mask_prob=_probs(1, 0.7), uniform_prob=_probs(1, 0.4))
    corrupt_mix(ids, loss, 1, 10, mask_prob=_probs(1, 0.3), uniform_prob=_probs(1, 0.7))


def test_scdd_grid_times_lie_on_the_inner_grid():
    t = scdd_grid_times(256, 8, 1e-3, gen(14))
    k = t * 8
    assert torch.allclose(k, k.round()) and k.min() >= 1 and k.max() == 7


KERNELS = {
    "blockwise": lambda ids, loss, g: corrupt_blockwise(ids, loss, MASK, block_size=8, generator=g),
    "blockwise_seq": lambda ids, loss, g: corrupt_blockwise(ids, loss, MASK, generator=g),
    "uniform_random": lambda ids, loss, g: corrupt_uniform_random(ids, loss, 100, generator=g),
    "mix": lambda ids, loss, g: corrupt_mix(
        ids, loss, MASK, 1000, mask_prob=_probs(4, 0.3), uniform_prob=_probs(4, 0.3), generator=g
    ),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_seeded_kernels_are_reproducible_and_leave_global_rng_alone(batch, name):
    ids, loss = batch
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a, b, c = (KERNELS[name](ids, loss, gen(s)) for s in (1, 1, 2))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], c[1])


def test_kernels_check_their_arguments_by_name():
    """Bad input to the public kernels is one error naming the argument (it used to be accepted: float ids, a
    fractional [MASK] id, eps outside [0, 1), an SCDD [MASK] id outside the vocabulary, mismatched shapes)."""
    from strategies import BlockDiffusionStrategy
    from strategies.corruption import corrupt_all_masked, corrupt_blockwise, corrupt_mix, corrupt_uniform

    ids, lm = torch.randint(0, 10, (2, 8)), torch.ones(2, 8)
    cases = [
        (lambda: corrupt_uniform(ids.float(), lm, 11), "input_ids must be an integer tensor"),
        (lambda: corrupt_uniform(ids, lm[:1], 11), r"loss_mask must have input_ids' shape \(2, 8\), got \(1, 8\)"),
        (lambda: corrupt_uniform(ids, lm, 11.5), "mask_token_id must be a non-negative integer, got 11.5"),
        (lambda: corrupt_uniform(ids, lm, True), "mask_token_id must be a non-negative integer, got True"),
        (lambda: corrupt_uniform(ids, lm, 11, eps=1.0), r"eps \(the minimum noise level\) must be in \[0, 1\)"),
        (lambda: corrupt_blockwise(ids, lm, 11, eps=-0.1), r"corrupt_blockwise: eps .* got -0.1"),
        (lambda: corrupt_all_masked(ids[0], lm, 11), "corrupt_all_masked: input_ids must be an integer tensor"),
        (
            lambda: corrupt_mix(ids, lm, 40, 32, mask_prob=torch.zeros(2), uniform_prob=torch.zeros(2)),
            "mask_token_id 40 is outside the vocabulary of 32 tokens",
        ),
        (lambda: BlockDiffusionStrategy.split_prompt_response(ids, lm[:, :4]), "split_prompt_response: loss_mask"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert corrupt_uniform(ids, lm.bool(), 11, eps=0.0)[0].shape == ids.shape  # a bool mask and eps 0 are fine


# ------------------------------------------------------------------ the uniform kernel's level, given or drawn


def _old_uniform_random(ids, loss, vocab, eps, seed, block_size=None):
    """`corrupt_uniform_random` as it was written before it could return its level (kept here verbatim, so
    the kernel's draws can be held to it bit for bit): t, then u, then r."""
    g = gen(seed)
    batch, length = ids.shape
    if block_size is None:
        t = (eps + (1 - eps) * torch.rand(batch, generator=g))[:, None].expand(batch, length)
    else:
        n_blocks = -(-length // block_size)
        t = eps + (1 - eps) * torch.rand(batch, n_blocks, generator=g)
        t = t.repeat_interleave(block_size, dim=1)[:, :length]
    u = torch.rand(batch, length, generator=g)
    r = torch.randint(0, vocab, (batch, length), generator=g, dtype=ids.dtype)
    noise = (u < t) & loss.bool()
    return torch.where(noise, r, ids), noise, torch.ones(batch, length), t


@pytest.mark.parametrize("block_size", [None, 8, 5])
def test_uniform_kernel_returns_the_level_it_drew_with_the_same_draws(batch, block_size):
    ids, loss = batch
    kw = {"eps": 0.01, "block_size": block_size}
    old_noisy, old_noise, old_p, old_t = _old_uniform_random(ids, loss, 100, 0.01, 21, block_size)
    noisy, noise, p = corrupt_uniform_random(ids, loss, 100, generator=gen(21), **kw)
    *same, level = corrupt_uniform_random(ids, loss, 100, generator=gen(21), return_level=True, **kw)
    for a, b, c in zip((noisy, noise, p), same, (old_noisy, old_noise, old_p)):
        assert torch.equal(a, b) and torch.equal(a, c)
    if block_size is None:
        assert level.shape == (4,) and torch.equal(level[:, None].expand(4, 32), old_t)
    else:
        assert level.shape == (4, -(-32 // block_size))
        assert torch.equal(level.repeat_interleave(block_size, dim=1)[:, :32], old_t)


def test_replace_at_level_is_the_uniform_counterpart_of_mask_at_level(batch):
    ids, loss = batch
    t = torch.tensor([0.0, 0.3, 0.7, 1.0])
    noisy, noise = replace_at_level(ids, loss, 100, t, gen(22))
    # the block-diffusion bound's inline draws before `replace_at_level` existed: u, then r
    g = gen(22)
    u = torch.rand(4, 32, generator=g)
    r = torch.randint(0, 100, (4, 32), generator=g, dtype=ids.dtype)
    old_noise = (u < t[:, None]) & loss.bool()
    assert torch.equal(noise, old_noise) and torch.equal(noisy, torch.where(old_noise, r, ids))
    assert not noise[0].any() and torch.equal(noise[3], loss[3].bool())  # t = 0: clean; t = 1: every supervised one
    # after the kernel's own level draw, the same draws: the kernel is its levels + `replace_at_level`
    g = gen(23)
    level = 0.01 + 0.99 * torch.rand(4, generator=g)
    at_level = replace_at_level(ids, loss, 100, level, g)
    drawn = corrupt_uniform_random(ids, loss, 100, eps=0.01, generator=gen(23))
    assert torch.equal(at_level[0], drawn[0]) and torch.equal(at_level[1], drawn[1])
    # one level for all rows, as a scalar or [1]
    assert torch.equal(
        replace_at_level(ids, loss, 100, 0.5, gen(24))[1],
        replace_at_level(ids, loss, 100, torch.tensor([0.5]), gen(24))[1],
    )
    with pytest.raises(ValueError, match=r"replace_at_level: t must be a probability in \[0, 1\], got 1.5"):
        replace_at_level(ids, loss, 100, 1.5)
    with pytest.raises(ValueError, match="replace_at_level: vocab_size must be an integer >= 1, got 0"):
        replace_at_level(ids, loss, 0, 0.5)
