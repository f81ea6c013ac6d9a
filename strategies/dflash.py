"""DFlash building blocks (docs/strategies.md §5.7, §6.2, §10): target layer selection, anchor-block sampling,
the multi-block attention mask (dense and flex), the decay-weighted loss, the draft model and
speculative decoding against a frozen causal target.

Pure PyTorch: no Prefect, no MLflow. Fixes relative to the reference: the mask is always applied
(docs/reference-differences.md G1: no future context for any number of blocks), the non-overlapping
sampler never under-fills (docs/reference-differences.md G3), and anchors come only from the generators
passed in (docs/reference-differences.md G5: resume-reproducible).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model
from torch import Tensor, nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from strategies.losses import DLLMLossOutput

PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFlash paper App. A.1 decay γ by block size


def default_gamma(block_size: int) -> float:
    return PAPER_GAMMA.get(block_size, max(2.0, block_size / 2))


def _build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose hidden states feed the draft: the middle one for a 1-layer draft, else
    evenly spaced from 1 to T − 3, `round(1 + i·(T − 4)/(D − 1))`."""
    if num_draft_layers < 1 or num_target_layers < 1:
        raise ValueError(f"need at least one target and one draft layer (got {num_target_layers}, {num_draft_layers})")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"a {num_draft_layers}-layer draft needs a target with at least 4 layers "
            f"(got {num_target_layers}); use one draft layer or a deeper target"
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
) -> AnchorBlocks:
    """Spec §10.3. Overlapping (default): per row and block, A = clamp(1 + round(U·(maxA − 1)), 1, maxA)
    with U from that row's own generator. Non-overlapping: batch-shared distinct starts; when fewer
    than N fit, only those that fit are kept (fix docs/reference-differences.md G3)."""
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
    return AnchorBlocks(anchors, keep, block_ids.reshape(bsz, -1), targets, block_mask.float())


def block_position_ids(anchors: Tensor, ctx_len: int, block_size: int) -> Tensor:
    """[0..S−1 | A_0 + 0..bs−1 | … | A_{N−1} + 0..bs−1] per row: RoPE sees each block at its true place."""
    bsz = anchors.shape[0]
    ctx = torch.arange(ctx_len, device=anchors.device)[None].expand(bsz, -1)
    blocks = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).reshape(bsz, -1)
    return torch.cat([ctx, blocks], dim=1)


# ---------------------------------------------------------------------------------------- masks


def dflash_visibility(
    anchor_positions: Tensor, block_keep_mask: Tensor, ctx_len: int, block_size: int, causal: bool = False
) -> Tensor:
    """Bool [B, N·bs, S + N·bs]: query q (block b = q // bs, offset o) sees context key k < min(A_b, S)
    when block b is kept, and the noise keys of its own block (with `causal`, those at offsets ≤ o)."""
    bsz, n_blocks = anchor_positions.shape
    q_len, device = n_blocks * block_size, anchor_positions.device
    q = torch.arange(q_len, device=device)
    qb, qo = q // block_size, q % block_size
    k = torch.arange(ctx_len + q_len, device=device)
    anchor = anchor_positions[:, qb]  # [B, Q]
    keep = block_keep_mask.bool()[:, qb]
    ctx = (k[None, None, :] < ctx_len) & (k[None, None, :] < anchor[:, :, None]) & keep[:, :, None]
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
) -> Tensor:
    """Additive DFlash mask [B, 1, N·bs, S + N·bs]: 0 where visible, −inf elsewhere (docs/strategies.md §6.2)."""
    anchors = anchor_positions.to(device) if device is not None else anchor_positions
    visible = dflash_visibility(anchors, block_keep_mask.to(anchors.device), ctx_len, block_size, causal)
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, -math.inf)[:, None]


def build_dflash_mask_mod(
    anchor_positions: Tensor, block_keep_mask: Tensor, ctx_len: int, block_size: int, causal: bool = False
):
    """The same predicate as a flex-attention `mask_mod(b, h, q_idx, kv_idx)`."""
    n_blocks = anchor_positions.shape[1]
    keep = block_keep_mask.bool()

    def mask_mod(b, h, q_idx, kv_idx):
        qb = torch.clamp(q_idx // block_size, max=n_blocks - 1)
        anchor = anchor_positions[b, qb]
        ctx = (kv_idx < ctx_len) & (kv_idx < anchor) & keep[b, qb]
        kn = kv_idx - ctx_len
        noise = (kv_idx >= ctx_len) & (kn // block_size == qb)
        if causal:
            noise = noise & (kn % block_size <= q_idx % block_size)
        return (ctx | noise) & (q_idx // block_size < n_blocks)

    return mask_mod


def create_dflash_block_mask(
    anchor_positions: Tensor, block_keep_mask: Tensor, ctx_len: int, block_size: int, causal: bool = False
):
    """Flex-attention `BlockMask` for the DFlash layout (Q = N·bs, KV = S + N·bs, default 128 tiles)."""
    bsz, n_blocks = anchor_positions.shape
    mod = build_dflash_mask_mod(anchor_positions, block_keep_mask, ctx_len, block_size, causal)
    return create_block_mask(
        mod, bsz, None, n_blocks * block_size, ctx_len + n_blocks * block_size, device=anchor_positions.device
    )


# ---------------------------------------------------------------------------------------- loss


class DFlashDecayLoss(nn.Module):
    """Σ w_k · block_mask · CE(logits, target) with w_k = exp(−(k−1)/γ) (k = 1 right after the anchor).

    `normalize="tokens"`: ÷ max(num_tokens, 1) when given, else unnormalized; `"mean"`: ÷ (Σ W + 1e-6).
    Returns `DLLMLossOutput` with per-offset correct/count sums when the block layout is known.
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

    def _reduce(self, nll: Tensor, correct: Tensor, block_mask: Tensor, num_tokens, block_size) -> DLLMLossOutput:
        w = self.weights(nll.shape[1], block_size, nll.device)[None] * block_mask.float()
        total = (nll.float() * w).sum()
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
        self, logits: Tensor, target_ids: Tensor, block_mask: Tensor, num_tokens=None, block_size: int | None = None
    ) -> DLLMLossOutput:
        nll = F.cross_entropy(logits.float().flatten(0, 1), target_ids.flatten(), reduction="none").view_as(target_ids)
        correct = logits.argmax(dim=-1) == target_ids
        return self._reduce(nll, correct, block_mask, num_tokens, block_size)

    def forward_fused(
        self,
        hidden: Tensor,
        lm_head_weight: Tensor,
        target_ids: Tensor,
        block_mask: Tensor,
        num_tokens=None,
        block_size: int | None = None,
        lm_head_bias: Tensor | None = None,
    ) -> DLLMLossOutput:
        """Chunks of `chunk_size` rows through linear + CE under activation checkpointing: the
        [B·T, V] logits never stay alive for backward."""
        flat, tgt = hidden.flatten(0, 1), target_ids.flatten()

        def chunk(h, t):
            logits = F.linear(h, lm_head_weight, lm_head_bias).float()
            return F.cross_entropy(logits, t, reduction="none"), (logits.argmax(-1) == t)

        nlls, corrects = [], []
        for start in range(0, flat.shape[0], self.chunk_size):
            h, t = flat[start : start + self.chunk_size], tgt[start : start + self.chunk_size]
            nll, corr = checkpoint(chunk, h, t, use_reentrant=False)
            nlls.append(nll)
            corrects.append(corr)
        nll = torch.cat(nlls).view_as(target_ids)
        return self._reduce(nll, torch.cat(corrects).view_as(target_ids), block_mask, num_tokens, block_size)


def acceptance_from_correct(correct: Tensor, block_mask: Tensor, block_size: int) -> tuple[float, list[float]]:
    """Teacher-forced τ_sim = mean over kept blocks of 1 + Σ_k Π_{j≤k} correct_j, and acc_k per offset."""
    shape = (-1, block_size - 1)
    c, m = correct.float().reshape(shape), block_mask.float().reshape(shape)
    kept = m[:, 0] > 0
    run = torch.cumprod(c * (m > 0), dim=1)
    tau = float((1 + run.sum(dim=1))[kept].mean()) if kept.any() else float("nan")
    acc = ((c * m).sum(0) / m.sum(0).clamp_min(1)).tolist()
    return tau, acc


# ---------------------------------------------------------------------------------------- draft


@dataclass
class DFlashDraftConfig:
    hidden_size: int  # = the target's hidden size (the draft reads target embeddings, writes to its head)
    num_layers: int
    num_heads: int
    num_target_features: int  # len(target_layer_ids)
    target_hidden_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    intermediate_size: int | None = None
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def save_pretrained(self, dest: str | Path) -> None:
        """Write `dflash_draft.json` (the checkpoint writer calls this like an HF config's)."""
        Path(dest, DFlashDraftModel.CONFIG).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def from_dir(cls, path: str | Path) -> DFlashDraftConfig:
        f = Path(path) / DFlashDraftModel.CONFIG
        if not f.is_file():
            raise FileNotFoundError(f"{path} is not a DFlash draft checkpoint (no {DFlashDraftModel.CONFIG})")
        return cls(**json.loads(f.read_text()))


def _rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary embedding over the last dim of x [B, H, T, D] at integer positions [B, T]."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    ang = positions[:, None, :, None].float() * inv  # [B,1,T,D/2]
    cos, sin = ang.cos().repeat_interleave(2, -1).to(x.dtype), ang.sin().repeat_interleave(2, -1).to(x.dtype)
    pair = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    return x * cos + pair * sin


class _DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig):
        super().__init__()
        h, inner = cfg.hidden_size, cfg.intermediate_size or 3 * cfg.hidden_size
        self.cfg = cfg
        self.attn_norm, self.mlp_norm = nn.RMSNorm(h, eps=cfg.rms_eps), nn.RMSNorm(h, eps=cfg.rms_eps)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.gate, self.up, self.down = (
            nn.Linear(h, inner, bias=False),
            nn.Linear(h, inner, bias=False),
            nn.Linear(inner, h, bias=False),
        )

    def forward(self, x: Tensor, ctx: Tensor, positions: Tensor, mask) -> Tensor:
        cfg, (bsz, q_len, _), s = self.cfg, x.shape, ctx.shape[1]
        heads = lambda t: t.view(bsz, t.shape[1], cfg.num_heads, cfg.head_dim).transpose(1, 2)  # noqa: E731
        h = self.attn_norm(x)
        q = _rope(heads(self.q(h)), positions[:, s:], cfg.rope_theta)
        kv_in = torch.cat([ctx, h], dim=1)  # context features enter as keys/values only
        k = _rope(heads(self.k(kv_in)), positions, cfg.rope_theta)
        v = heads(self.v(kv_in))
        if mask is None or isinstance(mask, Tensor):
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # flex BlockMask
            a = flex_attention(q, k, v, block_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(bsz, q_len, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class DFlashDraftModel(nn.Module):
    """Spec §10.1: `fc` projects the concatenated target features n·H_t → H (RMS-normed once); every
    layer takes queries from the block tokens only and keys/values from [context ; block] with RoPE
    over [context positions ; block positions]; a final RMSNorm. No embedding or head of its own:
    block inputs are the frozen target's embeddings and outputs go through the target's LM head."""

    CONFIG = "dflash_draft.json"
    WEIGHTS = "model.safetensors"

    def __init__(self, cfg: DFlashDraftConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_target_features * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.ctx_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_eps)
        self.layers = nn.ModuleList(_DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_eps)

    def forward(
        self, target_hidden: Tensor, noise_embedding: Tensor, position_ids: Tensor, attention_mask=None
    ) -> Tensor:
        ctx = self.ctx_norm(self.fc(target_hidden))
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, ctx, position_ids, attention_mask)
        return self.norm(x)

    def save(self, dest: str | Path) -> None:
        """Self-describing checkpoint: config JSON + safetensors, written atomically by the caller's dir swap."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(dest)
        save_model(self, str(dest / self.WEIGHTS))

    @classmethod
    def load(cls, path: str | Path, device="cpu") -> DFlashDraftModel:
        model = cls(DFlashDraftConfig.from_dir(path))
        load_model(model, str(Path(path) / cls.WEIGHTS), device=str(device))
        return model


def target_features(target: nn.Module, input_ids: Tensor, layer_ids: list[int], past_key_values=None):
    """Concatenated hidden states of `layer_ids` ([B, L, n·H]; index 0 is the embedding output, so
    layer l is hidden_states[l + 1]), the logits, and the cache."""
    kwargs = {"cache": past_key_values, "use_cache": True} if past_key_values is not None else {"use_cache": False}
    out = target(input_ids=input_ids, output_hidden_states=True, **kwargs)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return feats, out.logits, past_key_values  # the cache is updated in place


def _embed_and_head(target: nn.Module):
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    if emb is None or head is None:
        raise ValueError("Target model must expose input embeddings and lm_head.")
    return emb, head


def draft_block_logits(
    draft: DFlashDraftModel, target: nn.Module, ctx_features: Tensor, anchors: Tensor, keep: Tensor, block_ids: Tensor
) -> Tensor:
    """Logits [B, N·bs, V] of the draft for N blocks under the (always applied) DFlash mask."""
    emb, head = _embed_and_head(target)
    bs = draft.config.block_size
    s = ctx_features.shape[1]
    noise = emb(block_ids).to(ctx_features.dtype)
    positions = block_position_ids(anchors, s, bs)
    mask = create_dflash_sdpa_mask(anchors, keep, s, bs, dtype=noise.dtype)
    return head(draft(ctx_features, noise, positions, mask))


# ---------------------------------------------------------------------------------------- decoding


@dataclass
class SpeculativeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    acceptance: list[int]  # a_c + 1 per cycle
    target_forwards: int

    @property
    def tau(self) -> float:
        return sum(self.acceptance) / max(len(self.acceptance), 1)


@torch.no_grad()
def speculative_generate(
    target: nn.Module, draft: DFlashDraftModel, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None
) -> SpeculativeResult:
    """Greedy DFlash decoding: the draft proposes bs − 1 tokens after the anchor in one forward, the
    target verifies them in one forward, the longest matching prefix plus the target's bonus token is
    committed, and the target cache is cropped to what was committed. Output = target-only greedy."""
    cfg = draft.config
    bs, device = cfg.block_size, next(draft.parameters()).device
    ids = torch.tensor([prompt], device=device)
    feats, logits, cache = target_features(target, ids, cfg.target_layer_ids, past_key_values=_new_cache(target))
    out: list[int] = [int(logits[0, -1].argmax())]  # the prefill's token: the first anchor
    committed = len(prompt)  # tokens the target has processed (and whose features we hold)
    ctx = feats
    acceptance, forwards = [], 1
    while len(out) < max_new_tokens and not (eos_token_id is not None and out[-1] == eos_token_id):
        anchor = torch.tensor([[committed]], device=device)
        block = torch.full((1, bs), cfg.mask_token_id, device=device)
        block[0, 0] = out[-1]
        proposal = draft_block_logits(draft, target, ctx, anchor, torch.ones_like(anchor, dtype=torch.bool), block)[
            0, 1:
        ].argmax(-1)
        verify_in = torch.cat([block[:, :1], proposal[None]], dim=1)  # anchor + bs − 1 proposals
        v_feats, v_logits, cache = target_features(target, verify_in, cfg.target_layer_ids, past_key_values=cache)
        forwards += 1
        greedy = v_logits[0].argmax(-1)  # target's choice after each verify position
        accepted = 0
        while accepted < bs - 1 and int(proposal[accepted]) == int(greedy[accepted]):
            accepted += 1
        new = proposal[:accepted].tolist() + [int(greedy[accepted])]
        acceptance.append(accepted + 1)
        out.extend(new)
        # keep features/cache for the anchor and the accepted proposals; the bonus is the next anchor
        ctx = torch.cat([ctx, v_feats[:, : accepted + 1]], dim=1)
        committed += accepted + 1
        surplus = cache.get_seq_length() - committed  # rejected proposals the target already cached
        if surplus > 0:
            cache.crop(-surplus)
        if eos_token_id is not None and eos_token_id in new:
            break
    tokens = out[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return SpeculativeResult(tokens, acceptance, forwards)


def _new_cache(target: nn.Module):
    return DynamicCache(config=target.config)


@torch.no_grad()
def greedy_generate(
    target: nn.Module, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """Target-only greedy decoding with a KV cache (the reference DFlash must reproduce)."""
    device = next(target.parameters()).device
    cache = _new_cache(target)
    logits = target(input_ids=torch.tensor([prompt], device=device), cache=cache, use_cache=True).logits
    out = [int(logits[0, -1].argmax())]
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        logits = target(input_ids=torch.tensor([[out[-1]]], device=device), cache=cache, use_cache=True).logits
        out.append(int(logits[0, -1].argmax()))
    return out


@torch.no_grad()
def sample_continuations(
    target: nn.Module, prompts: Tensor, new_tokens: int, temperature: float, generator: torch.Generator | None = None
) -> Tensor:
    """`[B, P + new_tokens]`: each prompt row continued by the target, batched with one KV cache,
    sampled at `temperature` (greedy at 0) from `generator` only — so the same seed regenerates the
    same data (DFlash trains best on the target's own outputs, paper §5.1)."""
    cache = _new_cache(target)
    logits = target(input_ids=prompts, cache=cache, use_cache=True).logits[:, -1]
    out = [prompts]
    for i in range(new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(prompts.device)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        if i + 1 < new_tokens:
            logits = target(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
    return torch.cat(out, dim=1)
