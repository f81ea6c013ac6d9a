"""The MLflow UI's first screen for a pipeline run: a saved chart view of its strategies' runs
(docs/architecture.md, the tracking contract: "The UI's first screen").

A view saved with the "Share" button of MLflow's experiment page is an experiment tag
`mlflow.sharedViewState.<key>` holding the view as JSON (the runs search, the chart sections and their
cards), and `viewStateShareKey=<key>` in the page's URL opens it. Left to itself the chart view makes one
section per metric prefix, sorted by name, so the one-off `eval/*` numbers came before `train/` and `val/`.
The view written here puts the learning curves first, then one bar chart per headline evaluation number
(a bar per strategy), and keeps every other metric in collapsed sections below: the per-budget
`eval_curve/*` curves and the rest stay one click away. Pure data and client calls: no MLflow import.
"""

from __future__ import annotations

import hashlib
import json

SHARE_TAG_PREFIX = "mlflow.sharedViewState."
FIRST_SECTION = "Learning curves, then evaluation (a bar per strategy)"
# the learning curves: one line per strategy, overlaid per metric
CURVE_KEYS = ("train/loss", "val/loss")
# the headline evaluation numbers (docs/evaluation.md): the likelihood (each strategy's bound, or the exact
# causal NLL), sample quality beside the held-out data's own row, and the cost in forward passes
HEADLINE_KEYS = (
    "eval/nelbo",
    "eval/ar_nll",
    "eval/gen_ppl",
    "eval/data_gen_ppl",
    "eval/entropy",
    "eval/data_entropy",
    "eval/nfe",
)
SYSTEM_PREFIX = "system/"
MAX_VIEW_CHARS = 20000  # MLflow's limit on an experiment tag's value


def section_name(key: str) -> str:
    """The section MLflow's chart view files a metric under: everything before the last '/'."""
    if key.startswith(SYSTEM_PREFIX):
        return "System metrics"
    return key.rsplit("/", 1)[0] if "/" in key else "Model metrics"


def _uuid(*parts: str) -> str:
    return "dllm-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _line(key: str, section: str) -> dict:
    return {
        "uuid": _uuid("line", key),
        "type": "LINE",
        "metricKey": key,
        "selectedMetricKeys": [key],
        "metricSectionId": section,
        "isGenerated": False,  # configured here: MLflow leaves its type alone when runs change
        "deleted": False,
        "runsCountToCompare": 10,
        "xAxisKey": "step",
        "scaleType": "linear",
        "useGlobalXaxisKey": True,
        "useGlobalLineSmoothing": True,
    }


def _bar(key: str, section: str) -> dict:
    return {
        "uuid": _uuid("bar", key),
        "type": "BAR",
        "metricKey": key,
        "metricSectionId": section,
        "isGenerated": False,
        "deleted": False,
        "runsCountToCompare": 10,
    }


def landing_view(run_ids: list[str], metric_steps: dict[str, int]) -> dict:
    """The saved view: the runs `run_ids` (none: every run) sorted by name, so they are laid out flat, not
    nested under their collapsed parent), then the chart sections. `metric_steps`: every metric key of those
    runs → its most logged points in any one run (a key logged once is a number: a bar chart)."""
    first = _uuid("section", FIRST_SECTION)
    charts = [_line(k, first) for k in CURVE_KEYS if k in metric_steps]
    charts += [_bar(k, first) for k in HEADLINE_KEYS if k in metric_steps]
    # two rows of cards 270 px high: below the page's header they fit a 1600 x 1000 window
    columns = max(4, -(-len(charts) // 2))
    sections = [
        {"uuid": first, "name": FIRST_SECTION, "display": True, "isReordered": True, "columns": columns},
    ]
    sections[0]["cardHeight"] = 270
    shown = set(CURVE_KEYS + HEADLINE_KEYS)
    rest: dict[str, list[str]] = {}
    for key in sorted(metric_steps):
        if key not in shown:
            rest.setdefault(section_name(key), []).append(key)
    for name in sorted(rest):  # below, collapsed: every other metric stays one click away
        uuid = _uuid("section", name)
        sections.append({"uuid": uuid, "name": name, "display": False, "isReordered": True})
        charts += [(_line if metric_steps[k] > 1 else _bar)(k, uuid) for k in rest[name]]
    view = {
        "orderByKey": "tags.`mlflow.runName`",
        "orderByAsc": True,
        "compareRunCharts": charts,
        "compareRunSections": sections,
        "isAccordionReordered": True,  # keep this order: MLflow re-sorts sections by name otherwise
        "runListHidden": True,
        "hideEmptyCharts": True,
    }
    if run_ids:
        view["searchFilter"] = "attributes.run_id IN ({})".format(", ".join(f"'{r}'" for r in run_ids))
    if len(json.dumps(view, separators=(",", ":"))) > MAX_VIEW_CHARS:
        # too many metrics for one tag: the collapsed sections keep their names and MLflow's chart view files
        # each missing metric's chart into the section of that name (docs/architecture.md, the tracking contract)
        view["compareRunCharts"] = [c for c in charts if c["metricSectionId"] == first]
    return view


def share_key(view: dict) -> str:
    """The view's key: its content hash (the same view is written once, under the same key)."""
    return "dllm-" + hashlib.sha256(json.dumps(view, sort_keys=True).encode()).hexdigest()[:20]


def metric_steps(client, run_ids: list[str]) -> dict[str, int]:
    """Every metric key of the runs → the most points any one of them logged for it."""
    steps: dict[str, int] = {}
    for run_id in run_ids:
        for key in client.get_run(run_id).data.metrics:
            points = len(client.get_metric_history(run_id, key))
            steps[key] = max(steps.get(key, 0), points)
    return steps


def save_landing_view(client, experiment_id: str, run_ids: list[str]) -> str:
    """Write the landing view of `run_ids` as a shared view of the experiment; returns its share key."""
    view = landing_view(run_ids, metric_steps(client, run_ids))
    key = share_key(view)
    client.set_experiment_tag(experiment_id, SHARE_TAG_PREFIX + key, json.dumps(view, separators=(",", ":")))
    return key
