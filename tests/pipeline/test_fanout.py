"""Strategies fanned out (`pipeline.max_parallel`): two strategies train at once, each in its own process,
each evaluated as soon as its own training ends; the results equal the sequential pipeline's; one failing
strategy does not stop the other, the run ends FAILED naming it, and `dllm-flow resume` reruns only it."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from uuid import UUID

import pytest
from conftest import ROOT
from runkit import environ, unverified_entries

from tasks.common import published_results

pytestmark = pytest.mark.slow

TWO = ["--set", "pipeline.strategies=[mdlm,scdd]", "--set", "train.steps=40", "--set", "dllm.loss_weighting=flat"]


def cli(workdir, *args, api, fault=None):
    env = environ(api, **({"DLLM_FLOW_FAULT": fault} if fault else {}))
    cmd = [sys.executable, "-m", "flows.cli", *args, "--workdir", str(workdir)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def record(workdir) -> dict:
    return json.loads(sorted((workdir / "runs").glob("*.json"))[-1].read_text())


def task_runs(api: str, flow_run_id: str) -> dict:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with PrefectClient(api) as client:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(flow_run_id)]))
            )
            return {r.name: (r.start_time, r.end_time) for r in runs}

    return asyncio.run(read())


def test_fanned_out_strategies_train_at_once_like_the_sequential_pipeline(tmp_path, prefect_api):
    sequential, parallel = tmp_path / "seq", tmp_path / "par"
    first = cli(sequential, "run", "configs/smoke.yaml", *TWO, api=prefect_api)
    assert first.returncode == 0, first.stderr[-3000:]
    # scdd fails at its 5th step; mdlm, training beside it, finishes and is evaluated
    failed = cli(
        parallel,
        "run",
        "configs/smoke.yaml",
        *TWO,
        "--set",
        "pipeline.max_parallel=2",
        api=prefect_api,
        fault="step:train[scdd]=enospc@5",
    )
    # exit 2: what failed is something to change (a full disk), and the line still says what finished
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    line = [ln for ln in failed.stderr.splitlines() if ln.startswith("dllm-flow: error:")]
    assert len(line) == 1 and "StrategiesFailed: 1 of 2 strategies failed (scdd: " in line[0], failed.stderr[-3000:]
    assert "finished: mdlm. `dllm-flow resume` reruns only what failed" in line[0]
    rec = record(parallel)
    stages = {s["name"]: s["status"] for s in rec["stages"]}
    assert rec["status"] == "FAILED" and stages["train[scdd]"] == "FAILED"
    assert stages["train[mdlm]"] == stages["evaluate[mdlm]"] == "COMPLETED" and "report" not in stages
    runs = task_runs(prefect_api, rec["prefect_flow_run_id"])
    (a_start, a_end), (b_start, b_end) = runs["train[mdlm]"], runs["train[scdd]"]
    assert a_start < b_end and b_start < a_end  # the two trainings ran side by side
    resumed = cli(parallel, "resume", rec["run_id"], api=prefect_api)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    stages = {s["name"]: s["status"] for s in record(parallel)["stages"]}
    assert stages["train[mdlm]"] == stages["evaluate[mdlm]"] == "REUSED"
    assert stages["train[scdd]"] == stages["evaluate[scdd]"] == stages["report"] == "COMPLETED"
    results = published_results(sequential)
    assert published_results(parallel) == results and len(results) == 2
    assert unverified_entries(parallel) == [] and Path(parallel / "report.md").is_file()
