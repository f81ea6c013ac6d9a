"""`dllm-flow ui`: the MLflow UI opens on every strategy's curves of the latest pipeline run (checked in a
headless Chromium, skipped where none is installed) and runs without MLflow's job runner; `--prefect`
points at the pipeline run's flow run; `export` reports its errors on one line."""

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


def _strategy_run(tracking, name: str, parent_id: str, offset: float) -> str:
    run = tracking.start_run(name, {"strategy": name, "dllm.stage": "train"}, parent_run_id=parent_id)
    for step in range(12):
        run.log_metrics({"train/loss": 5 - 0.3 * step + offset, "train/lr": 1e-3}, step)
        if step % 4 == 3:
            run.log_metrics({"val/loss": 5.2 - 0.25 * step + offset}, step)
    run.log_metrics({"eval/nelbo": 3.1 + offset, "eval/ppl_bound": 22.2 + offset}, 12)
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


def _session_commands(session: int) -> list[str]:
    """Command lines of the processes in a session (the `dllm-flow ui` process and what it started)."""
    commands = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            if proc.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[3]) == session:
                commands.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            continue
    return commands


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
        "--window-size=1600,2400",  # tall enough that every chart section is on screen and drawn
        "--virtual-time-budget=60000",  # virtual ms: the charts fetch their histories and draw
        *args,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def _visible_text(dom: str) -> str:
    """The page's text nodes joined by '|' (scripts and styles dropped)."""
    dom = re.sub(r"<(script|style)\b[^>]*>.*?</\1>", "", dom, flags=re.S)
    return re.sub(r"(\|\s*)+", "|", re.sub(r"<[^>]+>", "|", dom))


def _chart_sections(text: str) -> dict[str, str]:
    """Chart section name → its text, from each '|name|(count)|Add chart|' header to the next."""
    headers = list(re.finditer(r"\|([^|]+)\|\((\d+)\)\|Add chart\|", text))
    return {
        h.group(1): text[h.end() - 1 : headers[i + 1].start() + 1 if i + 1 < len(headers) else len(text)]
        for i, h in enumerate(headers)
    }


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)")
def test_mlflow_ui_lands_on_every_strategys_curves(two_pipeline_runs, tmp_path):
    workdir, tracking, runs = two_pipeline_runs
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
        url = re.search(r"MLflow UI for .*?: (\S+)", log.read_text()).group(1)
        assert url.startswith(f"http://127.0.0.1:{port}/#/experiments/{tracking.experiment_id}/runs?")
        commands = _session_commands(proc.pid)
        assert any("uvicorn" in c for c in commands), commands
        assert not [c for c in commands if "_job_runner" in c or "huey" in c], commands  # no job runner
        exp = tracking.client.get_experiment(tracking.experiment_id)
        assert exp.tags["mlflow.experimentKind"] == "custom_model_development"

        shot = tmp_path / "mlflow-landing.png"
        assert _chromium(url, tmp_path / "profile", f"--screenshot={shot}").returncode == 0
        dumped = _chromium(url, tmp_path / "profile", "--dump-dom")
        assert dumped.returncode == 0, dumped.stderr[-2000:]
        (tmp_path / "mlflow-landing.html").write_text(dumped.stdout)
        print(f"\nlanding page as Chromium saw it: {shot} (DOM: {tmp_path / 'mlflow-landing.html'})")
    finally:
        stop_group(proc)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = _visible_text(dumped.stdout)
    assert "|Model registry|" in text  # the model-training sidebar (the GenAI one has no registry link)
    assert "|2|matching runs|" in text  # the latest pipeline run's two strategies, laid out flat
    sections = _chart_sections(text)
    for prefix, charts in {
        "train": ("train/loss", "train/lr"),
        "val": ("val/loss",),
        "eval": ("eval/nelbo", "eval/ppl_bound"),
    }.items():
        section = sections[prefix]
        assert "No charts in this section" not in section, (prefix, section)
        for chart in charts:  # the chart's title and a legend entry per strategy: its lines are drawn
            assert f"|{chart}|" in section and f"|mdlm ({chart})|" in section and f"|scdd ({chart})|" in section
    assert "hybrid" not in text  # trained by the earlier pipeline run only


def test_landing_url_filters_the_latest_pipeline_runs_strategies(two_pipeline_runs):
    from flows.ui import landing_url, latest_strategy_runs

    _, tracking, runs = two_pipeline_runs
    ids = latest_strategy_runs(tracking.client, tracking.experiment_id)
    assert ids == [runs["mdlm"], runs["scdd"]]  # the reused mdlm run of the earlier pipeline run included
    url = landing_url("127.0.0.1", 5000, "7", ids)
    assert url.startswith("http://127.0.0.1:5000/#/experiments/7/runs?compareRunsMode=CHART&")
    assert "workflowType=machine_learning" in url and "orderByKey=tags.%60mlflow.runName%60" in url
    assert f"searchFilter=attributes.run_id%20IN%20%28%27{runs['mdlm']}%27%2C%20%27{runs['scdd']}%27%29" in url
    assert "searchFilter" not in landing_url("127.0.0.1", 5000, "7", [])


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

    record = RunRecord(run_id, "tiny", "configs/smoke.yaml", [], {}, "0" * 64, prefect_flow_run_id=flow_run_id)
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
