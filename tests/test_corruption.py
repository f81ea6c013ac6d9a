"""corrupt_uniform (spec §4.2) and the per-sample seeding of spec §3."""

import pytest
import torch

from strategies import corrupt_uniform, corruption_sample_seed
from strategies.seeding import global_sample_index, seeded_generator

MASK = 999


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (4, 32), generator=g)
    loss = torch.zeros(4, 32)
    loss[:, :24] = 1
    return ids, loss


def test_corrupt_uniform_contract(batch):
    ids, loss = batch
    noisy, noise, p = corrupt_uniform(ids, loss, MASK, eps=0.01, generator=seeded_generator(1))
    assert noisy.shape == ids.shape and noise.dtype == torch.bool and p.dtype == torch.float32
    assert not (noise & ~loss.bool()).any()  # noise ⊆ supervised
    assert (noisy[noise] == MASK).all() and torch.equal(noisy[~noise], ids[~noise])
    assert (p >= 0.01).all() and (p <= 1).all()
    assert torch.equal(p, p[:, :1].expand_as(p))  # one level per row


def test_corrupt_uniform_level_formula_and_draw_order(batch):
    ids, loss = batch
    eps = 0.05
    _, noise, p = corrupt_uniform(ids, loss, MASK, eps=eps, generator=seeded_generator(7))
    g = seeded_generator(7)
    t = torch.rand(4, generator=g)
    u = torch.rand(4, 32, generator=g)
    assert torch.allclose(p[:, 0], (1 - eps) * t + eps)
    assert torch.equal(noise, (u < p[:, :1]) & loss.bool())


def test_same_seed_same_output_and_global_rng_untouched(batch):
    ids, loss = batch
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = corrupt_uniform(ids, loss, MASK, generator=seeded_generator(5))
    b = corrupt_uniform(ids, loss, MASK, generator=seeded_generator(5))
    c = corrupt_uniform(ids, loss, MASK, generator=seeded_generator(6))
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], c[1])


TOPOLOGIES = [(8, 1), (32, 1), (8, 4), (4, 8), (2, 16), (16, 2), (1, 32)]


@pytest.mark.parametrize("step", [0, 1, 7, 100])
@pytest.mark.parametrize("dp,lbs", TOPOLOGIES)
def test_seeds_depend_only_on_step_and_global_position(step, dp, lbs):
    gbs = 32
    grad_acc = gbs // (dp * lbs)
    seeds = {}
    for rank in range(dp):
        for mb in range(grad_acc):
            for off in range(lbs):
                gidx = global_sample_index(step, rank, dp, lbs, grad_acc, mb, off)
                seeds[gidx] = corruption_sample_seed(42, step, rank, dp, lbs, grad_acc, mb, off)
    assert sorted(seeds) == list(range(step * gbs, (step + 1) * gbs))  # each position exactly once
    reference = {step * gbs + i: corruption_sample_seed(42, step, 0, 1, 1, gbs, i, 0) for i in range(gbs)}
    assert seeds == reference
    assert len(set(seeds.values())) == gbs and all(0 <= s < 2**63 for s in seeds.values())


def test_seed_formula_by_hand():
    gidx = 3 * 32 + 5
    assert corruption_sample_seed(42, 3, 0, 1, 32, 1, 0, 5) == (42 + 2**43 + 2654435761 * gidx) % 2**63
