"""The DFlash drafts of one workdir side by side (docs/strategies.md §10): every evaluated draft's greedy τ, τ of
speculative sampling at `dflash.eval_temperature`, served τ, a DSpark draft's confidence calibration and θ curve,
its parameters and seconds per training step, and each draft's greedy τ paired against the first listed (95 %
bootstrap over the evaluation's prompts). Reads the stages' outputs and the MLflow store; runs nothing.

    python benchmarks/draft_table.py WORKDIR [--baseline dflash]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.speculative.served import paired_bootstrap  # noqa: E402


def _draft(store: Path, train_key: str) -> dict:
    folder = store / "train" / train_key
    manifest = json.loads((folder / "manifest.json").read_text())
    config = json.loads((folder / "model" / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    variant = {"DFlash2DraftModel": "dflash2", "DSparkSpeculator": "dspark"}.get(arch, "dflash")
    if (config.get("dflash_config") or {}).get("projector_type") == "domino":
        variant = "domino"
    variant = "jetspec" if config.get("is_causal") else variant
    with safe_open(str(folder / "model" / "model.safetensors"), "pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    return {"variant": variant, "params": params, "run_id": manifest["info"]["mlflow_run_id"], "options": manifest}


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def _seconds_per_step(workdir: Path, run_id: str, tokens_per_step: int | None) -> float | None:
    """Median seconds of a training step (`train/tokens_per_s` is measured around the step alone: validation and
    the τ probe are outside it)."""
    from mlflow.tracking import MlflowClient

    from dllm_common.tracking import default_tracking_uri

    history = MlflowClient(default_tracking_uri(str(workdir))).get_metric_history(run_id, "train/tokens_per_s")
    if not history or not tokens_per_step:
        return None
    values = sorted(tokens_per_step / m.value for m in history)
    return values[len(values) // 2]


def rows(workdir: Path, tokens_per_step: int | None) -> list[dict]:
    store = workdir / "store"
    out = []
    for manifest in sorted((store / "evaluate").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime):
        ev = json.loads(manifest.read_text())
        folder = manifest.parent
        metrics = json.loads((folder / "metrics.json").read_text())
        bench = json.loads((folder / "speculative.json").read_text())
        draft = _draft(store, ev["upstream"]["train"])
        out.append(
            {
                **draft,
                "metrics": metrics,
                "bench": bench,
                "s_step": _seconds_per_step(workdir, draft["run_id"], tokens_per_step),
            }
        )
    return out


def _fmt(value, digits=2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir")
    ap.add_argument("--baseline", default="dflash", help="the variant the others are paired against")
    ap.add_argument("--tokens-per-step", type=int, default=None, help="global batch × seq_len (for s/step)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    table = rows(Path(args.workdir), args.tokens_per_step)
    base = next((r for r in table if r["variant"] == args.baseline), table[0])
    print("| draft | τ greedy | paired gain vs " + base["variant"] + " [95 %] | τ at T | served τ | confidence AUROC / "
          "ECE | parameters | s/step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        m, bench = r["metrics"], r["bench"]
        gain, low, high, _ = paired_bootstrap(base["bench"]["acceptance"], bench["acceptance"], args.seed)
        sampled = bench.get("sampled") or {}
        served = m.get("dflash/tau_served")
        skipped = m.get("dflash/served_skipped")
        cal = (bench.get("confidence") or {}).get("calibration") or {}
        conf = f"{_fmt(cal.get('auroc'), 3)} / {_fmt(cal.get('ece'), 3)}" if cal else "–"
        print(
            f"| {r['variant']} | {m['dflash/tau']:.2f} | {gain:+.2f} [{low:+.2f}, {high:+.2f}] | "
            f"{_fmt(sampled.get('tau'))} (T {sampled.get('temperature', '–')}) | "
            f"{_fmt(served) if served is not None else f'skipped ({skipped})'} | {conf} | {r['params']:,} | "
            f"{_fmt(r['s_step'], 3)} |"
        )
    for r in table:
        curve = (r["bench"].get("confidence") or {}).get("rows") or []
        if not curve:
            continue
        print(f"\nθ curve ({r['variant']}):")
        print(
            "| rule | θ | τ | τ gain [95 %] | verified/token | ÷ θ=0 [95 %] | time ÷ θ=0 [95 %] | target fwd | exact |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for c in curve:
            print(
                f"| {c.get('rule', 'product')} | {c['theta']:g} | {c['tau']:.2f} | {c['tau_gain']:+.2f} "
                f"[{c['tau_gain_low']:+.2f}, {c['tau_gain_high']:+.2f}] | {c['verified_per_token']:.3f} | "
                f"{c['verified_ratio']:.3f} [{c['verified_ratio_low']:.3f}, {c['verified_ratio_high']:.3f}] | "
                f"{c['time_ratio']:.3f} [{c['time_ratio_low']:.3f}, {c['time_ratio_high']:.3f}] | "
                f"{c['target_forwards']} | {c['exact_match']:.2f} |"
            )


if __name__ == "__main__":
    main()
