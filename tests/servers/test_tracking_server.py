"""Tracking-server mode: `tracking.uri: http://127.0.0.1:PORT` against `mlflow server --workers 1`
with proxied artifacts. The test starts the server on 127.0.0.1, runs the smoke pipeline against it
and stops the server by process group."""

import subprocess
import sys

import pytest
from conftest import free_port, stop_group, wait_http
from runkit import cli, latest_record

pytestmark = pytest.mark.slow


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    root = tmp_path / "server"
    root.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
    ]
    proc = subprocess.Popen(
        cmd, cwd=root, start_new_session=True, stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc, root / "server.log", seconds=180)
        yield url, root
    finally:
        stop_group(proc)


def test_pipeline_tracks_to_a_server_with_proxied_artifacts(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    url, root = mlflow_server
    workdir = tmp_path / "work"
    out = cli("run", "configs/smoke.yaml", "--set", f"tracking.uri={url}", workdir=workdir)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    record = latest_record(workdir)
    client = MlflowClient(url, registry_uri=url)
    parent = client.get_run(record["parent_mlflow_run_id"])
    assert parent.data.tags["dllm.pipeline_run_id"] == record["run_id"]
    child_id = next(s["mlflow_run_id"] for s in record["stages"] if s["name"] == "train[mdlm]")
    child = client.get_run(child_id)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    steps = [m.step for m in client.get_metric_history(child_id, "train/loss")]
    assert steps == list(range(len(steps))) and len(steps) == 30
    assert "eval/nelbo" in child.data.metrics
    # artifacts went through the server into its own store, not into the workdir
    names = {a.path for a in client.list_artifacts(child_id, "model")}
    assert "model/model.safetensors" in names
    assert list((root / "artifacts").rglob("model.safetensors")) and not (workdir / "mlartifacts").exists()
    assert client.get_registered_model("smoke-mdlm").name == "smoke-mdlm"
