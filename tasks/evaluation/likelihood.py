"""What an evaluation works with and the likelihood metrics every strategy shares (docs/evaluation.md §4).

NELBO (§4.1): for each row, K stratified times t_k = (k + u)/K over the full range (0, 1), u seeded per
batch; the one-sample estimate (1/t)·Σ_{masked ∧ supervised} −log p_θ is averaged over k.
`eval/nelbo` = Σ_rows S_i / Σ_rows n_i (nats per supervised token) with the ratio estimator's standard
error; `eval/ppl_bound` = exp(nelbo) bounds the perplexity. Models with a causal path also report the
exact left-to-right NLL (`eval/ar_nll`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dllm_common.config import EvalConfig, PipelineSpec
from strategies.losses import causal_nll_rows
from strategies.options import resolve_options
from strategies.seeding import seeded_generator


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """What an evaluation reads: the trained model and its tokenizer, the validation rows, the scorer."""

    spec: PipelineSpec
    strategy: str
    model: torch.nn.Module
    tokenizer: object
    mask_id: int | None  # None: a strategy that uses no [MASK] token, given none
    ckpt: Path
    val: tuple  # (ids, loss_mask, attention_mask) of the first `eval.val_rows` validation rows
    device: str
    scorer: tuple | None
    val_documents: torch.Tensor | None = None  # packed rows: per-token document ids (DFlash's document mask)

    @property
    def options(self):
        return resolve_options(self.spec, self.strategy)


@dataclass
class EvalResult:
    strategy: object  # the assembled strategy (its sampler goes on the reproducibility card)
    metrics: dict
    curve: list
    samples: str
    files: dict = field(default_factory=dict)  # further artifacts, name → text


def ratio_with_se(sums: list[float], counts: list[int]) -> tuple[float, float]:
    """r = ΣS/Σn and its delta-method standard error over rows."""
    n = len(sums)
    total_n = sum(counts)
    r = sum(sums) / max(total_n, 1)
    if n < 2:
        return r, float("nan")
    mean_n = total_n / n
    var = sum((s - r * c) ** 2 for s, c in zip(sums, counts)) / (n * (n - 1))
    return r, math.sqrt(var) / mean_n


def fixed_noise_nelbo(strategy, model, rows, mask_token_id: int, settings: EvalConfig) -> tuple[float, float, int]:
    """The NELBO over `rows` = (ids, loss_mask) at `eval.t_samples` stratified times per row, noise seeded
    by `eval.seed` and the batch's start: the same realization for every model (docs/evaluation.md §4.1)."""
    ids, loss_mask = rows
    t_samples, batch_size, seed = settings.t_samples, settings.batch_size, settings.seed
    sums, counts = [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            x, lm = ids[start : start + batch_size], loss_mask[start : start + batch_size]
            gen = seeded_generator(seed * 1_000_003 + start, x.device)
            u = torch.rand(len(x), generator=gen, device=x.device)
            total = torch.zeros(len(x), device=x.device)
            for k in range(t_samples):
                t = ((k + u) / t_samples).clamp_min(1e-6)
                total += strategy.nelbo_rows(model, x, lm, mask_token_id, t, gen)
            sums.extend((total / t_samples).tolist())
            counts.extend(lm.sum(dim=1).long().tolist())
    nelbo, se = ratio_with_se(sums, counts)
    return nelbo, se, sum(counts)


def exact_ar_nll(strategy, model, ids, loss_mask, attention_mask, batch_size: int) -> tuple[float, float, int]:
    """Exact causal NLL per supervised token where the model has a causal path (I-DLM clean half)."""

    sums, counts = [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            sl = slice(start, start + batch_size)
            row_sums, row_counts = strategy.ar_nll_rows(model, ids[sl], loss_mask[sl], attention_mask[sl])
            sums.extend(row_sums.tolist())
            counts.extend(row_counts.long().tolist())
    nll, se = ratio_with_se(sums, counts)
    return nll, se, sum(counts)


def supervised_bytes(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> int:
    """UTF-8 bytes of the text the `mask`ed tokens spell, row by row (special tokens spell none)."""
    total = 0
    for row, keep in zip(ids.tolist(), mask.bool().tolist()):
        kept = [token for token, k in zip(row, keep) if k]
        if kept:
            total += len(tokenizer.decode(kept, skip_special_tokens=True).encode("utf-8"))
    return total


def bits_per_byte(nats_per_token: float, n_tokens: int, n_bytes: int) -> float:
    """A per-token likelihood in bits per byte of the scored text: comparable across tokenizers
    (docs/evaluation.md §4.1). NaN when the scored tokens spell no bytes."""
    return nats_per_token * n_tokens / (n_bytes * math.log(2)) if n_bytes else float("nan")


def ar_nll_metrics(nll: float, se: float, n_tokens: int) -> dict:
    """The exact causal NLL's metric names (the same for every model that has a causal path)."""
    return {"eval/ar_nll": nll, "eval/ar_nll_se": se, "eval/ar_ppl": math.exp(min(nll, 50.0)), "eval/tokens": n_tokens}


def encode_prompts(tokenizer, texts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt: through the chat template (with generation prompt) for dialogue models."""
    if chat:
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in texts
        ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


class CausalLM:
    """`exact_ar_nll` over a plain causal LM (e.g. the DFlash target)."""

    @staticmethod
    def ar_nll_rows(model, ids, loss_mask, attention_mask):
        return causal_nll_rows(
            model(input_ids=ids, attention_mask=attention_mask).logits, ids, loss_mask, attention_mask
        )
