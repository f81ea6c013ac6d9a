"""DFlash building blocks (docs/strategies.md §5.7, §6.2, §10): target layer selection, anchor-block sampling,
the multi-block attention mask (dense and flex), the decay-weighted and D-PACE losses, the draft model and
speculative decoding against a frozen causal target.

Pure PyTorch: no Prefect, no MLflow. Fixes relative to the reference: the mask is always applied
(docs/reference-differences.md G1: no future context for any number of blocks), the non-overlapping
sampler never under-fills (docs/reference-differences.md G3), and anchors come only from the generators
passed in (docs/reference-differences.md G5: resume-reproducible).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils.checkpoint import checkpoint

from strategies.corruption import check_args
from strategies.losses import DLLMLossOutput

LOOKUP_MAX_NGRAM = 4  # the longest suffix speculative decoding's context lookup matches (`lookup_ngram` ≤ it)
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFlash paper App. A.1 decay γ by block size


def default_gamma(block_size: int) -> float:
    return PAPER_GAMMA.get(block_size, max(2.0, block_size / 2))


def _build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose hidden states feed the draft: the middle one for a 1-layer draft, else
    evenly spaced from 1 to T − 3, `round(1 + i·(T − 4)/(D − 1))`."""
    check_args(
        "_build_target_layer_ids",
        integers={"num_target_layers": (num_target_layers, 1), "num_draft_layers": (num_draft_layers, 1)},
    )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4 or num_draft_layers > num_target_layers - 3:
        raise ValueError(
            f"a {num_draft_layers}-layer draft reads {num_draft_layers} distinct target layers among 1 … T − 3, so it "
            f"needs a target with at least {max(4, num_draft_layers + 3)} layers (got {num_target_layers}); use fewer "
            "draft layers, a deeper target, or dflash.target_layer_ids"
        )
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# ---------------------------------------------------------------------------------------- anchors


class AnchorBlocks(NamedTuple):
    anchors: Tensor  # [B, N] position of each block's anchor token
    keep: Tensor  # [B, N] bool: the block is trained on
    block_ids: Tensor  # [B, N·bs] anchor token then [MASK]s (all [MASK] for dropped blocks)
    targets: Tensor  # [B, N·(bs−1)] x[A + k], k = 1..bs−1
    block_mask: Tensor  # [B, N·(bs−1)] float: supervised ∧ inside the sequence ∧ kept


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
        gen = generators[0] if generators else None
        shortest = int(valid.min())
        n_valid = min(n_blocks, max(1, (shortest - 1) // bs))
        avail = shortest - n_valid * bs
        if avail < 1:
            starts = torch.arange(1, n_valid + 1)
        else:
            picks = torch.randperm(avail, generator=gen)[:n_valid]
            n_valid = len(
                picks
            )  # docs/reference-differences.md G3: avail < n_valid leaves fewer distinct starts, never a broadcast error
            starts = picks.sort().values + torch.arange(n_valid) * bs + 1
        starts = torch.cat([starts, starts[-1:].repeat(n_blocks - n_valid)])
        anchors = starts[None].repeat(bsz, 1).to(device)
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
    """For each anchor A, what the context lookup (`strategies.dflash_draft.context_lookup` with n = 1) proposes
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
) -> Tensor:
    """Bool [B, N·bs, S + N·bs]: query q (block b = q // bs, offset o) sees context key k < min(A_b, S)
    when block b is kept — with `document_ids` (`[B, S]`, packed rows) only keys of A_b's document — and the
    noise keys of its own block (with `causal`, those at offsets ≤ o)."""
    bsz, n_blocks = anchor_positions.shape
    q_len, device = n_blocks * block_size, anchor_positions.device
    q = torch.arange(q_len, device=device)
    qb, qo = q // block_size, q % block_size
    k = torch.arange(ctx_len + q_len, device=device)
    anchor = anchor_positions[:, qb]  # [B, Q]
    keep = block_keep_mask.bool()[:, qb]
    ctx = (k[None, None, :] < ctx_len) & (k[None, None, :] < anchor[:, :, None]) & keep[:, :, None]
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
) -> Tensor:
    """Additive DFlash mask [B, 1, N·bs, S + N·bs]: 0 where visible, −inf elsewhere (docs/strategies.md §6.2)."""
    anchors = anchor_positions.to(device) if device is not None else anchor_positions
    docs = None if document_ids is None else document_ids.to(anchors.device)
    visible = dflash_visibility(anchors, block_keep_mask.to(anchors.device), ctx_len, block_size, causal, docs)
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, -math.inf)[:, None]


def build_dflash_mask_mod(
    anchor_positions: Tensor,
    block_keep_mask: Tensor,
    ctx_len: int,
    block_size: int,
    causal: bool = False,
    document_ids: Tensor | None = None,
):
    """The same predicate as a flex-attention `mask_mod(b, h, q_idx, kv_idx)`."""
    n_blocks = anchor_positions.shape[1]
    keep = block_keep_mask.bool()

    def mask_mod(b, h, q_idx, kv_idx):
        qb = torch.clamp(q_idx // block_size, max=n_blocks - 1)
        anchor = anchor_positions[b, qb]
        ctx = (kv_idx < ctx_len) & (kv_idx < anchor) & keep[b, qb]
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
):
    """Flex-attention `BlockMask` for the DFlash layout (Q = N·bs, KV = S + N·bs, default 128 tiles)."""
    bsz, n_blocks = anchor_positions.shape
    mod = build_dflash_mask_mod(anchor_positions, block_keep_mask, ctx_len, block_size, causal, document_ids)
    return create_block_mask(
        mod, bsz, None, n_blocks * block_size, ctx_len + n_blocks * block_size, device=anchor_positions.device
    )


# ---------------------------------------------------------------------------------------- loss


class DFlashDecayLoss(nn.Module):
    """Σ w_k · block_mask · CE(logits, target) with w_k = exp(−(k−1)/γ) (k = 1 right after the anchor).

    `normalize="tokens"`: ÷ max(num_tokens, 1) when given, else unnormalized; `"mean"`: ÷ (Σ W + 1e-6).
    Returns `DLLMLossOutput` with per-offset correct/count sums when the block layout is known.
    Subclasses change only the position weights (`position_weights`; D-PACE: `DFlashDPACELoss`).
    """

    def __init__(
        self,
        loss_gamma: float | None = 7.0,
        use_fused_linear_ce: bool = False,
        chunk_size: int = 1024,
        normalize: str = "tokens",
    ):
        super().__init__()
        if normalize not in ("tokens", "mean"):
            raise ValueError(f"normalize must be 'tokens' or 'mean', got {normalize!r}")
        self.loss_gamma, self.use_fused_linear_ce = loss_gamma, use_fused_linear_ce
        self.chunk_size, self.normalize = chunk_size, normalize

    def weights(self, length: int, block_size: int | None, device) -> Tensor:
        if self.loss_gamma is None:
            return torch.ones(length, device=device)
        per = (block_size - 1) if block_size else length
        w = torch.exp(-torch.arange(per, device=device, dtype=torch.float32) / self.loss_gamma)
        return w.repeat(math.ceil(length / per))[:length]

    def position_weights(self, nll: Tensor, block_mask: Tensor, block_size: int | None) -> Tensor:
        """Weight of every predicted position, `[1 or B, T]`, before the block mask: the fixed decay."""
        return self.weights(nll.shape[1], block_size, nll.device)[None]

    def _reduce(
        self, nll: Tensor, correct: Tensor, block_mask: Tensor, num_tokens, block_size, ce: Tensor | None = None
    ) -> DLLMLossOutput:
        """`nll`: −log q(true token) per prediction (it sets D-PACE's weights); `ce`: the term summed (the soft-label
        cross-entropy when the target's distribution is the label, else `nll` itself)."""
        w = self.position_weights(nll, block_mask, block_size) * block_mask.float()
        total = ((nll if ce is None else ce).float() * w).sum()
        if self.normalize == "mean":
            total = total / (w.sum() + 1e-6)
        elif num_tokens is not None:
            total = total / max(int(num_tokens), 1)
        per_correct = per_count = None
        if block_size and block_size > 1 and nll.shape[1] % (block_size - 1) == 0:
            shape = (nll.shape[0], -1, block_size - 1)
            m = block_mask.float().reshape(shape)
            per_correct = (correct.float().reshape(shape) * m).sum(dim=(0, 1))
            per_count = m.sum(dim=(0, 1))
        return DLLMLossOutput(total, total.detach(), per_correct, per_count)

    def forward(
        self,
        logits: Tensor,
        target_ids: Tensor,
        block_mask: Tensor,
        num_tokens=None,
        block_size: int | None = None,
        soft: SoftLabels | None = None,
    ) -> DLLMLossOutput:
        nll, ce, correct = _token_losses(logits, target_ids, soft)
        return self._reduce(nll, correct, block_mask, num_tokens, block_size, ce)

    def forward_fused(
        self,
        hidden: Tensor,
        lm_head_weight: Tensor,
        target_ids: Tensor,
        block_mask: Tensor,
        num_tokens=None,
        block_size: int | None = None,
        lm_head_bias: Tensor | None = None,
        soft: SoftLabels | None = None,
    ) -> DLLMLossOutput:
        """Chunks of `chunk_size` rows through linear + CE under activation checkpointing: the
        [B·T, V] logits never stay alive for backward."""
        flat, tgt = hidden.flatten(0, 1), target_ids.flatten()
        flat_soft = None if soft is None else SoftLabels(soft.ids.flatten(0, 1), soft.probs.flatten(0, 1))

        def chunk(h, t, *labels):
            logits = F.linear(h, lm_head_weight, lm_head_bias)
            return _token_losses(logits, t, SoftLabels(*labels) if labels else None)

        parts = []
        for start in range(0, flat.shape[0], self.chunk_size):
            rows = slice(start, start + self.chunk_size)
            labels = () if flat_soft is None else (flat_soft.ids[rows], flat_soft.probs[rows])
            parts.append(checkpoint(chunk, flat[rows], tgt[rows], *labels, use_reentrant=False))
        nll, ce, correct = (torch.cat(p).view_as(target_ids) for p in zip(*parts))
        return self._reduce(nll, correct, block_mask, num_tokens, block_size, ce)


class SoftLabels(NamedTuple):
    """The target's next-token distribution as a label (EAGLE's and DistillSpec's distillation target): its
    `k` most probable tokens `ids` `[..., k]` and their probabilities `probs` (renormalized over the k)."""

    ids: Tensor
    probs: Tensor


def _token_losses(logits: Tensor, target_ids: Tensor, soft: SoftLabels | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per prediction: −log q(true token), the term the loss sums (the same, or the cross-entropy to the soft
    label, −Σ_j p_j log q(id_j)), and whether the draft's argmax is the true token."""
    logp = logits.float().log_softmax(dim=-1)
    nll = -logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    ce = nll if soft is None else -(soft.probs * logp.gather(-1, soft.ids.long())).sum(dim=-1)
    return nll, ce, logp.argmax(dim=-1) == target_ids


def top_k_labels(logits: Tensor, k: int) -> SoftLabels:
    """The `k` most probable next tokens under `logits` `[..., V]` and their (full-softmax) probabilities."""
    probs, ids = logits.float().softmax(dim=-1).topk(k, dim=-1)
    return SoftLabels(ids.to(torch.int32), probs)


def block_soft_labels(top: SoftLabels, anchors: Tensor, block_size: int, k: int) -> SoftLabels:
    """The soft labels of every block prediction, `[B, N·(bs − 1), k]`: prediction k of an anchor at A is the
    token at A + k, whose distribution the target gave at position A + k − 1 (clamped to the row, like the
    targets; masked there). The first `k` of the stored ones, renormalized to sum to 1."""
    bsz, length = top.ids.shape[:2]
    pos = (anchors[:, :, None] + torch.arange(block_size - 1, device=anchors.device)).clamp_max(length - 1)
    flat = pos.reshape(bsz, -1, 1).expand(-1, -1, k)
    ids = top.ids[..., :k].gather(1, flat)
    probs = top.probs[..., :k].float().gather(1, flat)
    return SoftLabels(ids, probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-12))


DPACE_ALPHA = 0.5  # D-PACE's confidence smoothing α (Wu et al. 2026, arXiv 2605.18810, Eq. 7), the paper's default


def dpace_weights(nll: Tensor, block_mask: Tensor, block_size: int, alpha: float = DPACE_ALPHA) -> Tensor:
    """D-PACE position weights (Wu et al. 2026, "D-PACE: Dynamic Position-Aware Cross-Entropy for Parallel
    Speculative Drafting", arXiv 2605.18810, Eq. 7-8), detached, `[B, T]` for `T = N·(bs − 1)` predictions.

    Within each block, with `q_k = exp(−nll_k)` the draft's probability of the true token at offset k:
    `q̃_k = α + (1 − α)·q_k` (1 where the block mask is 0, so a masked slot neither shrinks nor counts),
    `C_m = Π_{k ≤ m} q̃_k` (the chance the block is still accepted at m) and `w_k = Σ_{m ≥ k} C_m` (the
    accepted length still riding on position k). Masked positions get weight 0."""
    per = block_size - 1
    if nll.shape[1] % per:
        raise ValueError(f"D-PACE weights need whole blocks: {nll.shape[1]} predictions, block size {block_size}")
    with torch.no_grad():
        shape = (nll.shape[0], -1, per)
        valid = block_mask.reshape(shape) > 0
        q = torch.exp(-nll.detach().float()).reshape(shape)
        smooth = torch.where(valid, alpha + (1.0 - alpha) * q, torch.ones_like(q))
        reach = torch.cumprod(smooth, dim=-1) * valid
        after = reach.flip(-1).cumsum(-1).flip(-1)  # Σ_{m ≥ k} C_m
        return (after * valid).reshape(nll.shape)


class DFlashDPACELoss(DFlashDecayLoss):
    """D-PACE in place of the fixed decay: `Σ w_k · block_mask · CE / max(num_tokens, 1)`, with the detached
    weights of `dpace_weights` recomputed from the draft's own confidences at every call (docs/strategies.md
    §5.7). The strategy passes the global number of scored blocks as `num_tokens`, so the loss is the weighted
    CE per block. Needs the block layout (`block_size`); the gradient flows through CE only."""

    def __init__(self, alpha: float = DPACE_ALPHA, use_fused_linear_ce: bool = False, chunk_size: int = 1024):
        super().__init__(None, use_fused_linear_ce, chunk_size, "tokens")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"the D-PACE smoothing alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)

    def position_weights(self, nll: Tensor, block_mask: Tensor, block_size: int | None) -> Tensor:
        if not block_size or block_size < 2:
            raise ValueError("the D-PACE loss needs the block size (block_size=...) to find each block")
        return dpace_weights(nll, block_mask, block_size, self.alpha)


def scored_blocks(block_mask: Tensor, block_size: int) -> int:
    """Blocks with at least one supervised prediction in a `[B, N·(bs − 1)]` block mask (D-PACE's count)."""
    return int((block_mask.reshape(block_mask.shape[0], -1, block_size - 1) > 0).any(dim=-1).sum())


def acceptance_from_correct(correct: Tensor, block_mask: Tensor, block_size: int) -> tuple[float, list[float]]:
    """Teacher-forced τ_sim = mean over kept blocks of 1 + Σ_k Π_{j≤k} correct_j, and acc_k per offset."""
    shape = (-1, block_size - 1)
    c, m = correct.float().reshape(shape), block_mask.float().reshape(shape)
    kept = m[:, 0] > 0
    run = torch.cumprod(c * (m > 0), dim=1)
    tau = float((1 + run.sum(dim=1))[kept].mean()) if kept.any() else float("nan")
    acc = ((c * m).sum(0) / m.sum(0).clamp_min(1)).tolist()
    return tau, acc
