"""What every sampler shares (docs/strategies.md §11): its settings (`SamplerConfig`), its result
(`SampleResult`), the prompt canvas and per-row windows, the top-k / nucleus cut, EOS handling.

The samplers themselves: the absorbing [MASK] sampler in `strategies.absorbing`, each strategy's own in its
package (`strategies/<name>/sampling.py`); which strategy offers which is declared in its registration
(`strategies.registry.SAMPLERS` is the table derived from them). Pure of Prefect and MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from strategies.decoding_cache import check_cache_mode
from strategies.drawing import LOOKUP_MAX_NGRAM, draw  # noqa: F401 (draw: re-exported, the samplers' import)

Denoiser = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class SamplerConfig:
    steps: int = 128
    max_new_tokens: int = 128
    block_size: int = 32
    temperature: float = 0.0
    # at temperature > 0, draw only from the `top_k` most likely tokens (0: all) and from the smallest set
    # whose probability reaches `top_p` (nucleus sampling; 1.0: all) — docs/strategies.md §11.7
    top_k: int = 0
    top_p: float = 1.0
    remasking: str = "low_confidence"
    threshold: float | None = None
    eos_token_id: int | None = None
    logit_shift: int = 0
    # K/V reuse across steps (docs/decoding.md §5): "none", "exact" (causal parts only, tokens unchanged),
    # "prefix" / "dual" (also Fast-dLLM's approximate caches for bidirectional decoding)
    cache: str = "exact"
    # which of the strategy's samplers `DLLMStrategy.sample` runs ("auto": its first, see `samplers`)
    sampler: str = "auto"
    # speculative decoding only: propose from the context when its last n…4 tokens recur (0: off; §10.8)
    lookup_ngram: int = 0
    # speculative decoding at T > 0 only: what a DFlash 2 / Domino draft proposes from, "walk" (as the engines do) or
    # "backbone" (its one-pass distribution); None: the draft's default (docs/strategies.md §10.13)
    sampled_proposals: str | None = None
    # speculative decoding at T = 0 only: tree branches verified beside each block (0: one path; §10.16)
    tree_branches: int = 0
    # speculative decoding, a DSpark draft: cut each block where its predicted acceptance falls below θ (0: off; §10.17)
    confidence_threshold: float = 0.0
    # how θ cuts: "product" (the running product of predicted acceptances) or "position" (each one's own, DeepSpec's)
    confidence_rule: str = "product"

    def __post_init__(self) -> None:
        # each message names the field and its `dllm-flow generate` flag, so it reads right from either
        check_cache_mode(self.cache)
        if self.top_k < 0:
            raise ValueError(f"top_k (--top-k) must be ≥ 0 (0: all tokens); got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p (--top-p) must be in (0, 1] (1: no nucleus cut); got {self.top_p}")
        for name in ("steps", "max_new_tokens", "block_size"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} ({flag}) must be at least 1; got {getattr(self, name)}")
        if self.sampled_proposals not in (None, "walk", "backbone"):
            raise ValueError(
                f"sampled_proposals (--sampled-proposals) must be walk or backbone; got {self.sampled_proposals!r}"
            )
        if not 0 <= self.confidence_threshold < 1:
            raise ValueError(
                "confidence_threshold (--confidence-threshold) must be in [0, 1) (0: verify whole blocks); got "
                f"{self.confidence_threshold}"
            )
        if self.confidence_rule not in ("product", "position"):
            raise ValueError(
                f"confidence_rule (--confidence-rule) must be product or position; got {self.confidence_rule!r}"
            )
        if self.tree_branches < 0:
            raise ValueError(f"tree_branches (--tree-branches) must be ≥ 0 (0: one path); got {self.tree_branches}")
        if not 0 <= self.lookup_ngram <= LOOKUP_MAX_NGRAM:
            raise ValueError(
                f"lookup_ngram (--lookup-ngram) must be in 0..{LOOKUP_MAX_NGRAM} (0: off; the lookup matches "
                f"suffixes of at most {LOOKUP_MAX_NGRAM} tokens); got {self.lookup_ngram}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature (--temperature) must be ≥ 0 (0: greedy); got {self.temperature}")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise ValueError(f"threshold (--threshold) must be in (0, 1] (a confidence) or unset; got {self.threshold}")


@dataclass(frozen=True)
class SampleResult:
    tokens: Tensor  # [B, P_max + G] canvas (prompt left-aligned per row)
    prompt_lengths: list[int]
    prompt_width: int
    nfe: float  # denoiser forwards per sequence (a batched forward counts once; per-row loops are averaged)
    # generated tokens per sequence that a sampler able to revise (SCDD) changed after first placing them
    revised: float | None = None

    def generated(self, row: int) -> Tensor:
        start = self.prompt_lengths[row]
        return self.tokens[row, start : start + self.tokens.shape[1] - self.prompt_width]


def truncate(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """`logits` with every token outside the top-k and outside the nucleus set to −inf (docs/strategies.md §11.7).

    The nucleus is the smallest set of most likely tokens whose probability reaches `top_p`; the most likely
    token is always kept, ties at the cut are kept together. `top_k` 0 and `top_p` 1 return `logits` itself."""
    if top_k <= 0 and top_p >= 1:
        return logits
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        keep &= logits >= kth
    if top_p < 1:
        probs = torch.softmax(logits.float().masked_fill(~keep, -math.inf), dim=-1)
        sorted_p, _ = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the strictly more likely tokens
        cut = sorted_p.masked_fill(before >= top_p, math.inf).amin(dim=-1, keepdim=True)
        keep &= probs >= cut
    return logits.masked_fill(~keep, -math.inf)


Progress = Callable[[Tensor], None]  # called with the canvas after each finished block (streaming)


def prompt_canvas(
    prompts: list[list[int]], gen_len: int, mask_token_id: int, pad_token_id: int, eos_token_id: int | None, device
) -> tuple[Tensor, Tensor, list[int], int]:
    """Canvas [B, P_max + G] filled with EOS (or pad): row i is its prompt then G masks; attention on both."""
    width = max(len(p) for p in prompts)
    fill = eos_token_id if eos_token_id is not None else pad_token_id
    x = torch.full((len(prompts), width + gen_len), fill, dtype=torch.long, device=device)
    attn = torch.zeros_like(x)
    for i, p in enumerate(prompts):
        x[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        x[i, len(p) : len(p) + gen_len] = mask_token_id
        attn[i, : len(p) + gen_len] = 1
    return x, attn, [len(p) for p in prompts], width


def row_windows(x: Tensor, starts: list[int], lo: int, hi: int) -> Tensor:
    """Bool [B,T]: each row's own window [start + lo, start + hi)."""
    window = torch.zeros_like(x, dtype=torch.bool)
    for i, start in enumerate(starts):
        window[i, start + lo : start + hi] = True
    return window


def per_row_result(
    prompts: list[list[int]],
    generated: list[Tensor],
    config: SamplerConfig,
    pad_token_id: int,
    device,
    forwards: int,
) -> SampleResult:
    """The canvas of samplers that decode one row at a time: each prompt then what it generated, the
    rest EOS (or pad); NFE is the forwards per sequence. The canvas is `config.max_new_tokens` wide
    after the prompts."""
    gen_len, eos_token_id = config.max_new_tokens, config.eos_token_id
    fill = eos_token_id if eos_token_id is not None else pad_token_id
    out, _, starts, width = prompt_canvas(prompts, gen_len, fill, pad_token_id, eos_token_id, device)  # nothing masked
    for row, (start, ids) in enumerate(zip(starts, generated)):
        out[row, start : start + len(ids)] = ids
    return SampleResult(out, starts, width, forwards / len(prompts))


def all_rows_ended(x: Tensor, starts: list[int], eos: int, mask: int) -> bool:
    """Every row has generated an EOS with no mask before it: whatever follows is moot."""
    for row in (x[i, start:] for i, start in enumerate(starts)):
        hits = (row == eos).nonzero()
        if not len(hits) or (row[: int(hits[0])] == mask).any():
            return False
    return True


def trim_at_eos(tokens: Tensor, eos_token_id: int | None) -> list[int]:
    ids = tokens.tolist()
    if eos_token_id is not None and eos_token_id in ids:
        ids = ids[: ids.index(eos_token_id)]
    return ids
