"""`dllm-flow ui`: the MLflow UI's first screen holds the latest pipeline run's learning curves and its
evaluation numbers (read from the page in a headless Chromium, skipped where none is installed; `make install
CHROMIUM=1` installs Debian's) and runs without MLflow's job runner; `--prefect` points at the pipeline run's
flow run, whose page shows the graph, the logs and the report artifact; `export` reports its errors on one line."""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
from conftest import ROOT, free_port, stop_group, wait_http

CHROMIUM = shutil.which("chromium")


def cli_here(capsys, *args) -> tuple[int, str, str]:
    """`dllm-flow ARGS` in this process, with the environment it sets undone afterwards."""
    from flows.cli import main

    capsys.readouterr()
    with mock.patch.dict(os.environ), contextlib.chdir(ROOT):
        code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------------------------------- MLflow UI


# what one evaluation logs once (a number each) and per step budget (a curve), as tasks/evaluate.py names them
ONE_OFF = ("eval/nelbo", "eval/nelbo_se", "eval/ppl_bound", "eval/gen_ppl", "eval/gen_ppl_hi", "eval/entropy")
ONE_OFF += ("eval/nfe", "eval/tokens_per_s", "eval/data_gen_ppl", "eval/data_entropy", "eval/data_rows")


def _strategy_run(tracking, name: str, parent_id: str, offset: float) -> str:
    run = tracking.start_run(name, {"strategy": name, "dllm.stage": "train"}, parent_run_id=parent_id)
    for step in range(12):
        run.log_metrics({"train/loss": 5 - 0.3 * step + offset, "train/lr": 1e-3}, step)
        if step % 4 == 3:
            run.log_metrics({"val/loss": 5.2 - 0.25 * step + offset}, step)
    run.log_metrics({k: 3.1 + i + offset for i, k in enumerate(ONE_OFF)}, 12)
    for budget in (4, 8):
        run.log_metrics({"eval_curve/gen_ppl": 40 - budget + offset, "eval_curve/nfe": budget}, budget)
    run.close()
    return run.run_id


@pytest.fixture
def two_pipeline_runs(tmp_path):
    """A workdir's MLflow store as two pipeline runs leave it: the first trained mdlm and hybrid, the
    latest trained scdd and reused the first one's mdlm (its report compares mdlm and scdd)."""
    from dllm_common.tracking import Tracking

    tracking = Tracking(tmp_path, None, "tiny")
    first = tracking.start_run("tiny-r1", {"dllm.pipeline": "tiny", "dllm.pipeline_run_id": "r1"})
    mdlm = _strategy_run(tracking, "mdlm", first.run_id, 0.0)
    _strategy_run(tracking, "hybrid", first.run_id, 0.6)
    first.close()
    time.sleep(0.01)  # distinct start times: r2 is the latest
    latest = tracking.start_run("tiny-r2", {"dllm.pipeline": "tiny", "dllm.pipeline_run_id": "r2"})
    scdd = _strategy_run(tracking, "scdd", latest.run_id, 0.3)
    compared = [{"strategy": "mdlm", "run_id": mdlm}, {"strategy": "scdd", "run_id": scdd}]
    latest.set_tags({"dllm.report_runs": json.dumps(compared)})
    latest.close()
    return tmp_path, tracking, {"mdlm": mdlm, "scdd": scdd}


def _session_commands(pid: int) -> list[str]:
    """Command lines of the `dllm-flow ui` process and of everything it started (the server runs in a session of
    its own, tests/servers/test_ui_signals.py)."""
    import psutil

    commands = []
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            commands.append(" ".join(proc.cmdline()))
        except psutil.Error:
            continue
    return commands


WINDOW = "1600,1000"  # the first screen: what a 1600 x 1000 window shows before any scrolling


def _chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--window-size={WINDOW}",
        "--virtual-time-budget=60000",  # virtual ms: the page fetches its data and draws
        *args,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def _look(url: str, tmp_path: Path, name: str) -> str:
    """A screenshot (kept beside the test's files, for a person to look at) and the page's text."""
    shot = tmp_path / f"{name}.png"
    assert _chromium(url, tmp_path / "profile", f"--screenshot={shot}").returncode == 0
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dumped = _chromium(url, tmp_path / "profile", "--dump-dom")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    (tmp_path / f"{name}.html").write_text(dumped.stdout)
    print(f"\n{name} as Chromium saw it: {shot} (DOM: {tmp_path / name}.html)")
    return _visible_text(dumped.stdout)


def _visible_text(dom: str) -> str:
    """The page's text nodes joined by '|' (scripts and styles dropped)."""
    dom = re.sub(r"<(script|style)\b[^>]*>.*?</\1>", "", dom, flags=re.S)
    return re.sub(r"(\|\s*)+", "|", re.sub(r"<[^>]+>", "|", dom))


def _chart_sections(text: str) -> list[tuple[str, str]]:
    """(section name, its text) in page order, from each '|name|(count)|Add chart|' header to the next."""
    headers = list(re.finditer(r"\|([^|]+)\|\((\d+)\)\|Add chart(?=\|)", text))
    return [
        (h.group(1), text[h.end() : headers[i + 1].start() + 1 if i + 1 < len(headers) else len(text)])
        for i, h in enumerate(headers)
    ]


def _first_screen(text: str, metric_keys) -> tuple[list[str], str]:
    """The first section's chart titles in page order (a title is a metric key alone between separators),
    and the section's text."""
    name, section = _chart_sections(text)[0]
    from dllm_common.landing import FIRST_SECTION

    assert name == FIRST_SECTION, _chart_sections(text)
    titles = [t for t in section.split("|") if t in metric_keys]
    return titles, section


def _serve_ui(workdir: Path, tmp_path: Path):
    """`dllm-flow ui` on a free port, in its own session: (process, printed URL)."""
    port = free_port()
    log = tmp_path / "ui.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "ui", "--workdir", str(workdir), "--port", str(port)],
        cwd=ROOT,
        start_new_session=True,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log, seconds=180)
    except BaseException:
        stop_group(proc)
        raise
    return proc, re.search(r"MLflow UI for .*?: (\S+)", log.read_text()).group(1), port


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium; make install CHROMIUM=1)"
)
def test_mlflow_ui_first_screen_two_strategies(two_pipeline_runs, tmp_path):
    workdir, tracking, runs = two_pipeline_runs
    proc, url, port = _serve_ui(workdir, tmp_path)
    try:
        assert url.startswith(f"http://127.0.0.1:{port}/#/experiments/{tracking.experiment_id}/runs?")
        commands = _session_commands(proc.pid)
        assert any("uvicorn" in c for c in commands), commands
        assert not [c for c in commands if "_job_runner" in c or "huey" in c], commands  # no job runner
        exp = tracking.client.get_experiment(tracking.experiment_id)
        assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
        text = _look(url, tmp_path, "mlflow-two-strategies")
    finally:
        stop_group(proc)
    assert "|Model registry|" in text  # the model-training sidebar (the GenAI one has no registry link)
    assert "hybrid" not in text  # trained by the earlier pipeline run only
    keys = {k for r in runs.values() for k in tracking.client.get_run(r).data.metrics}
    titles, section = _first_screen(text, keys)
    assert titles == [
        "train/loss",
        "val/loss",
        "eval/nelbo",
        "eval/gen_ppl",
        "eval/data_gen_ppl",
        "eval/entropy",
        "eval/data_entropy",
        "eval/nfe",
    ]
    for curve in ("train/loss", "val/loss"):  # drawn: a legend entry per strategy
        assert f"|mdlm ({curve})|" in section and f"|scdd ({curve})|" in section
    bars = section.split("|eval/nelbo|", 1)[1]
    assert bars.count("|mdlm|") == bars.count("|scdd|") == 6  # a bar per strategy in each evaluation chart
    assert "No charts in this section" not in section
    # every other metric below, in collapsed sections: the per-budget curves, the rest of the numbers
    rest = _chart_sections(text)[1:]
    assert [(name, body.count("|Step|")) for name, body in rest] == [("eval", 0), ("eval_curve", 0), ("train", 0)]
    assert "|eval|(5)|" in text and "|eval_curve|(2)|" in text and "|train|(1)|" in text


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium; make install CHROMIUM=1)"
)
def test_mlflow_ui_first_screen_one_strategy(undisturbed, tmp_path):
    """The smoke pipeline's run (one strategy, as the quickstart): what `dllm-flow ui` opens on."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{undisturbed / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id], "tags.strategy = 'mdlm'")
    proc, url, _ = _serve_ui(undisturbed, tmp_path)
    try:
        text = _look(url, tmp_path, "mlflow-one-strategy")
    finally:
        stop_group(proc)
    titles, section = _first_screen(text, set(run.data.metrics))
    # the smoke config has no scorer: no gen_ppl; the entropy of the samples beside the held-out data's
    assert titles == ["train/loss", "val/loss", "eval/nelbo", "eval/entropy", "eval/data_entropy", "eval/nfe"]
    assert "|mdlm (train/loss)|" in section and "|mdlm (val/loss)|" in section
    assert section.split("|eval/nelbo|", 1)[1].count("|mdlm|") == 4  # a bar in each evaluation chart
    assert [name for name, _ in _chart_sections(text)[1:]] == ["eval", "eval_curve", "train"]


def test_the_landing_view_puts_curves_then_numbers_first(two_pipeline_runs):
    from dllm_common.landing import FIRST_SECTION, SHARE_TAG_PREFIX, landing_view, save_landing_view
    from flows.ui import landing_url, latest_strategy_runs

    _, tracking, runs = two_pipeline_runs
    ids = latest_strategy_runs(tracking.client, tracking.experiment_id)
    assert ids == [runs["mdlm"], runs["scdd"]]  # the reused mdlm run of the earlier pipeline run included
    key = save_landing_view(tracking.client, tracking.experiment_id, ids)
    view = json.loads(tracking.client.get_experiment(tracking.experiment_id).tags[SHARE_TAG_PREFIX + key])
    assert view["searchFilter"] == f"attributes.run_id IN ('{runs['mdlm']}', '{runs['scdd']}')"
    assert view["orderByKey"] == "tags.`mlflow.runName`" and view["isAccordionReordered"] is True
    sections = {s["uuid"]: s for s in view["compareRunSections"]}
    charts = [(sections[c["metricSectionId"]]["name"], c["type"], c["metricKey"]) for c in view["compareRunCharts"]]
    first = [(kind, k) for name, kind, k in charts if name == FIRST_SECTION]
    assert first[:2] == [("LINE", "train/loss"), ("LINE", "val/loss")]
    assert first[2:] == [("BAR", k) for k in ("eval/nelbo", "eval/gen_ppl", "eval/data_gen_ppl", "eval/entropy")] + [
        ("BAR", "eval/data_entropy"),
        ("BAR", "eval/nfe"),
    ]
    assert ("eval_curve", "LINE", "eval_curve/gen_ppl") in charts  # per budget: still a curve
    assert ("eval", "BAR", "eval/ppl_bound") in charts  # measured once: a number, below
    assert [s["display"] for s in view["compareRunSections"]] == [True, False, False, False]  # the rest collapsed
    assert (view["compareRunSections"][0]["columns"], view["compareRunSections"][0]["cardHeight"]) == (4, 270)
    both = landing_view([], {"train/loss": 9, "val/loss": 3, "eval/ar_nll": 1} | {k: 1 for k in ONE_OFF})
    assert both["compareRunSections"][0]["columns"] == 5  # nine charts: still two rows
    many = landing_view(["r"] * 3, {"train/loss": 9} | {f"lm_eval/t{i}/acc": 1 for i in range(200)})
    assert len(json.dumps(many, separators=(",", ":"))) < 20000  # what MLflow keeps in an experiment tag
    assert [c["metricKey"] for c in many["compareRunCharts"]] == ["train/loss"] and len(
        many["compareRunSections"]
    ) == 201
    assert save_landing_view(tracking.client, tracking.experiment_id, ids) == key  # the same view, the same key
    assert landing_view([], {"train/loss": 3})["compareRunCharts"][0]["metricKey"] == "train/loss"
    assert "searchFilter" not in landing_view([], {})
    url = landing_url("127.0.0.1", 5000, "7", key)
    assert url == (
        "http://127.0.0.1:5000/#/experiments/7/runs?compareRunsMode=CHART&workflowType=machine_learning"
        f"&viewStateShareKey={key}"
    )
    assert "searchFilter" not in url and "viewStateShareKey" not in landing_url("127.0.0.1", 5000, "7", None)


def test_an_existing_experiment_is_marked_a_training_experiment(tmp_path):
    from mlflow.tracking import MlflowClient

    from dllm_common.tracking import Tracking, default_tracking_uri

    client = MlflowClient(default_tracking_uri(tmp_path))
    created = client.create_experiment("by-hand")  # untagged, as before the tag existed
    assert "mlflow.experimentKind" not in client.get_experiment(created).tags
    assert Tracking(tmp_path, None, "by-hand").experiment_id == created
    assert client.get_experiment(created).tags["mlflow.experimentKind"] == "custom_model_development"
    client.set_experiment_tag(created, "mlflow.experimentKind", "genai_development")  # a kind someone chose
    Tracking(tmp_path, None, "by-hand")
    assert client.get_experiment(created).tags["mlflow.experimentKind"] == "genai_development"


# ---------------------------------------------------------------------------------------- Prefect UI


def _record(workdir: Path, run_id: str, flow_run_id: str, started_at: float) -> None:
    from dllm_common.runs import RunRecord

    record = RunRecord(
        run_id=run_id,
        pipeline="tiny",
        config_path="configs/smoke.yaml",
        overrides=[],
        config={},
        config_sha256="0" * 64,
        prefect_flow_run_id=flow_run_id,
    )
    record.started_at, record.status, record.pid = started_at, "COMPLETED", None
    record.save(workdir)


def test_prefect_ui_prints_the_flow_run_graph_url(tmp_path, capsys, monkeypatch):
    _record(tmp_path, "r1", "11111111-1111-4111-8111-111111111111", 1.0)
    _record(tmp_path, "r2", "22222222-2222-4222-8222-222222222222", 2.0)
    _record(tmp_path, "r3", "", 0.5)  # run outside Prefect
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4321/api")  # a configured server: reused
    monkeypatch.delenv("PREFECT_UI_URL", raising=False)
    code, out, _ = cli_here(capsys, "ui", "--prefect", "--workdir", str(tmp_path))
    assert code == 0
    assert out.strip() == (
        "Prefect UI for pipeline run r2: http://127.0.0.1:4321/runs/flow-run/22222222-2222-4222-8222-222222222222"
    )
    code, out, _ = cli_here(capsys, "ui", "--prefect", "r1", "--workdir", str(tmp_path))
    assert code == 0 and out.strip().endswith("/runs/flow-run/11111111-1111-4111-8111-111111111111")
    code, _, err = cli_here(capsys, "ui", "--prefect", "r3", "--workdir", str(tmp_path))
    assert code == 2 and err.strip() == "dllm-flow: error: pipeline run r3 recorded no Prefect flow run"
    code, _, err = cli_here(capsys, "ui", "--prefect", "nope", "--workdir", str(tmp_path))
    assert code == 2 and "no pipeline run 'nope'" in err
    code, _, err = cli_here(capsys, "ui", "--prefect", "--workdir", str(tmp_path / "empty"))
    assert code == 2 and "no pipeline runs in" in err


def _page_text(url: str, tmp_path: Path, name: str) -> tuple[str, str]:
    """(the page's DOM, its text), with a screenshot beside it."""
    text = _look(url, tmp_path, name)
    return (tmp_path / f"{name}.html").read_text(), text


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium; make install CHROMIUM=1)"
)
def test_prefect_ui_shows_the_flow_runs_graph_logs_and_report(undisturbed, prefect_api, tmp_path, capsys, monkeypatch):
    import urllib.request

    from dllm_common.runs import list_records

    monkeypatch.setenv("PREFECT_API_URL", prefect_api)  # the server the pipeline ran against: its UI
    monkeypatch.delenv("PREFECT_UI_URL", raising=False)
    code, out, _ = cli_here(capsys, "ui", "--prefect", "--workdir", str(undisturbed))
    assert code == 0
    url = out.strip().split(": ", 1)[1]
    flow_run_id = list_records(undisturbed)[-1].prefect_flow_run_id
    assert url == f"{prefect_api.removesuffix('/api')}/runs/flow-run/{flow_run_id}"

    dom, text = _page_text(url, tmp_path, "prefect-flow-run")
    assert "Can't connect to Server API" not in text
    assert "|Completed|" in text and "|Logs|" in text and "|Artifacts|" in text
    # the graph: drawn on a canvas from the flow run's graph, which holds every stage
    assert re.search(r'class="run-graph flow-run-graph__graph[^"]*"', dom) and "<canvas" in dom
    with urllib.request.urlopen(f"{prefect_api}/flow_runs/{flow_run_id}/graph-v2", timeout=30) as answer:
        graph = json.loads(answer.read())
    nodes = {node["label"] for _, node in graph["nodes"]}
    assert {"prepare_data", "train[mdlm]", "evaluate[mdlm]", "report"} <= nodes, nodes
    assert [a["key"] for a in graph["artifacts"]] == ["dllm-report-smoke"]  # shown on the graph's timeline
    # the logs tab (open by default): the stages' lines and where the report went
    assert "|prepare_data: started|" in text and "|train[mdlm]: started|" in text
    assert "published as Prefect artifact dllm-report-smoke|" in text

    # the report artifact's own page renders the report
    request = urllib.request.Request(
        f"{prefect_api}/artifacts/filter",
        data=json.dumps(
            {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": ["dllm-report-smoke"]}}}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        (artifact,) = json.loads(answer.read())
    _, report = _page_text(
        f"{prefect_api.removesuffix('/api')}/artifacts/artifact/{artifact['id']}", tmp_path, "prefect-report"
    )
    assert "|dllm-flow report: smoke|" in report and "|eval/nelbo ± se|" in report and "|mdlm|" in report


# ---------------------------------------------------------------------------------------- export


def test_export_errors_are_one_line(tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "file").write_text("x")
    code, _, err = cli_here(capsys, "export", str(tmp_path / "no-such-checkpoint"), str(out))
    assert code == 2 and err.startswith("dllm-flow: error: ") and "already exists" in err and err.count("\n") == 1
    code, _, err = cli_here(capsys, "export", str(tmp_path / "no-such-checkpoint"), str(tmp_path / "new"))
    assert code == 2 and err.startswith("dllm-flow: error: ") and err.count("\n") == 1
    assert not (tmp_path / "new").exists()
