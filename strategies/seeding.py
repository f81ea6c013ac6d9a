"""Topology-independent per-sample noise seeds (docs/strategies.md §3).

A sample's corruption noise is a pure function of (base seed, optimizer step, global sample
index), so it is identical across resume, across 1 vs N data-parallel ranks and across any
micro-batch split of the same global batch. The global RNG is never touched.
"""

from __future__ import annotations

import torch

_SEED_OFFSET = 2**43
_SEED_STRIDE = 2654435761
_SEED_MOD = 2**63


def global_sample_index(
    step: int, dp_rank: int, dp_size: int, local_batch_size: int, grad_acc_steps: int, microbatch_idx: int, offset: int
) -> int:
    """Position of a row in the step's shuffled global batch (the strided sampler's layout)."""
    gbs = local_batch_size * dp_size * grad_acc_steps
    return step * gbs + dp_rank + (microbatch_idx * local_batch_size + offset) * dp_size


def corruption_sample_seed(
    base_seed: int,
    step: int,
    dp_rank: int,
    dp_size: int,
    local_batch_size: int,
    grad_acc_steps: int,
    microbatch_idx: int,
    offset: int,
) -> int:
    """seed = (base + 2^43 + 2654435761 · gidx) mod 2^63."""
    gidx = global_sample_index(step, dp_rank, dp_size, local_batch_size, grad_acc_steps, microbatch_idx, offset)
    return (base_seed + _SEED_OFFSET + _SEED_STRIDE * gidx) % _SEED_MOD


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen
