"""Attention masks of the block-structured strategies (docs/strategies.md §6.1, §6.3): dense and flex forms.

Each mask is defined once as an element-wise predicate over index tensors; the dense builders
evaluate it on a broadcast grid and the flex builders hand the same predicate to
`create_block_mask`, so the two forms cannot drift apart.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask

# ------------------------------------------------------------------ I-DLM over [x_t ‖ x_0]


def idlm_predicate(q: Tensor, k: Tensor, seq_len: int, block_size: int, key_valid: Tensor) -> Tensor:
    """May query q attend key k? Indices in [0, 2L): < L noisy copy, ≥ L clean copy.

    M_BD (noisy→noisy, same block, q ≥ k) ∪ M_OBC (noisy→clean, strictly earlier block)
    ∪ M_BC (clean→clean, q ≥ k); padding keys (valid = 0) are hidden in both copies.
    `key_valid(k)` is the validity of k's copy-local position.
    """
    q_noisy, k_noisy = q < seq_len, k < seq_len
    q_pos, k_pos = torch.where(q_noisy, q, q - seq_len), torch.where(k_noisy, k, k - seq_len)
    q_blk, k_blk = q_pos // block_size, k_pos // block_size
    block_diag = q_noisy & k_noisy & (q_blk == k_blk) & (q >= k)
    offset_block_causal = q_noisy & ~k_noisy & (q_blk > k_blk)
    clean_causal = ~q_noisy & ~k_noisy & (q >= k)
    return (block_diag | offset_block_causal | clean_causal) & key_valid


def _additive(keep: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


def create_idlm_sdpa_mask(
    seq_len: int,
    block_size: int,
    valid_mask: Tensor | None,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
    batch_size: int | None = None,
) -> Tensor:
    """Dense additive I-DLM mask [B, 1, 2L, 2L] with 0 (attend) / −inf (hidden)."""
    if valid_mask is None:
        valid_mask = torch.ones(batch_size or 1, seq_len, dtype=torch.bool, device=device)
    valid = valid_mask.to(device=device).bool()
    idx = torch.arange(2 * seq_len, device=valid.device)
    key_valid = valid.repeat(1, 2)[:, None, None, :]  # [B,1,1,2L]: copy-local validity
    keep = idlm_predicate(idx[:, None], idx[None, :], seq_len, block_size, key_valid)
    return _additive(keep, dtype)


def create_idlm_block_mask(
    seq_len: int,
    block_size: int,
    valid_mask: Tensor | None,
    *,
    device=None,
    batch_size: int | None = None,
    use_compile: bool = True,
):
    """The same predicate as a flex-attention `BlockMask` (B = batch, H = None, Q = KV = 2L)."""
    if valid_mask is None:
        valid_mask = torch.ones(batch_size or 1, seq_len, dtype=torch.bool, device=device)
    valid = valid_mask.to(device=device).bool()

    def mask_mod(b, h, q, k):
        k_pos = torch.where(k < seq_len, k, k - seq_len)
        return idlm_predicate(q, k, seq_len, block_size, valid[b, k_pos])

    builder = _compiled_block_mask_builder() if use_compile else _block_mask_builder()
    return builder(mask_mod, valid.shape[0], None, 2 * seq_len, 2 * seq_len, device=valid.device)


def _block_mask_builder():
    return create_block_mask


@functools.lru_cache(maxsize=1)
def _compiled_block_mask_builder():
    return torch.compile(_block_mask_builder(), dynamic=True)


# ------------------------------------------------------------------ block diffusion (DiffusionGemma)


def _prefix_tensor(prefix_lengths, batch_size: int | None, device) -> Tensor:
    if isinstance(prefix_lengths, int):
        if batch_size is None:
            raise ValueError("an int prefix_lengths needs batch_size")
        prefix = torch.full((batch_size,), prefix_lengths, dtype=torch.long, device=device)
    else:
        prefix = torch.as_tensor(prefix_lengths, device=device).long()
        if prefix.dim() != 1:
            raise ValueError(f"prefix_lengths must be 1-D [B], got shape {tuple(prefix.shape)}")
        if batch_size is not None and prefix.shape[0] != batch_size:
            raise ValueError(f"prefix_lengths has {prefix.shape[0]} entries but batch_size is {batch_size}")
    if (prefix < 0).any():
        raise ValueError(f"prefix_lengths must be >= 0, got {prefix.tolist()}")
    return prefix


def build_block_diffusion_training_mask(
    prefix_lengths,
    response_length: int,
    enc_len: int,
    block_size: int,
    *,
    sliding_window: int | None = None,
    batch_size: int | None = None,
    device="cpu",
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Block-causal canvas mask (docs/strategies.md §6.3) → (full, sliding), each [B, 1, R, S + R].

    Query j is canvas position j in block q = j // bs. Encoder column e (clean KV): rel = e − P,
    β_e = rel // bs (−1 for the prompt); visible iff q > β_e *strictly* and rel < R, so the clean copy
    of the query's own block stays hidden. Canvas column c: visible iff c // bs == q. Sliding layers
    also need e ≥ P + q·bs − W + 1 (anchored at the block start). dtype None → bool keep masks,
    else additive 0 / finfo(dtype).min.
    """
    prefix = _prefix_tensor(prefix_lengths, batch_size, device)
    if int((prefix + response_length).max()) > enc_len:
        raise ValueError(
            f"enc_len ({enc_len}) too small: need prefix + response_length <= enc_len "
            f"(max prefix {int(prefix.max())}, response_length {response_length})"
        )
    j = torch.arange(response_length, device=device)[None, :, None]  # [1,R,1]
    q_blk = j // block_size
    e = torch.arange(enc_len, device=device)[None, None, :]  # [1,1,S]
    rel = e - prefix[:, None, None]  # [B,1,S]
    enc_blk = torch.where(rel >= 0, rel // block_size, torch.full_like(rel, -1))
    enc_keep = (q_blk > enc_blk) & (rel < response_length)  # [B,R,S]
    c = torch.arange(response_length, device=device)[None, None, :]
    canvas_keep = (c // block_size == q_blk).expand(prefix.shape[0], -1, -1)
    full = torch.cat([enc_keep, canvas_keep], dim=-1)[:, None]
    if sliding_window is None:
        sliding = full.clone()
    else:
        lower = prefix[:, None, None] + q_blk * block_size - sliding_window + 1
        sliding = torch.cat([enc_keep & (e >= lower), canvas_keep], dim=-1)[:, None]
    if dtype is None:
        return full, sliding
    low = torch.finfo(dtype).min
    to_add = lambda keep: torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, low)  # noqa: E731
    return to_add(full), to_add(sliding)
