"""The masks of a draft with sliding-window layers, and the context a windowed decoder keeps (docs/strategies.md
§10.12). The layer types and the window are the draft config's (`strategies.dflash.window_config`); the predicate is
`strategies.dflash.blocks.dflash_visibility`'s: the query at sequence position A + o (anchor A, offset o) of a
`sliding_attention` layer sees the context keys k < A with A + o − k < window, as z-lab's `dflash` package and NeMo
Automodel's DFlash draft apply it at decoding time, and its whole block (the window is at least the block).
"""

from __future__ import annotations

import torch
from torch import Tensor

from strategies.dflash.blocks import create_dflash_block_mask, create_dflash_sdpa_mask
from strategies.dflash.window_config import FULL, SLIDING


def draft_masks(
    cfg,
    anchors: Tensor,
    keep: Tensor,
    ctx_len: int,
    block_size: int,
    dtype: torch.dtype,
    document_ids: Tensor | None = None,
    backend: str = "sdpa",
):
    """The DFlash mask every layer of the draft `cfg` reads (causal inside the block for a JetSpec draft): one mask
    when all its layers are of one type (the window applied when they are sliding), else {layer type: mask}, which
    each layer picks from (`layer_mask`). Dense additive masks, or flex-attention BlockMasks
    (`backend="flex_attention"`)."""
    causal = cfg.causal  # JetSpec: offset o sees offsets ≤ o of its block (§10.14)

    def build(window: int | None):
        if backend == "flex_attention":
            return create_dflash_block_mask(
                anchors, keep, ctx_len, block_size, causal, document_ids=document_ids, sliding_window=window
            )
        return create_dflash_sdpa_mask(
            anchors,
            keep,
            ctx_len,
            block_size,
            dtype=dtype,
            causal=causal,
            document_ids=document_ids,
            sliding_window=window,
        )

    kinds = set(cfg.layer_types)
    if kinds == {FULL}:
        return build(None)
    if kinds == {SLIDING}:
        return build(cfg.sliding_window)
    return {FULL: build(None), SLIDING: build(cfg.sliding_window)}


def layer_mask(mask, layer_type: str):
    """The mask of a layer of type `layer_type` among `draft_masks`'s (a single mask serves every layer)."""
    return mask[layer_type] if isinstance(mask, dict) else mask


def trims(cfg) -> bool:
    """Whether every layer of the draft `cfg` slides, so the decoder drops the context none of them can read."""
    return set(cfg.layer_types) == {SLIDING}


def trim_context(cfg, ctx: Tensor, start: int, committed: int) -> tuple[Tensor, int]:
    """The decoder's context features [B, S, n·H] (the first at position `start`) without those no layer of the draft
    `cfg` can read any more: when every layer slides, the next block (anchor at `committed`) reads positions from
    committed − window + 1 on, so the features before it are dropped and the draft's cost per cycle stops growing
    with the sequence. Returns the features kept and the position of the first."""
    if not trims(cfg):
        return ctx, start
    first = max(start, committed - cfg.sliding_window + 1)
    return ctx[:, first - start :], first
