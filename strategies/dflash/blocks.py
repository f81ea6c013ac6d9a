"""DFlash's anchor blocks (docs/strategies.md §6.2, §10): which target layers feed the draft, where the blocks
sit and what each predicts, the draft's copy hints, and the multi-block attention mask (dense and flex). The
losses are in `strategies.dflash.loss`, the draft model in `strategies.dflash.draft`, speculative decoding in
`strategies.dflash.decoding`.

Pure PyTorch: no Prefect, no MLflow. Fixes relative to the reference: the mask is always applied
(docs/reference-differences.md G1: no future context for any number of blocks), the non-overlapping
sampler never under-fills (docs/reference-differences.md G3), and anchors come only from the generators
passed in (docs/reference-differences.md G5: resume-reproducible).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask

from strategies.corruption import check_args
from strategies.dflash.config import default_layer_ids
from strategies.dflash.options import layer_count_problem
from strategies.drawing import LOOKUP_MAX_NGRAM


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose hidden states feed the draft: the middle one for a 1-layer draft, else
    evenly spaced from 1 to T − 3, `round(1 + i·(T − 4)/(D − 1))`."""
    check_args(
        "build_target_layer_ids",
        integers={"num_target_layers": (num_target_layers, 1), "num_draft_layers": (num_draft_layers, 1)},
    )
    problem = layer_count_problem(num_target_layers, num_draft_layers)
    if problem:
        raise ValueError(problem)
    return default_layer_ids(num_target_layers, num_draft_layers)


# ---------------------------------------------------------------------------------------- anchors


class AnchorBlocks(NamedTuple):
    anchors: Tensor  # [B, N] position of each block's anchor token
    keep: Tensor  # [B, N] bool: the block is trained on
    block_ids: Tensor  # [B, N·bs] anchor token then [MASK]s (all [MASK] for dropped blocks)
    targets: Tensor  # [B, N·(bs−1)] x[A + k], k = 1..bs−1
    block_mask: Tensor  # [B, N·(bs−1)] float: supervised ∧ inside the sequence ∧ kept


def _shared_starts(valid: Tensor, bsz: int, bs: int, n_blocks: int, gen) -> tuple[Tensor, int]:
    """Non-overlapping anchors: distinct block starts shared by the batch, `[B, N]`, and how many fit."""
    shortest = int(valid.min())
    n_valid = min(n_blocks, max(1, (shortest - 1) // bs))
    avail = shortest - n_valid * bs
    if avail < 1:
        starts = torch.arange(1, n_valid + 1)
    else:
        picks = torch.randperm(avail, generator=gen)[:n_valid]
        # docs/reference-differences.md G3: avail < n_valid leaves fewer distinct starts, never a broadcast error
        n_valid = len(picks)
        starts = picks.sort().values + torch.arange(n_valid) * bs + 1
    starts = torch.cat([starts, starts[-1:].repeat(n_blocks - n_valid)])
    return starts[None].repeat(bsz, 1), n_valid


def sample_anchor_blocks(
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor | None,
    *,
    block_size: int,
    num_blocks: int,
    mask_token_id: int,
    overlap: bool = True,
    generators: list[torch.Generator] | None = None,
    document_ids: Tensor | None = None,
) -> AnchorBlocks:
    """Spec §10.3. Overlapping (default): per row and block, A = clamp(1 + round(U·(maxA − 1)), 1, maxA)
    with U from that row's own generator. Non-overlapping: batch-shared distinct starts; when fewer
    than N fit, only those that fit are kept (fix docs/reference-differences.md G3). With `document_ids`
    (`[B, L]`, packed rows) a block predicts only tokens of its anchor's document: the next document's first
    tokens cannot be drafted from a context the document mask hides."""
    bsz, length = input_ids.shape
    bs, n_blocks = block_size, max(1, num_blocks)
    device = input_ids.device
    valid = attention_mask.long().sum(dim=1)
    effective = attention_mask.float() * (loss_mask.float() if loss_mask is not None else 1.0)
    supervised = effective.sum(dim=1)
    max_anchor = (valid - bs).clamp_min(1)
    if generators is not None and len(generators) != bsz:
        raise ValueError(f"sample_anchor_blocks: {len(generators)} generators for {bsz} rows")
    if overlap:
        u = torch.stack([torch.rand(n_blocks, generator=generators[i] if generators else None) for i in range(bsz)])
        u = u.to(device)
        anchors = (1 + torch.round(u * (max_anchor[:, None] - 1).float())).long()
        anchors = torch.minimum(anchors.clamp_min(1), max_anchor[:, None])
        n_valid = n_blocks
    else:
        anchors, n_valid = _shared_starts(valid, bsz, bs, n_blocks, generators[0] if generators else None)
        anchors = anchors.to(device)
    block_idx = torch.arange(n_blocks, device=device)[None]
    keep = (supervised[:, None] >= 2 * bs) & (valid[:, None] > bs) & (block_idx < n_valid)
    block_ids = torch.full((bsz, n_blocks, bs), mask_token_id, dtype=input_ids.dtype, device=device)
    anchor_tok = input_ids.gather(1, anchors)
    block_ids[:, :, 0] = torch.where(keep, anchor_tok, torch.full_like(anchor_tok, mask_token_id))
    offsets = torch.arange(1, bs, device=device)
    pos = anchors[:, :, None] + offsets  # [B, N, bs−1]
    clamped = pos.clamp_max(length - 1).reshape(bsz, -1)
    targets = input_ids.gather(1, clamped)
    inside = (pos < valid[:, None, None]).reshape(bsz, -1)
    block_mask = effective.gather(1, clamped) * inside * keep.repeat_interleave(bs - 1, dim=1)
    if document_ids is not None:
        anchor_doc = document_ids.gather(1, anchors).repeat_interleave(bs - 1, dim=1)
        block_mask = block_mask * (document_ids.gather(1, clamped) == anchor_doc)
    return AnchorBlocks(anchors, keep, block_ids.reshape(bsz, -1), targets, block_mask.float())


class CopyHints(NamedTuple):
    """The draft's copy hint per block position (docs/strategies.md §10.9)."""

    ids: Tensor  # [B, N·bs] the token the context lookup proposes there (`pad_id` where none)
    lengths: Tensor  # [B, N·bs] the length of the suffix that matched (0: no hint; always 0 at the anchor)


def copy_hints(
    input_ids: Tensor, anchors: Tensor, block_size: int, pad_id: int, document_ids: Tensor | None = None
) -> CopyHints:
    """For each anchor A, what the context lookup (`strategies.dflash.decoding.context_lookup` with n = 1) proposes
    from the history x[..A]: find the longest suffix of x[..A] (at most `LOOKUP_MAX_NGRAM` tokens) that also ends
    at an earlier position e < A, taking the latest e on ties, and hint x[e + j] at block offset j = 1..bs−1
    while e + j ≤ A. Vectorized over rows and anchors ([B, N, L] comparisons); with `document_ids` only the
    anchor's document is searched, as its context is."""
    bsz, length = input_ids.shape
    device = input_ids.device
    end = torch.arange(length, device=device)  # candidate end positions e
    a = anchors[:, :, None]  # [B, N, 1]
    alive = (end[None, None] < a).expand(bsz, -1, -1)  # [B, N, L]
    run = torch.zeros(alive.shape, dtype=torch.long, device=device)
    for i in range(LOOKUP_MAX_NGRAM):  # compare x[e − i] with x[A − i]; the run of matches is the suffix length
        e_i, a_i = (end - i).clamp_min(0), (anchors - i).clamp_min(0)
        x_e = input_ids[:, e_i][:, None, :]  # [B, 1, L]
        x_a = input_ids.gather(1, a_i)[:, :, None]  # [B, N, 1]
        alive = alive & (end >= i)[None, None] & (x_e == x_a)
        if document_ids is not None:
            doc_a = document_ids.gather(1, anchors)[:, :, None]
            alive = alive & (document_ids[:, e_i][:, None, :] == doc_a)
            alive = alive & (document_ids.gather(1, a_i)[:, :, None] == doc_a)
        run = run + alive
    best = (run * length + end).argmax(dim=-1)  # the longest suffix, then the latest end
    matched = run.gather(2, best[:, :, None])[:, :, 0]  # [B, N]; 0: nothing recurs
    offsets = torch.arange(block_size, device=device)
    follow = best[:, :, None] + offsets  # [B, N, bs]
    has = (matched[:, :, None] > 0) & (offsets > 0) & (follow <= a)
    ids = torch.where(has, input_ids.gather(1, follow.clamp_max(length - 1).reshape(bsz, -1)).view_as(follow), pad_id)
    return CopyHints(ids.reshape(bsz, -1), (matched[:, :, None] * has).reshape(bsz, -1))


def block_position_ids(anchors: Tensor, ctx_len: int, block_size: int) -> Tensor:
    """[0..S−1 | A_0 + 0..bs−1 | … | A_{N−1} + 0..bs−1] per row: RoPE sees each block at its true place."""
    bsz = anchors.shape[0]
    ctx = torch.arange(ctx_len, device=anchors.device)[None].expand(bsz, -1)
    blocks = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).reshape(bsz, -1)
    return torch.cat([ctx, blocks], dim=1)


# ---------------------------------------------------------------------------------------- masks


def dflash_visibility(
    anchor_positions: Tensor,
    block_keep_mask: Tensor,
    ctx_len: int,
    block_size: int,
    causal: bool = False,
    document_ids: Tensor | None = None,
    sliding_window: int | None = None,
) -> Tensor:
    """Bool [B, N·bs, S + N·bs]: query q (block b = q // bs, offset o) sees context key k < min(A_b, S)
    when block b is kept — with `document_ids` (`[B, S]`, packed rows) only keys of A_b's document, with
    `sliding_window` W only keys with A_b + o − k < W (docs/strategies.md §10.12) — and the noise keys of its own
    block (with `causal`, those at offsets ≤ o)."""
    bsz, n_blocks = anchor_positions.shape
    q_len, device = n_blocks * block_size, anchor_positions.device
    q = torch.arange(q_len, device=device)
    qb, qo = q // block_size, q % block_size
    k = torch.arange(ctx_len + q_len, device=device)
    anchor = anchor_positions[:, qb]  # [B, Q]
    keep = block_keep_mask.bool()[:, qb]
    ctx = (k[None, None, :] < ctx_len) & (k[None, None, :] < anchor[:, :, None]) & keep[:, :, None]
    if sliding_window is not None:  # the query's own position A_b + o, as z-lab's and Automodel's drafts measure it
        ctx = ctx & ((anchor + qo)[:, :, None] - k[None, None, :] < sliding_window)
    if document_ids is not None:
        docs = document_ids[:, k.clamp_max(ctx_len - 1)]  # [B, S + Q]; only the first S columns matter
        ctx = ctx & (docs[:, None, :] == document_ids.gather(1, anchor)[:, :, None])
    kn = k - ctx_len
    noise = (k >= ctx_len)[None, :] & ((kn // block_size)[None, :] == qb[:, None])
    if causal:
        noise = noise & ((kn % block_size)[None, :] <= qo[:, None])
    return ctx | noise[None]


def create_dflash_sdpa_mask(
    anchor_positions: Tensor,
    block_keep_mask: Tensor,
    ctx_len: int,
    block_size: int,
    device=None,
    dtype: torch.dtype = torch.float32,
    causal: bool = False,
    document_ids: Tensor | None = None,
    sliding_window: int | None = None,
) -> Tensor:
    """Additive DFlash mask [B, 1, N·bs, S + N·bs]: 0 where visible, −inf elsewhere (docs/strategies.md §6.2)."""
    anchors = anchor_positions.to(device) if device is not None else anchor_positions
    docs = None if document_ids is None else document_ids.to(anchors.device)
    keep = block_keep_mask.to(anchors.device)
    visible = dflash_visibility(anchors, keep, ctx_len, block_size, causal, docs, sliding_window)
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, -math.inf)[:, None]


def build_dflash_mask_mod(
    anchor_positions: Tensor,
    block_keep_mask: Tensor,
    ctx_len: int,
    block_size: int,
    causal: bool = False,
    document_ids: Tensor | None = None,
    sliding_window: int | None = None,
):
    """The same predicate as a flex-attention `mask_mod(b, h, q_idx, kv_idx)`."""
    n_blocks = anchor_positions.shape[1]
    keep = block_keep_mask.bool()

    def mask_mod(b, h, q_idx, kv_idx):
        qb = torch.clamp(q_idx // block_size, max=n_blocks - 1)
        anchor = anchor_positions[b, qb]
        ctx = (kv_idx < ctx_len) & (kv_idx < anchor) & keep[b, qb]
        if sliding_window is not None:
            ctx = ctx & (anchor + q_idx % block_size - kv_idx < sliding_window)
        if document_ids is not None:
            ctx = ctx & (document_ids[b, torch.clamp(kv_idx, max=ctx_len - 1)] == document_ids[b, anchor])
        kn = kv_idx - ctx_len
        noise = (kv_idx >= ctx_len) & (kn // block_size == qb)
        if causal:
            noise = noise & (kn % block_size <= q_idx % block_size)
        return (ctx | noise) & (q_idx // block_size < n_blocks)

    return mask_mod


def create_dflash_block_mask(
    anchor_positions: Tensor,
    block_keep_mask: Tensor,
    ctx_len: int,
    block_size: int,
    causal: bool = False,
    document_ids: Tensor | None = None,
    sliding_window: int | None = None,
):
    """Flex-attention `BlockMask` for the DFlash layout (Q = N·bs, KV = S + N·bs, default 128 tiles); with a
    `sliding_window` the tiles left of every window are skipped."""
    bsz, n_blocks = anchor_positions.shape
    mod = build_dflash_mask_mod(
        anchor_positions, block_keep_mask, ctx_len, block_size, causal, document_ids, sliding_window
    )
    return create_block_mask(
        mod, bsz, None, n_blocks * block_size, ctx_len + n_blocks * block_size, device=anchor_positions.device
    )
