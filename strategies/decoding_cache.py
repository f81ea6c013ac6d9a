"""Cached decoding (docs/decoding.md §1, §2): reuse of key/value states across denoising steps.

Two kinds of cache, chosen by `SamplerConfig.cache`:

- exact ("exact", and under "prefix"/"dual" too): where attention is causal, a position's K/V depend only on
  the tokens up to it, so the K/V of finished positions are computed once and reused. `CausalDecoder` does this
  for a causal denoiser (I-DLM's clean prefix), `CausalPrefix` for the hybrid's causal seeding branch, and
  `EncoderCache` for the block-diffusion encoder. Tokens equal the uncached ones (up to float rounding).
- approximate ("prefix", "dual"): Fast-dLLM's caches (Wu et al. 2025, arXiv 2505.22618) for a bidirectional
  denoiser. At a block's first step the whole canvas is forwarded, as without a cache, and its K/V kept;
  later steps of the block forward only the block (+ the masked suffix with "prefix") against those K/V.
  The kept K/V go stale as the block fills in, hence approximate; each new block refreshes them.

Every decoder returns the logits of the columns its window needs; the samplers never see the difference.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from strategies.models import BIDIRECTIONAL_MASK, model_logits

CACHE_MODES = ("none", "exact", "prefix", "dual")
APPROXIMATE = ("prefix", "dual")
KV = list[tuple[Tensor, Tensor]]  # per layer (keys, values), each [B, H_kv, L, D]


def check_cache_mode(mode: str) -> str:
    if mode not in CACHE_MODES:
        raise ValueError(
            f"cache={mode!r}: use 'none' (recompute everything), 'exact' (reuse K/V only where attention is "
            "causal), 'prefix' or 'dual' (also Fast-dLLM's approximate caches for bidirectional decoding)"
        )
    return mode


class _StepLayer(DynamicLayer):
    """One layer's kept K/V. `update` returns kept ⊕ the forward's own K/V and sets the latter aside in `fresh`
    instead of appending them, so one cache serves every step of a block."""

    def __init__(self, keys: Tensor | None = None, values: Tensor | None = None):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, keys is not None
        self.fresh: tuple[Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.fresh = (key_states, value_states)
        if self.keys is None:
            return key_states, value_states
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def _run(module: nn.Module, ids: Tensor, first: int, kv: KV | None, mask: Tensor, **extra) -> tuple:
    """Forward `ids` [B, q] (canvas columns first..first+q−1) against the kept `kv` under `mask` [B, 1, q, kv + q]
    → (the module's output, the forward's own K/V per layer)."""
    n_layers = module.config.num_hidden_layers
    layers = [_StepLayer() for _ in range(n_layers)] if kv is None else [_StepLayer(*pair) for pair in kv]
    positions = torch.arange(first, first + ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    cache = Cache(layers=layers)
    out = module(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, **extra)
    return out, [layer.fresh for layer in layers]


def forward_cached(lm: nn.Module, ids: Tensor, first: int, kv: KV | None, mask: Tensor, keep: Tensor) -> tuple:
    """`_run` on a causal LM → (logits of the query rows `keep` only, the forward's own K/V)."""
    out, fresh = _run(lm, ids, first, kv, mask, logits_to_keep=keep)
    return out.logits, fresh


def visible_mask(batch: int, queries: int, keys: int, device) -> Tensor:
    """All-visible bool [B, 1, q, k] (an expanded view)."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device).expand(batch, 1, queries, keys)


def causal_mask(batch: int, first: int, last: int, device) -> Tensor:
    """Bool [B, 1, q, last]: query column c ∈ [first, last) sees key columns ≤ c (keys are columns 0..last−1)."""
    rows = torch.arange(first, last, device=device)[:, None]
    return (torch.arange(last, device=device)[None, :] <= rows)[None, None].expand(batch, 1, -1, -1)


def join(a: KV | None, b: KV) -> KV:
    if a is None:
        return b
    return [(torch.cat([ka, kb], -2), torch.cat([va, vb], -2)) for (ka, va), (kb, vb) in zip(a, b)]


def cut(kv: KV, lo: int, hi: int | None = None) -> KV:
    return [(k[:, :, lo:hi], v[:, :, lo:hi]) for k, v in kv]


def _column_span(window: Tensor) -> tuple[int, int]:
    """First and one-past-last column any row's window covers (the whole canvas for an empty window)."""
    cols = window.any(dim=0).nonzero().flatten()
    return (int(cols[0]), int(cols[-1]) + 1) if len(cols) else (0, window.shape[1])


def _rows(lo: int, hi: int, shift: int) -> tuple[int, int, int]:
    """Model rows [r0, r1) that give the logits of columns [lo, hi) (column c reads row c − shift), and how
    many leading columns have no row (they read zeros, as `strategies.absorbing._shift` does)."""
    return max(lo - shift, 0), hi - shift, max(shift - lo, 0)


def _pad_front(logits: Tensor, missing: int) -> Tensor:
    if missing == 0:
        return logits
    return torch.cat([logits.new_zeros(logits.shape[0], missing, logits.shape[2]), logits], dim=1)


class _Counted:
    """Cost counters every decoder keeps: forwards and query positions forwarded."""

    forwards: int = 0
    positions: int = 0

    def count(self, queries: int) -> None:
        self.forwards += 1
        self.positions += queries


class CausalPrefix(_Counted):
    """Exact K/V of a causal pass over a growing sequence: each call forwards only the columns not yet kept."""

    def __init__(self, lm: nn.Module):
        self.lm, self.kv, self.ids = lm, None, None

    @property
    def length(self) -> int:
        return 0 if self.ids is None else self.ids.shape[1]

    def logits(self, x: Tensor, r0: int, r1: int, keep_to: int) -> Tensor:
        """Causal logits of rows [r0, r1) of `x`; afterwards the K/V of columns [0, keep_to) are kept
        (`keep_to` ≤ r1: only columns whose tokens are final)."""
        start = min(self.length, r0, keep_to)
        if start and not torch.equal(self.ids[:, :start], x[:, :start]):
            start = 0  # the kept tokens changed under us: recompute from scratch
        kv = None if start == 0 else cut(self.kv, 0, start)
        mask = causal_mask(x.shape[0], start, r1, x.device)
        keep = torch.arange(r0 - start, r1 - start, device=x.device)
        logits, fresh = forward_cached(self.lm, x[:, start:r1], start, kv, mask, keep)
        self.count(r1 - start)
        if keep_to > start:
            self.kv, self.ids = join(kv, cut(fresh, 0, keep_to - start)), x[:, :keep_to].clone()
        return logits

    def last_logits(self, context: Tensor) -> Tensor:
        """Next-token logits [B, 1, V] after `context` [B, L], keeping all of its K/V (the hybrid's seed)."""
        n = context.shape[1]
        return self.logits(context, n - 1, n, n)


class CausalDecoder(CausalPrefix):
    """Exact decoder for a causal denoiser (I-DLM, logit shift 1): the columns before the window are final,
    so their K/V are kept across steps and blocks; a step forwards only the window's rows, and nothing after
    it (a causal row never reads a later column)."""

    def __init__(self, lm: nn.Module, shift: int):
        super().__init__(lm)
        self.shift = shift

    def window(self, x: Tensor, window: Tensor):
        lo, hi = _column_span(window)
        r0, r1, missing = _rows(lo, hi, self.shift)
        return lambda canvas: (lo, _pad_front(self.logits(canvas, r0, r1, r0), missing))


class BidirectionalDecoder(_Counted):
    """Fast-dLLM's approximate caches (Wu et al. 2025, arXiv 2505.22618) over a bidirectional denoiser.

    A window's first step forwards the whole canvas (its logits equal the uncached ones) and keeps the K/V of
    the columns before the window ("prefix": later steps forward window + suffix) or before and after it
    ("dual": later steps forward the window only). The next window refreshes the cache. `kv` is what is kept."""

    def __init__(self, lm: nn.Module, mode: str, shift: int):
        self.lm, self.mode, self.shift = lm, mode, shift
        self.kv: KV | None = None
        self.span = (0, 0, 0, 0, 0)  # lo, hi, r0, r1, missing of the current window

    def window(self, x: Tensor, window: Tensor):
        lo, hi = _column_span(window)
        self.span, self.kv = (lo, hi, *_rows(lo, hi, self.shift)), None
        return self.step

    def step(self, canvas: Tensor) -> tuple[int, Tensor]:
        lo, _, r0, r1, missing = self.span
        batch, width = canvas.shape
        if self.kv is None:  # block start: the exact full forward; keep its K/V
            mask = visible_mask(batch, width, width, canvas.device)
            logits, fresh = forward_cached(self.lm, canvas, 0, None, mask, torch.arange(r0, r1, device=canvas.device))
            self.count(width)
            self.kv = cut(fresh, 0, r0) if self.mode == "prefix" else join(cut(fresh, 0, r0), cut(fresh, r1))
            return lo, _pad_front(logits, missing)
        q1 = width if self.mode == "prefix" else r1
        mask = visible_mask(batch, q1 - r0, width, canvas.device)
        keep = torch.arange(r1 - r0, device=canvas.device)
        logits, _ = forward_cached(self.lm, canvas[:, r0:q1], r0, self.kv, mask, keep)
        self.count(q1 - r0)
        return lo, _pad_front(logits, missing)


class ModelDenoiser:
    """A sampler `Denoiser` (`(x, attn) → logits`) that also knows its HF backbone, so a sampler can open a
    cached decoder on it (`open_decoder`). `attention` is how the denoiser attends: "bidirectional" or "causal"."""

    def __init__(self, call, lm: nn.Module, attention: str):
        self.call, self.lm, self.attention = call, lm, attention

    def __call__(self, x: Tensor, attn: Tensor | None) -> Tensor:
        return self.call(x, attn)


def bidirectional_denoiser(model: nn.Module, lm: nn.Module | None = None, call=None) -> ModelDenoiser:
    """The MDLM/LLaDA denoiser: `model_logits` (every position sees every position), cacheable on `lm`."""
    call = call or (lambda x, attn: model_logits(model, {"input_ids": x}))
    return ModelDenoiser(call, lm if lm is not None else model, "bidirectional")


def causal_denoiser(model: nn.Module) -> ModelDenoiser:
    """A plain causal pass (I-DLM decoding; the sampler applies the logit shift)."""
    return ModelDenoiser(lambda x, attn: model(input_ids=x, use_cache=False).logits, model, "causal")


def cacheable(lm: nn.Module | None) -> bool:
    """An HF causal LM the caches can drive (docs/decoding.md §3): K/V through `transformers.Cache`, masks
    passed as 4-D, no sliding-window layers, not a remote-code model attending on its own."""
    config = getattr(lm, "config", None)
    if not isinstance(lm, PreTrainedModel) or config is None:
        return False
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return False
    return getattr(config, "dllm_attention", BIDIRECTIONAL_MASK) == BIDIRECTIONAL_MASK


def open_decoder(denoise, config) -> CausalDecoder | BidirectionalDecoder | None:
    """The cached decoder `config.cache` asks for over `denoise`, or None (recompute every step)."""
    mode = check_cache_mode(config.cache)
    if mode == "none" or not isinstance(denoise, ModelDenoiser):
        return None
    if not cacheable(denoise.lm):
        if mode in APPROXIMATE:
            warnings.warn(
                f"cache={mode!r}: this model cannot be cached (docs/decoding.md §3); decoding uncached", stacklevel=3
            )
        return None
    if denoise.attention == "causal":
        return CausalDecoder(denoise.lm, config.logit_shift)
    return BidirectionalDecoder(denoise.lm, mode, config.logit_shift) if mode in APPROXIMATE else None


class EncoderCache(_Counted):
    """Exact encoder K/V of a `BlockDiffusionLM` (docs/strategies.md §9.5): the encoder is causal, so the
    context's K/V are computed once per block (not once per step) and a finished block only appends its own."""

    def __init__(self, model: nn.Module):
        self.model, self.kv, self.ids = model, None, None

    def extend(self, context: Tensor) -> KV:
        """The encoder K/V of `context` [1, P], forwarding only the columns not encoded yet."""
        n = context.shape[1]
        start = 0 if self.ids is None else self.ids.shape[1]
        if start and (start > n or not torch.equal(self.ids, context[:, :start])):
            start, self.kv = 0, None  # a different context: encode from scratch
        if start == n:
            return self.kv
        _, fresh = _run(
            self.model.backbone, context[:, start:], start, self.kv, causal_mask(1, start, n, context.device)
        )
        self.kv, self.ids = join(self.kv, fresh), context.clone()
        self.count(n - start)
        return self.kv
