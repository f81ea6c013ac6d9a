"""Integration: the operations stack exactly as the README runs it, on 127.0.0.1.

`make server` (Prefect server + MLflow server, databases migrated first), `make deploy` (work pools
cpu and gpu, every deployment of deployments/prefect.yaml, the dead-worker automation), `make worker-cpu` and `make worker-gpu`;
then the `smoke-gpu-training` deployment is triggered: the pipeline runs on the cpu worker and
submits its training to the `train-gpu` deployment, which the gpu worker runs. Everything is
stopped by process group at the end."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, free_port, stop_group, wait_http

pytestmark = pytest.mark.slow

VENV = Path(sys.executable).parent.parent


def test_deployed_smoke_pipeline_trains_on_the_gpu_pool(tmp_path):
    prefect_port, mlflow_port = free_port(), free_port()
    api = f"http://127.0.0.1:{prefect_port}/api"
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    env = {**os.environ, "DLLM_SERVER_DIR": str(tmp_path / "server"), "PREFECT_PORT": str(prefect_port),
           "MLFLOW_PORT": str(mlflow_port), "VENV_BIN": str(VENV / "bin"), "PREFECT_WORKER_QUERY_SECONDS": "2",
           "PREFECT_HOME": str(tmp_path / "client-prefect-home"), "PREFECT_LOGGING_LEVEL": "INFO"}
    env.pop("PREFECT_API_URL", None)
    make = ["make", "-o", "install", f"VENV={VENV}", f"DLLM_PREFECT_API={api}"]
    procs = []

    def start(args, name):
        log = tmp_path / f"{name}.log"
        proc = subprocess.Popen(args, cwd=ROOT, env=env, start_new_session=True, stdout=open(log, "w"),
                                stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc, log

    try:
        server, server_log = start([*make, "server"], "server")
        wait_http(f"{api}/health", server, server_log)
        wait_http(f"{mlflow_url}/health", server, server_log)
        deploy = subprocess.run([*make, "deploy"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        for name in ("smoke", "smoke-gpu-training", "quickstart-nightly", "compare-weekly", "train-gpu"):
            assert name in deploy.stdout, name
        assert "created automation 'dllm-flow: crash flow runs whose worker died'" in deploy.stdout
        start([*make, "worker-cpu"], "worker-cpu")
        gpu_worker, gpu_log = start([*make, "worker-gpu"], "worker-gpu")
        workdir = tmp_path / "work"
        trigger = f"""
import json
from prefect.deployments import run_deployment
run = run_deployment("dllm-pipeline/smoke-gpu-training", timeout=900, parameters={{
    "workdir": {str(workdir)!r},
    "overrides": ["pipeline.train_deployment=dllm-train/train-gpu", "tracking.uri={mlflow_url}"]}})
print(json.dumps({{"state": run.state.type.value, "id": str(run.id)}}))
"""
        out = subprocess.run([sys.executable, "-c", trigger], cwd=ROOT, env={**env, "PREFECT_API_URL": api},
                             capture_output=True, text=True, timeout=1000)
        assert out.returncode == 0, out.stderr[-4000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        logs = "".join((tmp_path / f"{n}.log").read_text()[-3000:] for n in ("worker-cpu", "worker-gpu"))
        assert result["state"] == "COMPLETED", logs
        record = json.loads(next((workdir / "runs").glob("*.json")).read_text())
        assert record["status"] == "COMPLETED"
        assert {s["name"]: s["status"] for s in record["stages"]} == {
            "prepare_data": "COMPLETED", "train[mdlm]": "COMPLETED", "evaluate[mdlm]": "COMPLETED",
            "report": "COMPLETED"}
        assert "dllm-train" in gpu_log.read_text()  # the training flow ran on the gpu pool's worker
        from mlflow.tracking import MlflowClient

        client = MlflowClient(mlflow_url)
        child = client.get_run(next(s["mlflow_run_id"] for s in record["stages"] if s["name"] == "train[mdlm]"))
        assert child.data.tags["mlflow.parentRunId"] == record["parent_mlflow_run_id"]
        assert len(client.get_metric_history(child.info.run_id, "train/loss")) == 30
        assert "eval/nelbo" in child.data.metrics
    finally:
        for proc in reversed(procs):
            stop_group(proc)
