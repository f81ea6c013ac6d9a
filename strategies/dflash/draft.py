"""The DFlash draft (docs/strategies.md §8.5, §10): the draft model that reads the frozen
target's hidden states as context, the target-feature extraction, and the draft's block logits. Decoding with it
is in `strategies.dflash.decoding` (one block per cycle) and `strategies.dflash.tree` (several branches per cycle),
the anchors and mask in `strategies.dflash.blocks`, the losses in `strategies.dflash.loss`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.nn.attention.flex_attention import flex_attention

from dllm_common.checkpoint import DIGESTS, check_weights_fit, read_weights, verify_checkpoint, weight_files
from strategies.dflash.blocks import CopyHints, block_position_ids
from strategies.dflash.config import DFlashDraftConfig, is_draft_dir
from strategies.dflash.dflash2 import CandidateSelector, InBlockConv, conv_sublayer
from strategies.dflash.dflash2_config import DFLASH2, DOMINO, DSPARK
from strategies.dflash.domino import attach_domino_head
from strategies.dflash.dspark import attach_dspark_heads
from strategies.dflash.window import draft_masks, layer_mask
from strategies.drawing import LOOKUP_MAX_NGRAM

# ---------------------------------------------------------------------------------------- draft


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm, as the engines compute it: normalized in fp32, cast back, then scaled by the weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [B, T, head_dim] of rotate-half RoPE at integer positions [B, T] (angles in fp32): frequency
    i of dimension pair (i, i + head_dim/2) is theta^(−2i/head_dim)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim)
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of x [B, heads, T, D] with cos/sin [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashAttention(nn.Module):
    """Grouped-query attention whose queries come from the block and whose keys/values come from [context ;
    block] through the same k/v projections and per-head k norm; q/k RMS-normed per head before RoPE."""

    def __init__(self, cfg: DFlashDraftConfig):
        super().__init__()
        h, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.heads, self.kv_heads, self.head_dim, self.theta = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
            cfg.rope_theta,
        )
        self.q_proj = nn.Linear(h, self.heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, h: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, mask) -> Tensor:
        (bsz, q_len, _), s, hd = h.shape, ctx.shape[1], self.head_dim
        q = self.q_norm(self.q_proj(h).view(bsz, q_len, self.heads, hd)).transpose(1, 2)
        kv_in = torch.cat([ctx, h], dim=1)  # the context enters as keys/values only
        k = self.k_norm(self.k_proj(kv_in).view(bsz, s + q_len, self.kv_heads, hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(bsz, s + q_len, self.kv_heads, hd).transpose(1, 2)
        q, k = _rotate(q, cos[:, s:], sin[:, s:]), _rotate(k, cos, sin)
        gqa = self.kv_heads != self.heads  # kv head j serves query heads j·g … (j + 1)·g − 1
        if mask is None or isinstance(mask, Tensor):
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:  # flex BlockMask
            a = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        return self.o_proj(a.transpose(1, 2).reshape(bsz, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig):
        super().__init__()
        h, inner = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, inner, bias=False)
        self.up_proj = nn.Linear(h, inner, bias=False)
        self.down_proj = nn.Linear(inner, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """A Qwen3-style layer; a DFlash 2 draft's also convolves each sublayer's input and output within the block
    (`attention_conv`, `mlp_conv`: `strategies.dflash.dflash2`), built after the rest so that from one seed its
    other weights are the plain layer's. `layer_type` picks its mask when the draft's layers differ (§10.12)."""

    def __init__(self, cfg: DFlashDraftConfig, index: int = 0):
        super().__init__()
        self.layer_type = cfg.layer_types[index]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg)
        self.block_size = cfg.block_size
        if cfg.variant == DFLASH2:
            self.attention_conv = InBlockConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = InBlockConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, mask) -> Tensor:
        mask = layer_mask(mask, self.layer_type)
        if not hasattr(self, "attention_conv"):
            x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        bs = self.block_size
        x = x + conv_sublayer(self.attention_conv, self.self_attn, self.input_layernorm(x), bs, ctx, cos, sin, mask)
        return x + conv_sublayer(self.mlp_conv, self.mlp, self.post_attention_layernorm(x), bs)


class DFlashDraftModel(nn.Module):
    """The z-lab / SpecForge DFlash draft that SGLang, vLLM, TensorRT-LLM and `speculators` load
    (docs/strategies.md §10.1, §10.10): `fc` projects the concatenated target features n·H → H and
    `hidden_norm` normalizes them once (never `input_layernorm`); every Qwen3-style layer takes queries from
    the block only and keys/values from [context ; block], with rotate-half RoPE over [context positions ;
    block positions]; a final `norm`. No embedding or head of its own: block inputs are the frozen target's
    embeddings and outputs go through the target's LM head. Parameter names are the engines' (no `model.`
    prefix); a `copy_hint` draft adds dllm-flow's `hint_proj` and `hint_length` inputs, a DFlash 2 draft (config
    `variant: dflash2`, `architectures: ["DFlash2DraftModel"]`) its in-block convolutions and path selector, a Domino
    draft (`variant: domino`) its serial correction head (`prefix_gru`, `embed_proj`), a DSpark draft (`variant:
    dspark`) its `markov_head` and `confidence_head`."""

    WEIGHTS = "model.safetensors"

    def __init__(self, cfg: DFlashDraftConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_target_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.variant == DFLASH2:  # DFlash 2's path selector (docs/strategies.md §10.11), after the backbone
            if cfg.vocab_size is None:
                raise ValueError("a DFlash 2 draft needs the target's vocabulary (vocab_size) for its selector")
            self.candidate_selector = CandidateSelector(cfg.vocab_size, h, cfg.selector_rank, cfg.selector_top_k)
        if cfg.variant == DOMINO:  # Domino's serial correction head (docs/strategies.md §10.15), after the backbone
            attach_domino_head(self, cfg)
        if (
            cfg.variant == DSPARK
        ):  # DSpark's Markov and confidence heads (docs/strategies.md §10.17), after the backbone
            attach_dspark_heads(self, cfg)
        if cfg.copy_hint:  # zero at initialization: training starts from the plain draft and learns when to copy
            self.hint_proj = nn.Linear(h, h, bias=False)
            self.hint_length = nn.Embedding(LOOKUP_MAX_NGRAM + 1, h)
            nn.init.zeros_(self.hint_proj.weight)
            nn.init.zeros_(self.hint_length.weight)

    def forward(
        self,
        target_hidden: Tensor,
        noise_embedding: Tensor,
        position_ids: Tensor,
        attention_mask=None,
        hint_embedding: Tensor | None = None,
        hint_lengths: Tensor | None = None,
    ) -> Tensor:
        """Hidden states [B, Q, H] of the block tokens `noise_embedding` [B, Q, H] (after the final norm), reading
        `target_hidden` [B, S, n·H]; `position_ids` [B, S + Q] are the context's then the block's. With
        `copy_hint`, block position j's input also carries the hinted token's embedding (through `hint_proj`,
        where a hint exists) and the length of the suffix that matched (`hint_length`)."""
        cfg = self.config
        ctx = self.hidden_norm(self.fc(target_hidden))
        x = noise_embedding
        if cfg.copy_hint:
            if hint_embedding is None or hint_lengths is None:
                raise ValueError("this DFlash draft reads copy hints (copy_hint): pass hint_embedding and hint_lengths")
            present = (hint_lengths > 0).unsqueeze(-1).to(x.dtype)
            x = x + self.hint_proj(hint_embedding) * present + self.hint_length(hint_lengths)
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, attention_mask)
        return self.norm(x)

    def save(self, dest: str | Path) -> None:
        """config.json (the z-lab layout) + model.safetensors (sorted names), as the engines read them."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(dest)
        state = {k: v.detach().cpu().contiguous() for k, v in sorted(self.state_dict().items())}
        save_file(state, str(dest / self.WEIGHTS), metadata={"format": "pt"})

    @staticmethod
    def describes(path: str | Path) -> bool:
        """A folder holding a DFlash draft (either layout, or the old one, which `from_config_dir` refuses)."""
        return is_draft_dir(path)

    @classmethod
    def from_config_dir(cls, path: str | Path) -> DFlashDraftModel:
        """The draft a folder's config.json describes, weights not loaded (`model_from_config_dir`)."""
        return cls(DFlashDraftConfig.from_dir(path))

    @classmethod
    def load(
        cls, path: str | Path, device="cpu", where: str | None = None, config: DFlashDraftConfig | None = None
    ) -> DFlashDraftModel:
        """A draft folder in either layout (a dllm-flow checkpoint's digests verified first, then every tensor's
        header against the draft: `check_weights_fit`, naming `where`, the flag or key that named the folder), its
        weights in the draft's dtype (fp32); the weight names must be exactly the draft's. `config`: the folder's
        config.json as already read (a copy is taken), so it is not read again."""
        path = Path(path)
        model = cls(copy.deepcopy(config)) if config is not None else cls.from_config_dir(path)
        if (path / DIGESTS).is_file():
            verify_checkpoint(path)
        check_weights_fit(model, [path / name for name in weight_files(path)], where)
        state = read_weights(path)
        expected = set(model.state_dict())
        extra, missing = sorted(set(state) - expected), sorted(expected - set(state))
        if extra or missing:
            reduced = [k for k in extra if k in ("d2t", "t2d", "lm_head.weight", "embed_tokens.weight")]
            why = (
                f"it carries {reduced}: a draft with its own vocabulary, embedding or LM head, which dllm-flow's "
                "draft (the target's embedding and head) can't run"
                if reduced
                else f"unexpected {extra[:4]}, missing {missing[:4]}"
            )
            raise ValueError(f"{path}: its weights are not this DFlash draft's ({why})")
        model.load_state_dict(state, strict=True)
        return model.to(device)


def target_features(target: nn.Module, input_ids: Tensor, layer_ids: list[int], past_key_values=None):
    """Concatenated hidden states of `layer_ids` ([B, L, n·H]; index 0 is the embedding output, so
    layer l is hidden_states[l + 1]), the logits, and the cache."""
    kwargs = {"cache": past_key_values, "use_cache": True} if past_key_values is not None else {"use_cache": False}
    out = target(input_ids=input_ids, output_hidden_states=True, **kwargs)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return feats, out.logits, past_key_values  # the cache is updated in place


def embed_and_head(target: nn.Module):
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    if emb is None or head is None:
        raise ValueError("Target model must expose input embeddings and lm_head.")
    return emb, head


def draft_block_hidden(
    draft: nn.Module,
    block_size: int,
    embed: nn.Module,
    ctx_features: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_ids: Tensor,
    document_ids: Tensor | None = None,
    backend: str = "sdpa",
    hints: CopyHints | None = None,
    offset: int = 0,
) -> Tensor:
    """Hidden states [B, N·bs, H] of the draft (possibly DDP/FSDP-wrapped) for N blocks under the (always
    applied) DFlash mask: dense, or a flex-attention BlockMask (`backend="flex_attention"`; its backward needs a
    GPU in torch 2.13); confined to each anchor's document when `document_ids` (`[B, S]`, packed rows) is given,
    and to the window of its sliding-window layers (`strategies.dflash.window`). `hints`: the copy hints of a
    `copy_hint` draft (`strategies.dflash.blocks.copy_hints`); `offset`: the position of the first context feature
    (a windowed decoder's trimmed context; anchors index `ctx_features`)."""
    bs, s = block_size, ctx_features.shape[1]
    noise = embed(block_ids).to(ctx_features.dtype)
    positions = block_position_ids(anchors, s, bs) + offset
    cfg = getattr(draft, "module", draft).config  # always masked (docs/reference-differences.md G1)
    mask = draft_masks(cfg, anchors, keep, s, bs, noise.dtype, document_ids, backend)
    if hints is None:
        return draft(ctx_features, noise, positions, mask)
    return draft(ctx_features, noise, positions, mask, embed(hints.ids).to(noise.dtype), hints.lengths)


def draft_block_logits(
    draft: DFlashDraftModel,
    target: nn.Module,
    ctx_features: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_ids: Tensor,
    document_ids: Tensor | None = None,
    hints: CopyHints | None = None,
    offset: int = 0,
) -> Tensor:
    """Logits [B, N·bs, V] of the draft for N blocks (`draft_block_hidden` through the target's head)."""
    emb, head = embed_and_head(target)
    bs = draft.config.block_size
    hidden = draft_block_hidden(
        draft, bs, emb, ctx_features, anchors, keep, block_ids, document_ids, hints=hints, offset=offset
    )
    return head(hidden)
