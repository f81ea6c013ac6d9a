"""The data row (docs/evaluation.md §4.4): real held-out text, cut and scored exactly like the samples, so
every strategy's gen_ppl and entropy read against what the data itself scores."""

from __future__ import annotations

import math

from tasks.common import fmt_number as _fmt
from tasks.evaluation.scoring import gen_ppl_with_interval, mean_entropy, prompt_nll


def data_row_metrics(ev, prompts: list[list[int]]) -> dict:
    """The data row (docs/evaluation.md §4.4): held-out validation rows cut into a prompt as long as the
    eval prompts (median, in tokens) and the next `eval.sample_length` real tokens, scored exactly like the
    samples → `eval/data_gen_ppl` (± interval, with a scorer), `eval/data_entropy`, `eval/data_rows`.
    As many rows as `eval.data_rows` (rows too short for prompt + continuation are skipped)."""
    e, (ids, _, attn) = ev.spec.eval, ev.val
    width = sorted(len(p) for p in prompts)[len(prompts) // 2] if prompts else 1
    heads, tails = [], []
    for row, n in zip(ids.tolist(), attn.sum(dim=1).tolist()):
        if len(heads) == e.data_rows:
            break
        if n >= width + e.sample_length:
            heads.append(row[:width])
            tails.append(row[width : width + e.sample_length])
    if not heads:
        return {}
    metrics = {"eval/data_entropy": mean_entropy(tails), "eval/data_rows": len(heads)}
    if ev.scorer is not None:
        pairs = [(ev.tokenizer.decode(h), ev.tokenizer.decode(t)) for h, t in zip(heads, tails)]
        scored = gen_ppl_with_interval(*prompt_nll(*ev.scorer, pairs))
        metrics.update({f"eval/data_{k}": v for k, v in scored.items() if k != "gen_ppl_tokens"})
    return metrics


def _ppl_ci(m: dict, prefix: str) -> str:
    value, lo, hi = m.get(f"{prefix}gen_ppl"), m.get(f"{prefix}gen_ppl_lo"), m.get(f"{prefix}gen_ppl_hi")
    return _fmt(value, 2) + (f" [{_fmt(lo, 2)}, {_fmt(hi, 2)}]" if lo is not None and hi is not None else "")


def _ratio(value, reference) -> str:
    if (
        value is None
        or reference in (None, 0)
        or any(isinstance(v, float) and math.isnan(v) for v in (value, reference))
    ):
        return "–"
    return f"{value / reference:.2f}"


def _sampling_settings(row: dict) -> str:
    """How a row's samples were drawn, read from its reproducibility card: the settings its sampler reads
    (`sampler_settings`; a card from before it lists them: the absorbing sampler's)."""
    card = row.get("card", {})
    sampler = card.get("sampler", {})
    if not sampler:
        return "the eval settings"
    reads = set(card.get("sampler_settings", ("temperature", "top_k", "top_p", "remasking", "threshold")))
    said = [f"temperature {sampler.get('temperature')}"] if "temperature" in reads else []
    said += [f"top-p {sampler['top_p']}"] if "top_p" in reads and sampler.get("top_p", 1) < 1 else []
    said += [f"top-k {sampler['top_k']}"] if "top_k" in reads and sampler.get("top_k", 0) > 0 else []
    said += (
        [f"threshold {sampler['threshold']}"] if "threshold" in reads and sampler.get("threshold") is not None else []
    )
    said += [f"{sampler.get('remasking')} remasking"] if "remasking" in reads else []
    return ", ".join(said) or "the sampler's own settings"


def _shared_settings(rows: list[dict]) -> str:
    """The table's heading: the settings of the rows that set none of their own (`eval.overrides`)."""
    plain = [r for r in rows if not r.get("card", {}).get("sampler_overrides")] or rows
    settings = [_sampling_settings(r) for r in plain]
    return max(settings, key=settings.count)


def _label(row: dict, greedy: bool, heading: str) -> str:
    """The strategy, with the sampler settings it set itself (`eval.overrides`; at temperature 0 the greedy table's
    temperature is everyone's), or, where its sampler reads other settings than the heading names, those."""
    card = row.get("card", {})
    own = [k for k in card.get("sampler_overrides", []) if not (greedy and k == "temperature")]
    if not own:
        settings = _sampling_settings(row)
        return row["strategy"] if greedy or settings == heading else f"{row['strategy']} ({settings})"
    sampler = card.get("sampler", {})
    return f"{row['strategy']} ({', '.join(f'{k} {sampler.get(k)}' for k in own)})"


def _sample_lines(rows: list[dict], prefix: str, data_ppl, data_ent, heading: str) -> list[str]:
    lines = []
    for r in rows:
        m = r["metrics"]
        if f"{prefix}entropy" not in m:
            continue
        revised = m.get(f"{prefix}revised_tokens")
        lines.append(
            f"| {_label(r, prefix != 'eval/', heading)} | {_ppl_ci(m, prefix)} | "
            f"{_ratio(m.get(f'{prefix}gen_ppl'), data_ppl)} | {_fmt(m.get(f'{prefix}entropy'), 3)} | "
            f"{_ratio(m.get(f'{prefix}entropy'), data_ent)} | {_fmt(revised, 1) if revised is not None else '–'} |"
        )
    return lines


def data_row_table(rows: list[dict]) -> list[str]:
    """Every strategy's samples beside real held-out text scored the same way (docs/evaluation.md §4.4):
    first at the eval sampling settings, then (where evaluated) greedy."""
    with_data = [r for r in rows if "eval/data_entropy" in r["metrics"]]
    if not with_data:
        return []
    d = with_data[0]["metrics"]
    data_ppl, data_ent = d.get("eval/data_gen_ppl"), d["eval/data_entropy"]
    head = [
        "| | gen_ppl [95 % CI over prompts] | gen_ppl ÷ data | entropy | entropy ÷ data | tokens revised |",
        "|---|---|---|---|---|---|",
        f"| **data** ({int(d['eval/data_rows'])} held-out rows, real continuations) | "
        f"{_ppl_ci(d, 'eval/data_')} | 1.00 | {_fmt(data_ent, 3)} | 1.00 | – |",
    ]
    sampled = [r for r in rows if "eval/entropy" in r["metrics"]]
    heading = _shared_settings(sampled)
    lines = [f"## Samples against real text ({heading})", "", *head]
    lines += _sample_lines(rows, "eval/", data_ppl, data_ent, heading)
    greedy = _sample_lines(rows, "eval/greedy_", data_ppl, data_ent, heading)
    if greedy:
        lines += ["", "### Greedy decoding (temperature 0, same prompts and step budget)", "", *head, *greedy]
    return lines + [
        "",
        "The data row cuts held-out validation rows into a prompt as long as the eval prompts and the next "
        "`eval.sample_length` real tokens, scored by the same scorer: a model whose gen_ppl is far *below* the data "
        "row's with a lower entropy is repeating itself, not writing better than the data. `tokens revised`: "
        "generated tokens per sample that the sampler changed after first placing them (samplers that can).",
        "",
    ]
