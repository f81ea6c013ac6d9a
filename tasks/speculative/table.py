"""The report's speculative-decoding table (docs/evaluation.md §4.7): τ_sim against real τ with the gap flagged,
the context lookup's columns where some row decoded with it, τ at a sampling temperature, and each row's served-τ
notes (§4.7.1)."""

from __future__ import annotations

from strategies.dflash.dflash2_config import BACKBONE, WALK
from strategies.dflash.served_checks import served_notes
from tasks.common import fmt_number as _fmt

TAU_GAP = 0.15  # |τ_sim ÷ τ − 1| above this is flagged in the DFlash table


def dflash_table(spec_rows: list[dict]) -> list[str]:
    """The speculative-decoding table of the rows that have DFlash metrics (none: no table)."""
    if not spec_rows:
        return []
    ks = sorted({int(k.rsplit("k", 1)[1]) for r in spec_rows for k in r["metrics"] if k.startswith("dflash/acc_k")})
    lookup = any("dflash/tau_draft" in r["metrics"] for r in spec_rows)  # some row decoded with the context lookup
    extra = " dflash/tau_draft | dflash/lookup_share |" if lookup else ""
    lines = [
        "## Speculative decoding (DFlash)",
        "",
        f"| strategy | dflash/tau_sim | dflash/tau |{extra} τ_sim ÷ τ | dflash/speedup | dflash/exact_match | "
        + " | ".join(f"acc_k{k}" for k in ks)
        + " |",
        "|---|---|---|---|---|---|" + "---|---|" * lookup + "---|" * len(ks),
    ]
    gaps = []
    for r in spec_rows:
        line, gap = _row(r, ks, lookup)
        lines.append(line)
        gaps += [gap] if gap else []
    return lines + _gap_lines(gaps) + _sampled_and_tree_lines(spec_rows) + _notes(lookup)


def _row(r: dict, ks: list[int], lookup: bool) -> tuple[str, str | None]:
    """One strategy's row, and its τ_sim-vs-τ line when the two differ by more than `TAU_GAP`."""
    m = r["metrics"]
    # τ_sim is the draft's alone: it is set against the draft's own real τ when a lookup helped decode
    sim, real, alone = m.get("dflash/tau_sim"), m.get("dflash/tau"), m.get("dflash/tau_draft")
    own = alone if isinstance(alone, float) else real
    gap = sim / own if isinstance(sim, float) and isinstance(own, float) and own > 0 else None
    flag = " ⚠" if gap is not None and abs(gap - 1) > TAU_GAP else ""
    cells = f" {_fmt(alone, 3)} | {_fmt(m.get('dflash/lookup_share'), 2)} |" if lookup else ""
    line = (
        f"| {r['strategy']} | {_fmt(sim, 3)} | {_fmt(real, 3)} |{cells} {_fmt(gap, 2)}{flag} | "
        f"{_fmt(m.get('dflash/speedup'), 2)} | {_fmt(m.get('dflash/exact_match'), 2)} | "
        + " | ".join(_fmt(m.get(f"dflash/acc_k{k}"), 3) for k in ks)
        + " |"
    )
    return line, (f"- **{r['strategy']}**: τ_sim {sim:.2f} vs real τ {own:.2f}" if flag else None)


def _gap_lines(gaps: list[str]) -> list[str]:
    if not gaps:
        return []
    return [
        "",
        f"⚠ τ_sim and real τ differ by more than {TAU_GAP:.0%}. They measure different text: τ_sim is "
        "teacher-forced on held-out real text, real τ decodes the target's own continuations of held-out prompts. "
        "A draft trained on the target's regenerated text (dflash.regenerate, docs/strategies.md §10.7) has τ_sim "
        "well below τ by design; one trained on real text tends to the opposite. Real τ is the one that sets "
        "the speedup:",
        *gaps,
    ]


def _sampled_and_tree_lines(spec_rows: list[dict]) -> list[str]:
    """τ at a sampling temperature, τ with tree branches, and each row's served-τ notes (§4.7.1)."""
    lines: list[str] = []
    other = {WALK: "sampling its serial walk, as the engines do", BACKBONE: "proposing from its backbone"}
    at_t = [
        f"{r['strategy']} {m['dflash/tau_sampled']:.3f}"
        + "".join(
            f" ({said}: {m[f'dflash/tau_sampled_{k}']:.3f})"
            for k, said in other.items()
            if f"dflash/tau_sampled_{k}" in m
        )
        for r in spec_rows
        if "dflash/tau_sampled" in (m := r["metrics"])
    ]
    if at_t:
        lines += [
            "",
            "τ of speculative sampling at `dflash.eval_temperature` (§4.7 of docs/evaluation.md): " + ", ".join(at_t),
        ]
    trees = [tree_cell(r["strategy"], r["metrics"]) for r in spec_rows if "dflash/tau_tree" in r["metrics"]]
    if trees:
        lines += ["", f"τ with tree branches (docs/strategies.md §10.16; gain over τ paired, 95 %): {', '.join(trees)}"]
    confident = [
        confidence_cell(r["strategy"], r["metrics"]) for r in spec_rows if "dflash/confidence_ece" in r["metrics"]
    ]
    if confident:
        lines += ["", "A DSpark draft's confidence head (docs/evaluation.md §4.7.4): " + "; ".join(confident)]
    for r in spec_rows:  # served τ (docs/evaluation.md §4.7.1): what was measured, the interval, the causes found
        notes = served_notes(r["metrics"])
        lines += ["", f"**{r['strategy']}**, as served: " + notes[0], *notes[1:]] if notes else []
    return lines


def _notes(lookup: bool) -> list[str]:
    return [
        "",
        "`dflash/tau`: tokens committed per verification cycle in speculative decoding of held-out "
        "prompts (accepted draft prefix + the target's bonus token); `dflash/tau_sim` and `acc_k` are its "
        "teacher-forced proxy and per-offset accuracy; `dflash/speedup` = target-only greedy wall time ÷ "
        "speculative wall time on the same prompts, same run; `dflash/exact_match` = share of prompts whose "
        "speculative output equals target-only greedy decoding (must be 1)."
        + (
            " With `dflash.lookup_ngram`, `dflash/tau` decodes with the context lookup (proposals copied from "
            "where the last tokens recurred, docs/strategies.md §10.8), `dflash/tau_draft` with the draft alone on "
            "the same prompts, `dflash/lookup_share` = share of cycles whose proposals came from the lookup; "
            "τ_sim ÷ τ uses the draft's own τ."
            if lookup
            else ""
        ),
        "",
    ]


def tree_cell(strategy: str, m: dict) -> str:
    """`<strategy> τ_tree with K branches (gain [low, high])`, the report's tree line for one draft."""
    low, high = m["dflash/tau_tree_gain_low"], m["dflash/tau_tree_gain_high"]
    gain = f"{m['dflash/tau_tree_gain']:+.3f} [{low:+.3f}, {high:+.3f}]"
    return f"{strategy} {m['dflash/tau_tree']:.3f} with {int(m['dflash/tree_branches'])} branches ({gain})"


def confidence_cell(strategy: str, m: dict) -> str:
    """The confidence head's calibration and, per θ measured, τ and the target tokens verified per committed token."""
    auroc = m.get("dflash/confidence_auroc")
    cell = f"{strategy}: AUROC {'–' if auroc is None else f'{auroc:.3f}'}, ECE {m['dflash/confidence_ece']:.3f}"
    thetas = sorted(
        {k.split("_")[0][len("dflash/theta") :] for k in m if k.startswith("dflash/theta") and "_position_" not in k},
        key=float,
    )
    cuts = [
        f"θ {t}: τ {m[f'dflash/theta{t}_tau']:.2f}, {m[f'dflash/theta{t}_verified_per_token']:.2f} verified per token, "
        f"time × {m[f'dflash/theta{t}_time_ratio']:.2f}"
        for t in thetas
    ]
    return cell + (f" (whole blocks: {m['dflash/tau']:.2f}; " + "; ".join(cuts) + ")" if cuts else "")
