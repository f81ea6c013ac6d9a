"""What the evaluation of a chat-trained model adds (docs/post-training.md, "Evaluation"): how its samples end (the
EOS rate and the answer-length distribution; LLaDA's SFT notes the cost of EOS-filled rows is excess EOS at
inference) and, on a generated task (`data.source: task`), its accuracy on held-out problems with a bootstrap
interval, problem by problem so two checkpoints compare paired."""

from __future__ import annotations

import numpy as np

from dllm_common.config import PipelineSpec
from tasks.data.documents import document_score, val_threshold
from tasks.posttrain.families import Problem, check, iter_problems

RESAMPLES = 2000


def answer_stats(generated: list[list[int]], eos: int | None, prefix: str = "eval/") -> dict:
    """Over the raw generated ids (not cut at EOS): the share of generated positions that are EOS, the share of
    samples that end (hold an EOS), and the answer length (tokens before the first EOS) mean, median and 90th
    percentile."""
    if not generated:
        return {}
    lengths, eos_count, total = [], 0, 0
    for ids in generated:
        first = ids.index(eos) if eos is not None and eos in ids else len(ids)
        lengths.append(first)
        eos_count += sum(1 for t in ids if t == eos)
        total += len(ids)
    a = np.array(lengths, dtype=np.float64)
    return {
        f"{prefix}eos_rate": eos_count / max(total, 1),
        f"{prefix}ended": float(np.mean([eos is not None and eos in ids for ids in generated])),
        f"{prefix}answer_len_mean": float(a.mean()),
        f"{prefix}answer_len_p50": float(np.median(a)),
        f"{prefix}answer_len_p90": float(np.percentile(a, 90)),
    }


def bootstrap_mean(values: list[float], seed: int, resamples: int = RESAMPLES) -> tuple[float, float, float]:
    """The mean and its 95 % percentile-bootstrap interval."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), (resamples, len(v)))].mean(axis=1)
    return float(v.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def paired_difference(a: list[float], b: list[float], seed: int, resamples: int = RESAMPLES):
    """mean(b) − mean(a) over the same problems and its 95 % interval, problems resampled in pairs."""
    if len(a) != len(b):
        raise ValueError(f"paired scores need the same problems: {len(a)} and {len(b)}")
    return bootstrap_mean([y - x for x, y in zip(a, b)], seed, resamples)


def split_problems(spec: PipelineSpec) -> tuple[list[Problem], list[Problem]]:
    """The generated task's problems on each side of the split `prepare_data` made (same ids, same seed, same
    fraction): (training problems, held-out problems)."""
    cfg, t = spec.data, spec.data.task
    pairs = list(iter_problems(t.family, t.problems, cfg.seed, max_operand=t.max_operand, blanks=t.blanks))
    if cfg.max_documents:
        pairs = pairs[: cfg.max_documents]
    scores = np.array([document_score(doc_id, cfg.seed) for doc_id, _ in pairs])
    cut = val_threshold(scores, cfg.val_fraction)
    return [p for (_, p), s in zip(pairs, scores) if s > cut], [p for (_, p), s in zip(pairs, scores) if s <= cut]


def held_out_problems(spec: PipelineSpec, limit: int) -> list[Problem]:
    """The first `limit` held-out problems (`split_problems`): problems the model never trained on."""
    return split_problems(spec)[1][:limit]


def accuracy_metrics(problems: list[Problem], completions: list[str], seed: int) -> tuple[dict, list[dict]]:
    """eval/accuracy with its interval, and one row per problem (prompt, answer, completion, correct)."""
    correct = [float(check(p, c)) for p, c in zip(problems, completions)]
    acc, lo, hi = bootstrap_mean(correct, seed)
    rows = [
        {"prompt": p.prompt, "answer": p.answer, "completion": c, "correct": bool(k)}
        for p, c, k in zip(problems, completions, correct)
    ]
    return {"eval/accuracy": acc, "eval/accuracy_lo": lo, "eval/accuracy_hi": hi, "eval/problems": len(rows)}, rows
