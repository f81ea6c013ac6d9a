"""The DFlash draft and decoding (docs/strategies.md §8.5, §10): the draft model that reads the frozen
target's hidden states as context, the target-feature extraction, and greedy speculative decoding whose
output equals target-only greedy decoding. The anchors and mask are in `strategies.dflash.blocks`, the
losses in `strategies.dflash.loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.nn.attention.flex_attention import flex_attention
from transformers import DynamicCache

from dllm_common.checkpoint import DIGESTS, read_weights, verify_checkpoint
from strategies.dflash.blocks import CopyHints, block_position_ids, copy_hints
from strategies.dflash.config import DFlashDraftConfig, is_draft_dir
from strategies.dflash.dflash2 import CandidateSelector, InBlockConv, conv_sublayer
from strategies.dflash.dflash2_config import DFLASH2, DOMINO, SAMPLED_DEFAULT, WALK
from strategies.dflash.domino import attach_domino_head, serial_walk
from strategies.dflash.window import draft_masks, layer_mask, trim_context
from strategies.sampling import LOOKUP_MAX_NGRAM, draw

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
    draft (`variant: domino`) its serial correction head (`prefix_gru`, `embed_proj`)."""

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
    def load(cls, path: str | Path, device="cpu") -> DFlashDraftModel:
        """A draft folder in either layout (a dllm-flow checkpoint's digests verified first), its weights in the
        draft's dtype (fp32); the weight names must be exactly the draft's."""
        path = Path(path)
        model = cls.from_config_dir(path)
        if (path / DIGESTS).is_file():
            verify_checkpoint(path)
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


def _embed_and_head(target: nn.Module):
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
    emb, head = _embed_and_head(target)
    bs = draft.config.block_size
    hidden = draft_block_hidden(
        draft, bs, emb, ctx_features, anchors, keep, block_ids, document_ids, hints=hints, offset=offset
    )
    return head(hidden)


# ---------------------------------------------------------------------------------------- decoding


@dataclass
class SpeculativeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    acceptance: list[int]  # a_c + 1 per cycle
    target_forwards: int
    lookups: int = 0  # cycles whose first proposals came from the context lookup (`lookup_ngram`)

    @property
    def tau(self) -> float:
        return sum(self.acceptance) / max(len(self.acceptance), 1)


def speculative_accept(
    target_probs: Tensor, draft_probs: Tensor, proposal: Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """The rejection step of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    `target_probs` [k+1, V]: the target's next-token distribution after the anchor and after each
    proposal; `draft_probs` [k, V]: the draft's; `proposal` [k] drawn from `draft_probs`. Proposal i
    stands with probability min(1, p_i(x_i)/q_i(x_i)); at the first rejection the next token is drawn
    from the residual max(0, p_i − q_i) (normalized), and when all stand a bonus token is drawn from
    p_k. Returns (proposals that stand, next token); the committed tokens follow the target's
    distribution exactly, whatever the draft."""
    k = proposal.shape[0]
    p, q, x = target_probs.float().cpu(), draft_probs.float().cpu(), proposal.cpu()
    u = torch.rand(k, generator=generator)
    for i in range(k):
        if u[i] * q[i, x[i]] < p[i, x[i]]:
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def _verify(
    proposal: Tensor, draft_logits: Tensor, target_logits: Tensor, temperature: float, generator
) -> tuple[int, int]:
    """(proposals that stand, the target's next token): the longest prefix equal to the target's greedy
    choices at temperature 0, the rejection step of speculative sampling above it."""
    if temperature <= 0:
        greedy = target_logits.argmax(-1)
        accepted = 0
        while accepted < len(proposal) and int(proposal[accepted]) == int(greedy[accepted]):
            accepted += 1
        return accepted, int(greedy[accepted])
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    return speculative_accept(p, q, proposal, generator)


def context_lookup(history: list[int], min_ngram: int, count: int) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the longest suffix of `history`
    (from `LOOKUP_MAX_NGRAM` down to `min_ngram` tokens) inside `history`; [] when no suffix recurs.
    Prompt lookup (Saxena 2023) / n-gram speculation: text that repeats itself is proposed from itself."""
    for n in range(min(LOOKUP_MAX_NGRAM, len(history) - 1), min_ngram - 1, -1):
        suffix = history[-n:]
        for end in range(len(history) - 2, n - 2, -1):  # `end`: last index of an earlier occurrence
            if history[end - n + 1 : end + 1] == suffix:
                return history[end + 1 : end + 1 + count]
    return []


def _with_lookup(found: list[int], d_logits: Tensor, proposal: Tensor) -> tuple[Tensor, Tensor, bool]:
    """Proposals (and the distributions they were drawn from) with the context lookup's tokens `found` in front: a
    looked-up token is a draw from a point mass, so the rejection step stays exact (docs/strategies.md §10.8)."""
    if not found:
        return d_logits, proposal, False
    n = len(found)
    proposal, d_logits = proposal.clone(), d_logits.clone()
    proposal[:n] = torch.tensor(found, device=proposal.device)
    d_logits[:n] = float("-inf")
    d_logits[torch.arange(n, device=d_logits.device), proposal[:n]] = 0.0
    return d_logits, proposal, True


def sampled_from(cfg: DFlashDraftConfig, choice: str | None) -> str | None:
    """What a serial draft proposes from at T > 0: `choice` (`walk` or `backbone`), else its variant's default."""
    return choice or SAMPLED_DEFAULT.get(cfg.variant)


@torch.no_grad()
def speculative_generate(
    target: nn.Module,
    draft: DFlashDraftModel,
    prompt: list[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    lookup_ngram: int = 0,
    sampled_proposals: str | None = None,
) -> SpeculativeResult:
    """DFlash decoding: the draft proposes bs − 1 tokens after the anchor in one forward, the target
    verifies them in one forward, the proposals that stand plus the target's next token are committed,
    and the target cache is cropped to what was committed. At temperature 0 the output is target-only
    greedy; above it, proposals are drawn from the draft at `temperature` and verified by the rejection
    step of speculative sampling (`speculative_accept`), so the output is distributed as the target's
    own samples at that temperature (docs/strategies.md §10.8). With `lookup_ngram` n > 0, when the last
    n…4 tokens (prompt and output) occurred earlier, the tokens that followed them there replace the
    draft's first proposals (`context_lookup`); the output is unchanged, only the acceptance moves. A
    `copy_hint` draft also reads the lookup's proposal (n = 1) as an input each cycle (`copy_hints`); with
    `lookup_ngram` > 0 the lookup still goes in front of it. A DFlash 2 draft proposes the path its selector
    walks (`CandidateSelector.walk`; Domino its chain), verified against the distributions the walk drew from; looked-up
    tokens lead the block and the walk goes on after them. At T > 0 `sampled_proposals` says whether such a draft
    samples its walk (`walk`, as z-lab's decoder and the engines do) or proposes from its backbone's one-pass
    distribution as a DFlash draft does (`backbone`); unset, the draft's default (`SAMPLED_DEFAULT`: DFlash 2 its
    backbone, Domino its walk; docs/strategies.md §10.13)."""
    cfg = draft.config
    bs, device = cfg.block_size, next(draft.parameters()).device
    ids = torch.tensor([prompt], device=device)
    feats, logits, cache = target_features(target, ids, cfg.target_layer_ids, past_key_values=_new_cache(target))
    out: list[int] = [int(draw(logits[:, -1], temperature, generator))]  # the prefill's token: the first anchor
    committed = len(prompt)  # tokens the target has processed (and whose features we hold)
    ctx, start = trim_context(cfg, feats, 0, committed)  # `start`: the position of ctx's first feature (§10.12)
    acceptance, forwards, lookups = [], 1, 0
    while len(out) < max_new_tokens and not (eos_token_id is not None and out[-1] == eos_token_id):
        anchor = torch.tensor([[committed - start]], device=device)
        block = torch.full((1, bs), cfg.mask_token_id, device=device)
        block[0, 0] = out[-1]
        keep = torch.ones_like(anchor, dtype=torch.bool)
        hints, trimmed = None, {"offset": start} if start else {}  # a windowed draft's context starts at `start`
        if cfg.copy_hint:  # the history's last token is the anchor
            history = torch.tensor([list(prompt) + out], device=device)
            hints = copy_hints(history, torch.tensor([[history.shape[1] - 1]], device=device), bs, cfg.mask_token_id)
        found = context_lookup(list(prompt) + out, lookup_ngram, bs - 1) if lookup_ngram else []
        # drafted serially after the backbone: the path and its distributions (sampled: the backbone's, §10.13)
        if cfg.variant in (DFLASH2, DOMINO) and (temperature <= 0 or sampled_from(cfg, sampled_proposals) == WALK):
            emb, head = _embed_and_head(target)  # (walked after the looked-up tokens, which lead the block)
            hidden = draft_block_hidden(draft, bs, emb, ctx, anchor, keep, block, **trimmed)[0, 1:]
            proposal, d_logits = serial_walk(draft, emb, hidden, head(hidden), out[-1], temperature, generator, found)
        else:
            d_logits = draft_block_logits(draft, target, ctx, anchor, keep, block, hints=hints, **trimmed)[0, 1:]
            proposal = draw(d_logits, temperature, generator)
        d_logits, proposal, looked_up = _with_lookup(found, d_logits, proposal)
        lookups += looked_up
        verify_in = torch.cat([block[:, :1], proposal[None]], dim=1)  # anchor + bs − 1 proposals
        v_feats, v_logits, cache = target_features(target, verify_in, cfg.target_layer_ids, past_key_values=cache)
        forwards += 1
        accepted, nxt = _verify(proposal, d_logits, v_logits[0], temperature, generator)
        new = proposal[:accepted].tolist() + [nxt]
        acceptance.append(accepted + 1)
        out.extend(new)
        # keep features/cache for the anchor and the accepted proposals; the bonus is the next anchor
        ctx = torch.cat([ctx, v_feats[:, : accepted + 1]], dim=1)
        committed += accepted + 1
        ctx, start = trim_context(cfg, ctx, start, committed)
        surplus = cache.get_seq_length() - committed  # rejected proposals the target already cached
        if surplus > 0:
            cache.crop(-surplus)
        if eos_token_id is not None and eos_token_id in new:
            break
    tokens = out[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return SpeculativeResult(tokens, acceptance, forwards, lookups)


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
        nxt = draw(logits, temperature, generator)[:, None]
        out.append(nxt)
        if i + 1 < new_tokens:
            logits = target(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
    return torch.cat(out, dim=1)
