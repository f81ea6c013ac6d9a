"""Stage `report`: one markdown table comparing every strategy of the pipeline run.

Written to the store, copied to `<workdir>/report.md` and logged to the parent MLflow run.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from dllm_common.store import atomic_write_text, stage_key
from tasks.common import StageRef, code_version, prefect_task, store_for

STAGE = "report"


def stage_of(pipeline_name: str, trained: list[StageRef], evaluated: list[StageRef], workdir: str, **_) -> tuple[str, str]:
    upstream = {r.stage: r.key for r in [*trained, *evaluated]}
    return STAGE, stage_key(STAGE, {"pipeline": pipeline_name}, upstream, code_version("tasks.report"))


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def render_report(pipeline_name: str, rows: list[dict]) -> str:
    """rows: {strategy, val_loss, nelbo, nelbo_se, ppl_bound, ar_nll, nfe, tokens_per_s, run_id, sample}."""
    lines = [f"# dllm-flow report: {pipeline_name}", "",
             "| strategy | val/loss | eval/nelbo ± se | eval/ppl_bound | eval/ar_nll | eval/nfe | eval/tokens_per_s "
             "| MLflow run |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {_fmt(r['val_loss'])} | {_fmt(r['nelbo'])} ± {_fmt(r['nelbo_se'])} | "
                     f"{_fmt(r['ppl_bound'], 1)} | {_fmt(r['ar_nll'])} | {_fmt(r['nfe'])} | {_fmt(r['tokens_per_s'], 1)} | {r['run_id']} |")
    lines += ["", "`eval/nelbo` is the fixed-noise negative ELBO per supervised token (nats); "
              "`eval/ppl_bound` = exp(nelbo) upper-bounds the perplexity; `eval/ar_nll` is an exact causal NLL "
              "(strategies with a causal path).", ""]
    for r in rows:
        lines += [f"## samples: {r['strategy']}", "", "```", r["sample"].strip(), "```", ""]
    return "\n".join(lines)


def report(pipeline_name: str, trained: list[StageRef], evaluated: list[StageRef], workdir: str,
           parent_run_id: str | None = None, tracking_uri: str | None = None, experiment: str | None = None) -> StageRef:
    store = store_for(workdir)
    stage, key = stage_of(pipeline_name, trained, evaluated, workdir)
    hit = store.lookup(stage, key)
    if hit is None:
        rows = []
        for t, e in zip(trained, evaluated):
            m = e.info["metrics"]
            rows.append({"strategy": t.stage.split("[")[1].rstrip("]"), "val_loss": t.info.get("final_val_loss"),
                         "nelbo": m.get("eval/nelbo"), "nelbo_se": m.get("eval/nelbo_se"),
                         "ppl_bound": m.get("eval/ppl_bound"), "ar_nll": m.get("eval/ar_nll"),
                         "nfe": m.get("eval/nfe"), "tokens_per_s": m.get("eval/tokens_per_s"),
                         "run_id": t.mlflow_run_id, "sample": (Path(e.path) / "samples.txt").read_text()})
        with store.publish(STAGE, key, {"rows": [{k: v for k, v in r.items() if k != "sample"} for r in rows]}) as tmp:
            (tmp / "report.md").write_text(render_report(pipeline_name, rows))
            (tmp / "report.json").write_text(json.dumps(rows, indent=2))
        hit = store.lookup(stage, key)
    atomic_write_text(Path(workdir) / "report.md", (hit.path / "report.md").read_text())
    if parent_run_id:
        from dllm_common.tracking import Tracking

        tracker = Tracking(Path(workdir), tracking_uri, experiment or pipeline_name).reopen(parent_run_id)
        tracker.log_artifact(hit.path / "report.md", "report")
    return StageRef(STAGE, key, str(hit.path), reused=False)


report_task = prefect_task(report, name="report", stage_of=stage_of)
