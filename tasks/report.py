"""Stage `report`: the strategies of one pipeline run side by side, rendered from MLflow alone.

The parent MLflow run records, per strategy, the trained model's run and the folder of the
evaluation it compared (tag `dllm.report_runs`); everything else (the evaluation's metrics,
quality-vs-NFE curve, reproducibility card and samples, the val/loss history) is read back from
there, so `dllm-flow report RUN_ID` re-renders the same report on any machine that can reach the
tracking store. Output: `report.md` (comparison table, curve table,
comparability flags, samples) and PNGs (training curves, NELBO with error bars, generative perplexity
vs entropy, quality vs NFE), written to the store, copied to the workdir and logged to the parent run.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import MissingContextError

from dllm_common.store import MANIFEST, atomic_write_text, stage_key
from dllm_common.tracking import Tracking
from tasks.common import StageRef, prefect_task, stage_code_version, store_for
from tasks.common import fmt_number as _fmt
from tasks.evaluate import RESULT_FIELDS, eval_artifact_path
from tasks.evaluation.data_row import data_row_table
from tasks.speculative.table import dflash_table
from tasks.stages import Roles, Stage, declarations, report_columns

STAGE = "report"
RUNS_TAG = "dllm.report_runs"
EVALUATION_PREFIXES = ("eval", "dflash/", "idlm/")  # metrics an evaluation logs into the trained model's run
PLOTS = ("training_curves.png", "nelbo.png", "genppl_vs_entropy.png", "quality_vs_nfe.png")


def stage_of(
    pipeline_name: str,
    trained: list[StageRef],
    evaluated: list[StageRef],
    workdir: str,
    reported: dict | None = None,
    **_,
) -> tuple[str, str]:
    """`reported`: the refs of the stages the graph puts before the report for their report columns (by role;
    `tasks.stages.Stage.report_columns`): a new result in one of them renders the report again."""
    extra = [r for refs in (reported or {}).values() for r in (refs if isinstance(refs, list) else [refs])]
    upstream = {r.stage: r.key for r in [*trained, *evaluated, *extra]}
    # the report renders from the trainings' MLflow runs: a training rebuilt in a new run is reported again
    config = {"pipeline": pipeline_name, "runs": [t.mlflow_run_id for t in trained]}
    return STAGE, stage_key(STAGE, config, upstream, stage_code_version(__name__))


# ---------------------------------------------------------------------------------------- collect


def collect_rows(client, runs: list[dict]) -> list[dict]:
    """One row per `{strategy, run_id, eval_artifacts}`: the evaluation's own metrics and artifacts
    (its folder in the trained model's run) and the run's val/loss history and final value."""
    rows = []
    for item in runs:
        run = client.get_run(item["run_id"])
        history = sorted((h.step, h.value) for h in client.get_metric_history(item["run_id"], "val/loss"))
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(client.download_artifacts(item["run_id"], item.get("eval_artifacts", "eval"), tmp))
            artifacts = {
                name: (local / name).read_text() if (local / name).is_file() else None
                for name in ("metrics.json", "curve.json", "repro_card.json", "samples.txt")
            }
        # the training side: an evaluation's own keys come from its metrics.json alone, so a key an earlier
        # evaluation of the same run logged (e.g. dflash/tau_draft, with the context lookup) never leaks in
        m = {k: v for k, v in run.data.metrics.items() if not k.startswith(EVALUATION_PREFIXES)}
        if artifacts["metrics.json"]:
            m.update(json.loads(artifacts["metrics.json"]))
        else:  # an evaluation logged before per-evaluation folders: the run's latest values
            m = dict(run.data.metrics)
        rows.append(
            {
                "strategy": item["strategy"],
                "run_id": item["run_id"],
                "metrics": m,
                "val_history": history,
                "curve": json.loads(artifacts["curve.json"]) if artifacts["curve.json"] else [],
                "card": json.loads(artifacts["repro_card.json"]) if artifacts["repro_card.json"] else {},
                "samples": artifacts["samples.txt"] or "",
            }
        )
    return rows


# ---------------------------------------------------------------------------------------- comparability


def _flat(card: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in card.items():
        if isinstance(v, dict) and k != "scorer":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True)
    return out


def card_mismatches(rows: list[dict]) -> dict[str, list[tuple[str, str, str]]]:
    """strategy → [(field, its value, the majority value)] for every result-changing field that differs.

    The majority over the rows' cards is the reference; a row without a card is flagged as such. Sampler settings
    a strategy sets itself (`eval.overrides`, its card's `sampler_overrides`) differ by design and are not flagged."""
    flats = {r["strategy"]: _flat(r["card"]) for r in rows}
    own = {r["strategy"]: {f"sampler.{k}" for k in r["card"].get("sampler_overrides", [])} for r in rows}
    flags: dict[str, list[tuple[str, str, str]]] = {}
    for field in RESULT_FIELDS:
        values = {s: f.get(field, "missing") for s, f in flats.items() if field not in own[s]}
        if not values:
            continue
        majority = Counter(values.values()).most_common(1)[0][0]
        for strategy, value in values.items():
            if value != majority:
                flags.setdefault(strategy, []).append((field, value, majority))
    return flags


# ---------------------------------------------------------------------------------------- render


def _pm(m: dict, key: str) -> str:
    if key not in m:
        return "–"
    return f"{_fmt(m[key])} ± {_fmt(m.get(key + '_se'))}"


def render_markdown(title: str, rows: list[dict], flags: dict, plots: list[str]) -> str:
    lines = [f"# dllm-flow report: {title}", ""]
    lines += _comparison_table(rows, flags)
    lines += data_row_table(rows)
    lines += _flag_lines(flags)
    lines += dflash_table([r for r in rows if "dflash/tau" in r["metrics"]])
    lines += _curve_table(rows)
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    for r in rows:
        lines += [f"## samples: {r['strategy']}", "", "```", r["samples"].strip(), "```", ""]
    return "\n".join(lines)


# the comparison table's likelihood columns: (header, cell) for the rows' metrics, per likelihood
_LIKELIHOOD_COLUMNS = {
    "eval/nelbo": [
        ("eval/nelbo ± se", lambda m: _pm(m, "eval/nelbo")),
        ("bits/byte", lambda m: _fmt(m.get("eval/nelbo_bpb"))),
        ("eval/ppl_bound", lambda m: _fmt(m.get("eval/ppl_bound"), 1)),
    ],
    "eval/ar_nll": [
        ("eval/ar_nll ± se", lambda m: _pm(m, "eval/ar_nll")),
        ("bits/byte", lambda m: _fmt(m.get("eval/ar_nll_bpb"))),
    ],
}
_LIKELIHOOD_NOTES = {
    "eval/nelbo": "`eval/nelbo` is the fixed-noise negative ELBO per supervised token (nats; each strategy's own "
    "bound), `eval/ppl_bound` = exp(nelbo) upper-bounds the perplexity.",
    "eval/ar_nll": "`eval/ar_nll` is an exact causal NLL.",
}
BYTES_NOTE = (
    "bits/byte = the likelihood beside it over the UTF-8 bytes of the scored text (comparable across tokenizers)."
)


def _comparison_table(rows: list[dict], flags: dict) -> list[str]:
    """One row per strategy; a likelihood's columns only where some strategy reports it."""
    shown = [key for key in LIKELIHOODS if any(key in r["metrics"] for r in rows)]
    columns = [
        ("strategy", lambda r: r["strategy"] + (" ⚠" if r["strategy"] in flags else "")),
        ("sampler", lambda r: r["card"].get("sampler_name", "–")),
        ("val/loss (own objective)", lambda r: _fmt(r["metrics"].get("val/loss"))),
        *[(head, lambda r, cell=cell: cell(r["metrics"])) for key in shown for head, cell in _LIKELIHOOD_COLUMNS[key]],
        ("eval/gen_ppl", lambda r: _fmt(r["metrics"].get("eval/gen_ppl"), 2)),
        ("eval/entropy", lambda r: _fmt(r["metrics"].get("eval/entropy"), 3)),
        ("eval/nfe", lambda r: _fmt(r["metrics"].get("eval/nfe"), 1)),
        ("eval/tokens_per_forward", lambda r: _fmt(r["metrics"].get("eval/tokens_per_forward"), 2)),
        ("eval/tokens_per_s", lambda r: _fmt(r["metrics"].get("eval/tokens_per_s"), 1)),
        *_declared_columns(rows),
        ("MLflow run", lambda r: r["run_id"]),
    ]
    lines = ["| " + " | ".join(head for head, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(cell(r)) for _, cell in columns) + " |" for r in rows]
    notes = [
        "`val/loss` is each strategy's own training objective (not comparable across rows).",
        *[_LIKELIHOOD_NOTES[key] for key in shown],
        *([BYTES_NOTE] if shown else []),
        "`eval/gen_ppl` scores the samples with a frozen causal LM (retokenized); read it together with "
        "`eval/entropy` (unigram, nats): low entropy flatters gen_ppl.",
    ]
    return [*lines, "", " ".join(notes), ""]


def _declared_columns(rows: list[dict]) -> list[tuple[str, object]]:
    """The columns declared stages add (`Stage.report_columns`), where some row has the metric."""
    return [
        (c.header, lambda r, c=c: _fmt(r["metrics"].get(c.metric), c.digits))
        for c in report_columns()
        if any(c.metric in r["metrics"] for r in rows)
    ]


def _flag_lines(flags: dict) -> list[str]:
    if not flags:
        return []
    lines = ["## ⚠ Not compared silently: reproducibility cards differ on result-changing fields", ""]
    for strategy, items in flags.items():
        for field, value, ref in items:
            lines.append(f"- **{strategy}**: `{field}` = {value} (others: {ref})")
    return lines + [""]


def _curve_table(rows: list[dict]) -> list[str]:
    """The quality-vs-NFE table (header only when some row has a curve), then a blank line."""
    lines = []
    if any(r["curve"] for r in rows):
        lines += [
            "## Quality vs NFE",
            "",
            "| strategy | steps | eval/nfe | tokens/forward | gen_ppl | entropy | tokens/s |",
            "|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        for p in r["curve"]:
            lines.append(
                f"| {r['strategy']} | {p['steps']} | {_fmt(p.get('nfe'), 1)} | "
                f"{_fmt(p.get('tokens_per_forward'), 2)} | {_fmt(p.get('gen_ppl'), 2)} | {_fmt(p.get('entropy'), 3)} | "
                f"{_fmt(p.get('tokens_per_s'), 1)} |"
            )
    return lines + [""]


def render_plots(rows: list[dict], out: Path) -> list[str]:
    """The four PNGs; a plot with nothing to show (e.g. no scorer → no gen_ppl) is left out."""
    have_ppl = any(
        p.get("gen_ppl") == p.get("gen_ppl") and p.get("gen_ppl") is not None for r in rows for p in r["curve"]
    )
    plots = [(PLOTS[0], _plot_training_curves)]
    if any(key in r["metrics"] for r in rows for key in LIKELIHOODS):  # strategies without a likelihood: no plot
        plots.append((PLOTS[1], _plot_likelihood))
    if have_ppl:
        plots.append((PLOTS[2], _plot_frontier))
    if any(r["curve"] for r in rows):  # (DFlash evaluates by acceptance length, not by a step budget)
        plots.append((PLOTS[3], lambda ax, rows: _plot_quality_vs_nfe(ax, rows, have_ppl)))
    written = []
    for name, draw in plots:
        fig = Figure(figsize=(7, 4))  # no pyplot: no GUI backend, no global figure registry
        draw(fig.subplots(), rows)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        written.append(name)
    return written


def _plot_training_curves(ax, rows: list[dict]) -> None:
    for r in rows:
        if r["val_history"]:
            ax.plot(*zip(*r["val_history"]), label=r["strategy"], marker=".")
    ax.set(xlabel="step", ylabel="val/loss (own objective)", title="Training curves", yscale="log")
    ax.legend()


LIKELIHOODS = ("eval/nelbo", "eval/ar_nll")  # the metrics of `DLLMStrategy.likelihoods` ("nelbo", "ar_nll")


def _plot_likelihood(ax, rows: list[dict]) -> None:
    names = [r["strategy"] for r in rows]
    for offset, key, label in ((-0.15, LIKELIHOODS[0], "NELBO (bound)"), (0.15, LIKELIHOODS[1], "exact AR NLL")):
        xs = [i + offset for i, r in enumerate(rows) if key in r["metrics"]]
        ys = [r["metrics"][key] for r in rows if key in r["metrics"]]
        es = [1.96 * r["metrics"].get(key + "_se", 0.0) for r in rows if key in r["metrics"]]
        if xs:
            ax.errorbar(xs, ys, yerr=es, fmt="o", capsize=4, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel="nats / supervised token", title="Likelihood (95% CI)")
    ax.legend()


def _plot_frontier(ax, rows: list[dict]) -> None:
    for r in rows:
        pts = [(p["entropy"], p["gen_ppl"], p["nfe"]) for p in r["curve"] if p.get("gen_ppl") is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=r["strategy"])
            for e, g, n in pts:
                ax.annotate(f"{n:g}", (e, g), fontsize=7)
    ax.set(
        xlabel="unigram entropy (nats)",
        ylabel="generative perplexity",
        yscale="log",
        title="Generative frontier (labels: NFE)",
    )
    ax.legend()


def _plot_quality_vs_nfe(ax, rows: list[dict], have_ppl: bool) -> None:
    key = "gen_ppl" if have_ppl else "entropy"
    for r in rows:
        pts = sorted((p["nfe"], p[key]) for p in r["curve"] if p.get(key) is not None)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=r["strategy"])
    ax.set(xlabel="NFE (forwards per sequence)", ylabel=key, xscale="log", title=f"Quality vs NFE ({key})")
    if have_ppl:
        ax.set_yscale("log")
    ax.legend()


def render_from_mlflow(client, parent_run_ids: str | list[str], out: Path) -> Path:
    """Write report.md, report.json and the PNGs for one or more parent runs into `out` (from MLflow alone).
    Several pipeline runs (e.g. one DFlash draft per loss) become one table; a strategy that appears more than
    once is labelled with the training parameters that tell its runs apart."""
    ids = [parent_run_ids] if isinstance(parent_run_ids, str) else list(parent_run_ids)
    if len(ids) == 1:
        return render_runs(client, *_runs_of(client, ids[0]), out)
    runs, titles = [], []
    for parent_id in ids:
        these, title = _runs_of(client, parent_id)
        runs += these
        titles.append(title)
    return render_runs(client, _labelled(client, runs), " + ".join(dict.fromkeys(titles)), out)


def _labelled(client, runs: list[dict]) -> list[dict]:
    """Runs of one strategy that occur more than once get `strategy (param=value, …)` from the training
    parameters on which they differ (the MLflow run id's head when none does)."""
    by_name: dict[str, list[dict]] = {}
    for r in runs:
        by_name.setdefault(r["strategy"], []).append(r)
    out = []
    for r in runs:
        same = by_name[r["strategy"]]
        if len(same) == 1:
            out.append(r)
            continue
        params = [client.get_run(x["run_id"]).data.params for x in same]
        differing = [k for k in _differing(params) if not _bookkeeping(k)]
        options = [k for k in differing if k.startswith("options.")]  # the strategy's resolved options say it best
        mine = params[same.index(r)]
        shown = [f"{k.removeprefix('options.')}={mine.get(k)}" for k in (options or differing)][:3]
        out.append({**r, "strategy": f"{r['strategy']} ({', '.join(shown) or r['run_id'][:8]})"})
    return out


def _differing(params: list[dict]) -> list[str]:
    return sorted(k for k in set().union(*params) if len({p.get(k) for p in params}) > 1)


def _bookkeeping(key: str) -> bool:
    """Parameters that differ between any two runs without saying how they differ (ids, keys, paths)."""
    return key.startswith(("mlflow.", "dllm.run")) or key.endswith(("key", "_id", "run_id")) or ".path" in key


def _runs_of(client, parent_run_id: str) -> tuple[list[dict], str]:
    """The evaluated strategies of one pipeline run's parent MLflow run, and the pipeline's name."""
    parent = client.get_run(parent_run_id)
    runs = json.loads(parent.data.tags.get(RUNS_TAG, "[]"))
    if not runs:  # a pipeline run from before the tag: its child runs, in creation order
        children = client.search_runs(
            [parent.info.experiment_id],
            f"tags.mlflow.parentRunId = '{parent_run_id}'",
            order_by=["attributes.start_time ASC"],
        )
        runs = [{"strategy": c.data.tags.get("strategy", c.info.run_name), "run_id": c.info.run_id} for c in children]
    if not runs:
        raise FileNotFoundError(f"MLflow run {parent_run_id} has no evaluated strategies to report")
    return runs, parent.data.tags.get("dllm.pipeline", parent.info.run_name)


def render_runs(client, runs: list[dict], title: str, out: Path) -> Path:
    """report.md, report.json and the PNGs for `runs` (`report_runs` entries), read from MLflow."""
    rows = collect_rows(client, runs)
    out.mkdir(parents=True, exist_ok=True)
    plots = render_plots(rows, out)
    (out / "report.md").write_text(render_markdown(title, rows, card_mismatches(rows), plots))
    (out / "report.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k != "samples"} for r in rows], indent=2)
    )
    return out / "report.md"


def report_runs(trained: list[StageRef], evaluated: list[StageRef]) -> list[dict]:
    """Per strategy: the trained model's MLflow run and the folder of the evaluation being compared."""
    return [
        {
            "strategy": t.stage.split("[")[1].rstrip("]"),
            "run_id": t.mlflow_run_id,
            "eval_artifacts": eval_artifact_path(e.key),
        }
        for t, e in zip(trained, evaluated)
    ]


def report(
    pipeline_name: str,
    trained: list[StageRef],
    evaluated: list[StageRef],
    workdir: str,
    tracking_uri: str | None = None,
    experiment: str | None = None,
    reported: dict | None = None,
) -> StageRef:
    """Render the report into the store (cached by the upstream keys) from the strategies' MLflow runs.
    `publish_report` then tags the parent run and hands the report to the workdir and the parent,
    for reused reports too; `dllm-flow report RUN_ID` renders the same runs again from that tag."""
    runs = report_runs(trained, evaluated)
    missing = [r["strategy"] for r in runs if not r["run_id"]]
    if missing:
        raise ValueError(f"the report renders from MLflow, but train[{', '.join(missing)}] has no MLflow run")
    stage, key = stage_of(pipeline_name, trained, evaluated, workdir, reported)

    def build(tmp: Path) -> dict:
        client = Tracking(Path(workdir), tracking_uri, experiment or pipeline_name).client
        render_runs(client, runs, pipeline_name, tmp)
        return {"runs": runs}

    entry, reused = store_for(workdir).reuse_or_build(stage, key, build)
    return StageRef(STAGE, key, str(entry.path), reused=reused)


@dataclass(frozen=True)
class ParentRun:
    """The pipeline's parent MLflow run, where the report is tagged and logged."""

    run_id: str
    tracking_uri: str | None
    experiment: str


def publish_report(
    ref: StageRef, trained: list[StageRef], evaluated: list[StageRef], workdir: str, parent: ParentRun
) -> None:
    """Tag the parent run with what it compared, copy report.md and the PNGs into the workdir
    (atomically) and log them to the parent run."""
    tracking = Tracking(Path(workdir), parent.tracking_uri, parent.experiment)
    tracking.client.set_tag(parent.run_id, RUNS_TAG, json.dumps(report_runs(trained, evaluated)))
    path = Path(ref.path)
    atomic_write_text(Path(workdir) / "report.md", (path / "report.md").read_text())
    for png in path.glob("*.png"):
        tmp_png = Path(workdir) / f".{png.name}.tmp"
        shutil.copyfile(png, tmp_png)
        tmp_png.replace(Path(workdir) / png.name)
    for f in sorted(path.iterdir()):
        if f.suffix in (".md", ".png", ".json") and f.name != MANIFEST:
            tracking.client.log_artifact(parent.run_id, str(f), "report")


def report_artifact_key(pipeline_name: str) -> str:
    """Prefect artifact keys take lowercase letters, digits and dashes."""
    return "dllm-report-" + (re.sub(r"[^a-z0-9]+", "-", pipeline_name.lower()).strip("-") or "pipeline")


def publish_report_artifact(report_md: Path, pipeline_name: str, run_id: str, wd: Path, parent_run_id: str) -> None:
    """The report as a markdown artifact of the flow run (its Artifacts tab in the Prefect UI). Its plots
    are files beside report.md, which the Prefect UI cannot show: they are named by their paths instead."""
    text = re.sub(r"!\[[^\]]*\]\(([^)]+)\)", lambda m: f"- `{wd / m.group(1)}`", report_md.read_text())
    create_markdown_artifact(
        markdown=text,
        key=report_artifact_key(pipeline_name),
        description=(
            f"dllm-flow report of pipeline run {run_id} ({pipeline_name}); "
            f"MLflow parent run {parent_run_id}; {wd / 'report.md'}"
        ),
    )
    try:
        log = get_run_logger()
    except MissingContextError:
        log = logging.getLogger("dllm_flow")
    log.info("report: %s, published as Prefect artifact %s", wd / "report.md", report_artifact_key(pipeline_name))


def _publish(ref: StageRef, refs: dict, ctx) -> dict:
    """After the report stage ran (or was reused): the parent run's tag and files, the workdir's copy, the Prefect
    artifact; the flow's result names the report."""
    spec = ctx.spec
    parent = ParentRun(ctx.parent_run_id, spec.tracking.uri, spec.tracking.experiment or spec.pipeline.name)
    publish_report(ref, refs["trained"], refs["evaluated"], ctx.workdir, parent)
    report_md = Path(ref.path) / "report.md"
    publish_report_artifact(report_md, spec.pipeline.name, ctx.run_id, Path(ctx.workdir), ctx.parent_run_id)
    return {"report": str(report_md)}


def _consumes(_spec, _strategy) -> dict:
    """Every strategy's training and evaluation, and the results of every stage that adds report columns."""
    reported = tuple(dict.fromkeys(s.produces for s in declarations() if s.report_columns))
    return {"trained": "trained", "evaluated": "evaluated", "reported": Roles(reported, optional=True)}


report_task = prefect_task(report, name="report", stage_of=stage_of)
DECLARATION = Stage(
    name=STAGE, task=report_task, produces="report", consumes=_consumes, leader_only=True, after=_publish
)
