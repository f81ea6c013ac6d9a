"""The topology-independent per-sample seeding of strategies/seeding.py (docs/strategies.md §3)."""

import pytest

from strategies.seeding import corruption_sample_seed, global_sample_index

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
