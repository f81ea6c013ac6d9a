"""DFlash's variable-prefix objective (`dflash.loss_type: variable_prefix`, docs/strategies.md §5.7, §10.3): each
block also shows the draft the first `p` tokens after its anchor, drawn from a truncated geometric prior, and only
the masked suffix is supervised, its decay restarting at the prefix boundary.

This is the VP-Drafter objective of D2SD (Zhang et al. 2026, "D²SD: Accelerating Speculative Decoding with Dual
Diffusion Draft Models", arXiv 2606.04446), as NVIDIA NeMo Automodel trains it
(`nemo_automodel/components/speculative/dflash/core.py`: `_sample_prefix_lengths`, `_create_vp_noise_embed`,
`_variable_prefix_loss`). Automodel counts its prefix length `l` with the anchor (`l = p + 1`); dllm-flow counts
the tokens revealed after the anchor, so that `p = 0` is the plain DFlash block. Pure PyTorch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from strategies.dflash.blocks import AnchorBlocks
from strategies.seeding import seeded_generator

# the prefix draws of a row come from a stream of their own, seeded from the row's seed (docs/strategies.md §3), so
# they neither move the anchors (drawn from the row's generator) nor depend on how many draws the anchors took
_PREFIX_STREAM = 0x2545F4914F6CDD1D


def prefix_support(block_size: int) -> tuple[int, int]:
    """The prefix lengths `p` the prior draws, `p_min … p_max` = `min(1, bs − 2) … bs − 2`: at least one token
    after the anchor is shown (the plain anchor-only block, `p = 0`, is DFlash's own objective) and at least one
    is left to predict. Automodel's `l ∈ [min(2, bs − 1), bs − 1]` with `l = p + 1`."""
    return min(1, block_size - 2), block_size - 2


def prefix_prior(block_size: int, base: float) -> Tensor:
    """`Pr(p) ∝ base^p` on `prefix_support(block_size)`, float64, index `i` ↔ `p = p_min + i` (computed in
    log space, so a base above 1 cannot overflow)."""
    low, high = prefix_support(block_size)
    p = torch.arange(low, high + 1, dtype=torch.float64)
    return torch.softmax(p * torch.log(torch.tensor(float(base), dtype=torch.float64)), dim=0)


def prefix_generator(row_seed: int) -> torch.Generator:
    """The generator of a row's prefix draws: a function of the row's seed (base seed, step, global row) alone."""
    return seeded_generator(int(row_seed) ^ _PREFIX_STREAM, "cpu")


def draw_prefix_lengths(generators: list[torch.Generator], num_blocks: int, block_size: int, base: float) -> Tensor:
    """`[B, N]` prefix lengths, row `b` from `generators[b]`: `N` uniforms through the inverse CDF of
    `prefix_prior`."""
    low, _ = prefix_support(block_size)
    cdf = prefix_prior(block_size, base).cumsum(0)
    u = torch.stack([torch.rand(num_blocks, generator=g, dtype=torch.float64) for g in generators])
    return low + torch.searchsorted(cdf, u, right=True).clamp_max(len(cdf) - 1)


def reveal_prefix(
    blocks: AnchorBlocks,
    prefix: Tensor,
    attention_mask: Tensor,
    block_size: int,
    document_ids: Tensor | None = None,
) -> AnchorBlocks:
    """The blocks with the first `p` tokens after each anchor shown and no longer predicted: block input
    `[x_A, x_{A+1}, …, x_{A+p}, M, …, M]` (a kept block; a token past the row's end or, on packed rows, outside
    the anchor's document stays `M`), block mask zero at offsets `k ≤ p`."""
    bsz, n = prefix.shape
    offsets = torch.arange(1, block_size, device=prefix.device)  # k = 1 … bs − 1
    shown = offsets <= prefix.to(offsets.device)[:, :, None]  # [B, N, bs − 1]
    pos = blocks.anchors[:, :, None] + offsets
    real = (pos < attention_mask.long().sum(dim=1)[:, None, None]) & blocks.keep[:, :, None]
    if document_ids is not None:
        anchor_doc = document_ids.gather(1, blocks.anchors)[:, :, None]
        real = real & (
            document_ids.gather(1, pos.clamp_max(document_ids.shape[1] - 1).flatten(1)).view_as(pos) == anchor_doc
        )
    ids = blocks.block_ids.view(bsz, n, block_size).clone()
    tokens = blocks.targets.view(bsz, n, block_size - 1)  # x_{A+k}
    ids[:, :, 1:] = torch.where(shown & real, tokens, ids[:, :, 1:])
    mask = blocks.block_mask * (~shown).reshape(bsz, -1)
    return blocks._replace(block_ids=ids.view(bsz, -1), block_mask=mask)


def prefix_decay_weights(prefix: Tensor, block_size: int, gamma: float | None) -> Tensor:
    """`[B, N·(bs − 1)]` weights of the predictions `k = 1 … bs − 1` of blocks with prefix lengths `prefix`
    (`[B, N]`): `w_k = exp(−(k − 1 − p)/γ)` for `k > p` (the decay restarts at the first masked position), 0 for
    `k ≤ p`; γ None: 1 for `k > p`. `p = 0` is the plain decay `exp(−(k − 1)/γ)`."""
    offsets = torch.arange(block_size - 1, device=prefix.device, dtype=torch.float32)  # k − 1
    shift = offsets - prefix[:, :, None].float()  # k − 1 − p
    after = shift >= 0
    w = after.float() if gamma is None else torch.exp(-shift.clamp_min(0) / gamma) * after
    return w.reshape(prefix.shape[0], -1)
