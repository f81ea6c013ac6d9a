"""End to end through the CLI: smoke pipeline → MLflow lineage → cached rerun → eval-only rerun → bad input."""

import json
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT
from runkit import cli, latest_record
from stagekit import expected_statuses

pytestmark = pytest.mark.slow


def cli_here(capsys, *args, workdir=None):
    """The same CLI entry point, in this process: for commands that neither boot Prefect nor train, this
    skips the seconds of imports a fresh interpreter pays."""
    import contextlib
    from types import SimpleNamespace

    from flows.cli import main

    capsys.readouterr()
    with contextlib.chdir(ROOT):
        code = main([*args] + (["--workdir", str(workdir)] if workdir else []))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def stage_status(record):
    return {s["name"]: s["status"] for s in record["stages"]}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("smoke")
    out = cli("run", "configs/smoke.yaml", workdir=workdir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return workdir, out


def test_first_run_executes_every_stage(smoke_run):
    workdir, out = smoke_run
    assert set(stage_status(latest_record(workdir)).values()) == {"COMPLETED"}
    assert "| mdlm |" in (workdir / "report.md").read_text()
    assert "train[mdlm]" in out.stderr or "train[mdlm]" in out.stdout  # progress bar / stage line


def test_mlflow_lineage(smoke_run):
    from mlflow.tracking import MlflowClient

    from dllm_common.tracking import default_tracking_uri

    workdir, _ = smoke_run
    client = MlflowClient(default_tracking_uri(workdir), registry_uri=default_tracking_uri(workdir))
    exp = client.get_experiment_by_name("smoke")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 1
    parent, child = parents[0], children[0]
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.data.tags["strategy"] == "mdlm"
    for tag in ("dllm.config_sha256", "dllm.git_commit", "dllm.prefect_flow_run_id"):
        assert parent.data.tags[tag], tag
    assert len(parent.data.tags["dllm.config_sha256"]) == 64
    assert parent.data.params["train.steps"] == "30" and child.data.params["train.lr"] == "0.003"
    steps = [m.step for m in client.get_metric_history(child.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(30))
    for key in ("train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss", "eval/nelbo", "eval/ppl_bound"):
        assert key in child.data.metrics, key
    assert len(client.get_metric_history(child.info.run_id, "val/loss")) == 3
    dataset = child.inputs.dataset_inputs[0].dataset
    assert dataset.digest and dataset.name.startswith("smoke-")
    model_files = {f.path for f in client.list_artifacts(child.info.run_id, "model")}
    assert {"model/model.safetensors", "model/config.json", "model/tokenizer.json", "model/digests.json"} <= model_files
    (folder,) = client.list_artifacts(child.info.run_id, "eval")  # one folder per evaluation
    assert [f.path.split("/")[-1] for f in client.list_artifacts(child.info.run_id, folder.path)] == [
        "curve.json",
        "metrics.json",
        "repro_card.json",
        "samples.txt",
    ]
    for key in ("eval/entropy", "eval/nfe", "eval/tokens_per_forward", "eval/tokens_per_s"):
        assert key in child.data.metrics, key
    nfe_steps = [m.step for m in client.get_metric_history(child.info.run_id, "eval_curve/nfe")]
    assert len(nfe_steps) >= 2  # the quality-vs-NFE curve: one point per step budget
    version = client.get_model_version_by_alias("smoke-mdlm", "latest")
    assert version.run_id == child.info.run_id
    report_files = {f.path for f in client.list_artifacts(parent.info.run_id, "report")}
    assert {
        "report/report.md",
        "report/report.json",
        "report/training_curves.png",
        "report/nelbo.png",
        "report/quality_vs_nfe.png",
    } <= report_files


def test_runs_command_lists_stages(smoke_run, capsys):
    workdir, _ = smoke_run
    out = cli_here(capsys, "runs", workdir=workdir)
    assert out.returncode == 0 and "train[mdlm]" in out.stdout and "mlflow_run=" in out.stdout


def test_generate_streams_from_the_registry_and_the_store_alike(smoke_run, capsys):
    workdir, _ = smoke_run
    args = ("--prompt", "To be", "--steps", "8", "--max-new-tokens", "16", "--block-size", "8", "--seed", "3")
    by_alias = cli_here(capsys, "generate", "--checkpoint", "models:/smoke-mdlm@latest", *args, workdir=workdir)
    assert by_alias.returncode == 0, by_alias.stderr[-2000:]
    assert by_alias.stdout.startswith("[Prompt 0] To be\n")
    assert "NFE 8, " in by_alias.stderr and "tokens/s" in by_alias.stderr
    # the echoed settings are those the sampler reads (tasks.commands.generate.settings_line)
    assert "(mdlm, sampler llada, steps 8, temperature " in by_alias.stderr and ", seed 3)" in by_alias.stderr
    entry = next((workdir / "store" / "train").glob("*/model"))
    by_path = cli_here(capsys, "generate", "--checkpoint", str(entry.parent), *args, workdir=workdir)
    assert by_path.returncode == 0 and by_path.stdout == by_alias.stdout  # same weights, same seed, same text
    wrong = cli_here(capsys, "generate", "--checkpoint", str(entry), "--sampler", "scdd", *args, workdir=workdir)
    assert wrong.returncode == 2 and "does not fit a mdlm checkpoint" in wrong.stderr
    missing = cli_here(capsys, "generate", "--checkpoint", "models:/no-such-model@latest", *args, workdir=workdir)
    assert missing.returncode == 2 and "not found in the MLflow registry" in missing.stderr


def test_report_rerenders_from_mlflow_alone(smoke_run, tmp_path, capsys):
    workdir, _ = smoke_run
    run_id = latest_record(workdir)["run_id"]
    out = cli_here(capsys, "report", run_id, "--out", str(tmp_path / "r"), workdir=workdir)
    assert out.returncode == 0, out.stderr[-2000:]
    table = lambda text: [ln for ln in text.splitlines() if ln.startswith("| mdlm")]  # noqa: E731
    assert table((tmp_path / "r" / "report.md").read_text()) == table((workdir / "report.md").read_text())
    assert table(out.stdout)
    for png in ("training_curves.png", "nelbo.png", "quality_vs_nfe.png"):
        assert (tmp_path / "r" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (workdir / png).is_file()
    # published entries are immutable: --out into one (or anywhere in the store) is refused, nothing written
    from dllm_common.store import StageEntry, Store

    published = next((workdir / "store" / "report").glob("*/manifest.json")).parent
    for target in (published, published / "sub", workdir / "store" / "elsewhere"):
        refused = cli_here(capsys, "report", run_id, "--out", str(target), workdir=workdir)
        assert (
            refused.returncode == 2 and "which is never written to; choose another output directory" in refused.stderr
        )
        assert not (workdir / "store" / "elsewhere").exists() and not (published / "sub").exists()
    entry = StageEntry("report", published.name, published)
    assert Store(workdir / "store").verify(entry) == []


def flow_run_logs_and_artifacts(api: str, flow_run_id: str) -> tuple[list[str], list]:
    """The messages a flow run logged to the Prefect API (its Logs tab) and its artifacts (its Artifacts tab)."""
    import asyncio
    from uuid import UUID

    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    async def read():
        async with PrefectClient(api) as client:
            logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(flow_run_id)])))
            flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[UUID(flow_run_id)]))
            return [log.message for log in logs], await client.read_artifacts(flow_run_filter=flow_runs)

    return asyncio.run(read())


def test_rerun_reuses_everything_then_eval_change_reruns_only_eval(smoke_run, capsys, prefect_api):
    workdir, _ = smoke_run
    again = cli("run", "configs/smoke.yaml", workdir=workdir, api=prefect_api)
    assert again.returncode == 0, again.stderr[-3000:]
    assert set(stage_status(latest_record(workdir)).values()) == {"REUSED"}
    assert "train[mdlm]: reused" in again.stdout
    logs, _ = flow_run_logs_and_artifacts(prefect_api, latest_record(workdir)["prefect_flow_run_id"])
    reuse = [m for m in logs if m.startswith("train[mdlm]: reused")]  # the reuse decision, in the Logs tab
    assert reuse and "key=" in reuse[0] and "; reused " in reuse[0]
    first_run, first_report = latest_record(workdir)["run_id"], (workdir / "report.md").read_text()
    changed = cli("run", "configs/smoke.yaml", "--set", "eval.t_samples=3", workdir=workdir, api=prefect_api)
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert stage_status(latest_record(workdir)) == expected_statuses("configs/smoke.yaml", {"evaluate[mdlm]"})
    # the re-evaluation logged into the same trained-model run, yet each pipeline run's report re-renders
    # its own evaluation's numbers
    table = lambda text: [ln for ln in text.splitlines() if ln.startswith("| mdlm |")][0]  # noqa: E731
    assert table((workdir / "report.md").read_text()) != table(first_report)
    out = cli_here(capsys, "report", first_run, "--out", str(workdir / "again"), workdir=workdir)
    assert out.returncode == 0 and table((workdir / "again" / "report.md").read_text()) == table(first_report)


def test_a_copied_then_moved_workdir_reuses_everything_from_its_new_place(smoke_run, tmp_path, prefect_api):
    """Relocatable workdirs: `cp -a` then `mv` (the copy's first home is gone) and rerun. Every stage is reused,
    nothing is read from or recreated at an old location, and MLflow's artifact paths point into the new one."""
    import sqlite3

    workdir, _ = smoke_run
    first, moved = tmp_path / "copy", tmp_path / "moved"
    shutil.copytree(workdir, first, symlinks=True)
    shutil.move(first, moved)
    out = cli("run", "configs/smoke.yaml", workdir=moved, api=prefect_api)
    assert out.returncode == 0, out.stderr[-3000:]
    assert set(stage_status(latest_record(moved)).values()) == {"REUSED"}, stage_status(latest_record(moved))
    assert "workdir moved: MLflow's artifact paths rewritten" in out.stderr and not first.exists()
    con = sqlite3.connect(moved / "mlflow.db")
    paths = [r[0] for r in con.execute("SELECT artifact_location FROM experiments UNION SELECT artifact_uri FROM runs")]
    paths += [r[0] for r in con.execute("SELECT source FROM model_versions")]
    con.close()
    local = [p for p in paths if "/mlartifacts" in p]
    assert local and all(p.startswith((moved / "mlartifacts").as_uri()) for p in local), local
    for entry in (moved / "store" / "train").glob("*/manifest.json"):  # Prefect now caches refs to the new files
        assert [p.name for p in entry.parent.glob("prefect-result-*")], list(entry.parent.iterdir())


def test_corrupt_checkpoint_fails_evaluation_clearly(smoke_run, capsys, prefect_api):
    workdir, _ = smoke_run
    weights = next((workdir / "store" / "train").glob("*/model/model.safetensors"))
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-16] + bytes(16))
        out = cli("run", "configs/smoke.yaml", "--set", "eval.t_samples=4", workdir=workdir, api=prefect_api)
        assert out.returncode == 2
        assert "corrupt (sha256 mismatch, not loaded)" in out.stderr
        assert stage_status(latest_record(workdir))["evaluate[mdlm]"] == "FAILED"
        logs, _ = flow_run_logs_and_artifacts(prefect_api, latest_record(workdir)["prefect_flow_run_id"])
        failed = [m for m in logs if m.startswith("evaluate[mdlm]: FAILED after ")]  # in the run's Logs tab
        assert failed and "sha256 mismatch" in failed[0] and "dllm-flow run --verify" in out.stderr
        # the advice works: --verify re-hashes the reused entries, sets the damaged training aside (Prefect's
        # cached result with it, so the cache cannot skip the check) and retrains it bit for bit
        fixed = cli(
            "run", "configs/smoke.yaml", "--set", "eval.t_samples=4", "--verify", workdir=workdir, api=prefect_api
        )
        assert fixed.returncode == 0, fixed.stderr[-3000:]
        statuses = stage_status(latest_record(workdir))
        assert statuses["prepare_data"] == "REUSED" and statuses["train[mdlm]"] == "COMPLETED"
        aside = list((workdir / "store" / "train").glob("*.damaged-*"))
        assert len(aside) == 1 and (aside[0] / "model" / "model.safetensors").read_bytes() != original
        assert "is damaged: model/model.safetensors does not match its sha256" in fixed.stdout + fixed.stderr
        assert weights.read_bytes() == original  # deterministic training: the same weights again
        # the first setting again: its evaluation is reused and logged into the rebuilt training's new run
        # (which already holds the same metric names from the t_samples=4 evaluation, not this one's folder),
        # and the report renders it from there with the numbers the first run reported
        first_run = json.loads(sorted((workdir / "runs").glob("*.json"))[0].read_text())["run_id"]
        rendered = cli_here(capsys, "report", first_run, "--out", str(workdir / "first"), workdir=workdir)
        assert rendered.returncode == 0, rendered.stderr[-3000:]
        first_default = (workdir / "first" / "report.md").read_text()
        again = cli("run", "configs/smoke.yaml", workdir=workdir, api=prefect_api)
        assert again.returncode == 0, again.stderr[-3000:]
        statuses = stage_status(latest_record(workdir))
        assert statuses["evaluate[mdlm]"] == "REUSED" and statuses["report"] == "COMPLETED", statuses
        # the same numbers; the last column names the MLflow run, now the rebuilt one
        row = lambda text: [ln for ln in text.splitlines() if ln.startswith("| mdlm |")][0].split("|")  # noqa: E731
        now, before = row((workdir / "report.md").read_text()), row(first_default)
        assert now[:-2] == before[:-2] and now[-2] != before[-2]
    finally:
        weights.write_bytes(original) if weights.is_file() else None
        for damaged in (workdir / "store" / "train").glob("*.damaged-*"):
            shutil.rmtree(damaged)


def test_bad_input_gets_one_clear_error(tmp_path, capsys):
    missing = cli("run", "configs/nope.yaml", workdir=tmp_path)
    assert missing.returncode == 2 and "config file not found" in missing.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    unwritable = cli("run", "configs/smoke.yaml", workdir=blocker / "sub")
    assert unwritable.returncode == 2 and "is not writable" in unwritable.stderr
    unknown = cli_here(capsys, "validate", "configs/smoke.yaml", "--set", "pipeline.strategies=[mdlm, nope]")
    assert unknown.returncode == 2 and "'nope'" in unknown.stderr
    bad_key = cli_here(capsys, "validate", "configs/smoke.yaml", "--set", "train.learning_rate=1")
    assert bad_key.returncode == 2 and "train.learning_rate: unknown key" in bad_key.stderr
    import torch

    if not torch.cuda.is_available():  # on a GPU host this config is valid
        no_gpu = cli_here(capsys, "run", "configs/smoke.yaml", "--set", "train.device=cuda", workdir=tmp_path / "gpu")
        assert no_gpu.returncode == 2 and "train.device is 'cuda' but this machine has no CUDA device" in no_gpu.stderr
        assert not (tmp_path / "gpu").exists()  # refused before the workdir or any service
        # the training on a GPU pool, the grpo stage left on this machine: refused, naming its deployment key
        remote = ["--set", "train.device=cuda", "--set", "pipeline.train_deployment=dllm-train/train-gpu"]
        grpo_here = cli_here(capsys, "run", "configs/grpo.yaml", *remote, workdir=tmp_path / "grpo")
        assert grpo_here.returncode == 2 and "pipeline.grpo_deployment" in grpo_here.stderr, grpo_here.stderr
        assert not (tmp_path / "grpo").exists()
    orphan = cli_here(capsys, "validate", "configs/smoke.yaml", "--set", "pipeline.grpo_deployment=dllm-grpo/grpo-gpu")
    assert orphan.returncode == 2 and "there is no grpo section" in orphan.stderr
    wrong_type = cli_here(capsys, "validate", "configs/smoke.yaml", "--set", "train.steps=lots")
    assert wrong_type.returncode == 2 and "train.steps" in wrong_type.stderr and "'lots'" in wrong_type.stderr


def test_validate_prints_resolved_config(capsys):
    out = cli_here(capsys, "validate", "configs/smoke.yaml", "--set", "train.steps=5")
    assert out.returncode == 0 and json.loads(out.stdout)["config"]["train"]["steps"] == 5
    # per strategy, exactly the options training uses: shared keys it declares, then its overrides
    compare = cli_here(capsys, "validate", "configs/compare.yaml", "--set", "dllm.overrides.idlm.block_length=3")
    options = json.loads(compare.stdout)["strategy_options"]
    assert options["block_diffusion"]["block_size"] == 16 and options["hybrid"]["block_size"] is None
    assert options["idlm"]["block_length"] == 3 and "block_length" not in options["mdlm"]
    # the stages `run` would run, as the declarations derive them (tasks/stages.py)
    stages = json.loads(compare.stdout)["stages"]
    assert stages[0] == {"stage": "prepare_data", "reads": "–", "produces": "data"}
    assert stages[-1]["stage"] == "report" and stages[-1]["reads"].count("evaluate[") == 5
    assert {"stage": "evaluate[idlm]", "reads": "train[idlm], prepare_data", "produces": "evaluated"} in stages


def test_sigkilled_training_is_marked_crashed_and_resume_reruns_it(tmp_path, capsys, prefect_api):
    import os
    import signal
    import time

    args = [
        "run",
        "configs/smoke.yaml",
        "--set",
        "train.steps=80",
        "--set",
        "train.checkpoint_every=10",
        "--workdir",
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        start_new_session=True,
        env={**os.environ, "PREFECT_API_URL": prefect_api},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    try:
        while time.time() < deadline and not list((tmp_path / "store" / "train").glob("*.work/checkpoint/dllm.json")):
            assert proc.poll() is None, "pipeline ended before its first checkpoint"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    checkpoint = next((tmp_path / "store" / "train").glob("*.work/checkpoint/dllm.json"))
    step = json.loads(checkpoint.read_text())["step"]
    assert step >= 10 and not list((tmp_path / "store" / "train").glob("*/manifest.json"))
    killed = latest_record(tmp_path)["run_id"]
    listing = cli_here(capsys, "runs", workdir=tmp_path)
    assert f"{killed}  CRASHED" in listing.stdout  # the dead process is detected, its stage marked
    assert stage_status(latest_record(tmp_path))["train[mdlm]"] == "CRASHED"
    rerun = cli("resume", killed, workdir=tmp_path, api=prefect_api)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "completed before, will be reused: prepare_data" in rerun.stdout
    assert "resuming from the step-" in rerun.stdout
    record = latest_record(tmp_path)
    assert (
        record["resumed_from"] == killed
        and record["config"] == json.loads((tmp_path / "runs" / f"{killed}.json").read_text())["config"]
    )
    status = stage_status(record)
    assert status["prepare_data"] == "REUSED" and status["train[mdlm]"] == "COMPLETED"
    again = cli_here(capsys, "resume", record["run_id"], workdir=tmp_path)
    assert again.returncode == 0 and "nothing to resume" in again.stdout
    missing = cli_here(capsys, "resume", "no-such-run", workdir=tmp_path)
    assert missing.returncode == 2 and "no pipeline run 'no-such-run'" in missing.stderr

    from mlflow.tracking import MlflowClient

    from dllm_common.tracking import default_tracking_uri

    client = MlflowClient(default_tracking_uri(tmp_path))
    children = [
        r
        for r in client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
        if "mlflow.parentRunId" in r.data.tags
    ]
    assert len(children) == 1  # the resumed stage continued its child run
    steps = sorted(m.step for m in client.get_metric_history(children[0].info.run_id, "train/loss"))
    assert steps == list(range(80))


def test_ui_points_at_the_chart_view_of_the_latest_experiment(smoke_run):
    from dllm_common.tracking import default_tracking_uri
    from flows.ui import chart_view_url, latest_experiment

    workdir, _ = smoke_run
    assert latest_experiment(default_tracking_uri(workdir)) == "smoke"
    url = chart_view_url("127.0.0.1", 5000, "7")
    assert url == "http://127.0.0.1:5000/#/experiments/7/runs?compareRunsMode=CHART"


def test_prefect_ui_serves_the_workdirs_flow_run_with_stage_logs_and_the_report(smoke_run):
    """The smoke run used no Prefect server: `dllm-flow ui --prefect` serves the workdir's own Prefect home,
    where the flow run's Logs tab has each stage's start and outcome and its Artifacts tab the report."""
    import os
    import re
    import urllib.request
    import uuid

    from conftest import free_port, stop_group, wait_http

    from flows.ui import flow_run_missing

    workdir, _ = smoke_run
    first = json.loads(sorted((workdir / "runs").glob("*.json"))[0].read_text())  # the smoke run itself
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_UI_URL")}
    log = workdir / "prefect-ui.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "ui", "--prefect", first["run_id"], "--workdir", str(workdir)]
        + ["--port", str(port)],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", proc, log)
        url = re.search(r"Prefect UI for pipeline run \S+: (\S+)", log.read_text()).group(1)
        assert url == f"http://127.0.0.1:{port}/runs/flow-run/{first['prefect_flow_run_id']}"
        page = urllib.request.Request(url, headers={"Accept": "text/html"})  # as a browser asks for it
        assert urllib.request.urlopen(page, timeout=30).status == 200  # the UI's page for the flow run
        api = f"http://127.0.0.1:{port}/api"
        logs, artifacts = flow_run_logs_and_artifacts(api, first["prefect_flow_run_id"])
        # a run made against another Prefect server gets a warning instead of an empty page
        assert not flow_run_missing(api, first["prefect_flow_run_id"], proc)
        assert flow_run_missing(api, str(uuid.uuid4()), proc)
    finally:
        stop_group(proc)
    for stage in ("prepare_data", "train[mdlm]", "evaluate[mdlm]", "report"):
        assert f"{stage}: started" in logs, (stage, logs)
        assert any(m.startswith(f"{stage}: ran (") and "key=" in m for m in logs), (stage, logs)
    assert any(m.startswith(f"pipeline run {first['run_id']} of smoke") for m in logs)
    (report,) = [a for a in artifacts if a.key == "dllm-report-smoke"]
    assert report.type == "markdown" and "| mdlm |" in report.data and first["run_id"] in report.description
    assert "![" not in report.data and str(workdir / "training_curves.png") in report.data  # plots by path
