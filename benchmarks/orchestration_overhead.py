"""Orchestration overhead: the smoke pipeline three ways, in the same run, fresh workdir each.

  plain       the four stage functions called from one Python process (no Prefect, no CLI)
  in-process  `dllm-flow run configs/smoke.yaml` (Prefect flow + cached tasks, local ephemeral API)
  deployment  the `smoke` deployment triggered on a Prefect server and run by a process worker
              (server and worker are started first and not timed; the time is trigger → completed)

Each is a fresh subprocess, timed end to end; ratios are against `plain`. Usage:
    .venv/bin/python benchmarks/orchestration_overhead.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from dllm_common.tracking import TELEMETRY_OFF

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent
QUIET = {**TELEMETRY_OFF, "HF_HUB_OFFLINE": "1"}  # no telemetry, no hub

PLAIN = """
import sys
from strategies.options import load_config
from tasks.evaluate import evaluate
from tasks.prepare_data import prepare_data
from tasks.report import report
from tasks.train import train
spec, wd = load_config("configs/smoke.yaml"), sys.argv[1]
data = prepare_data(spec, wd)
trained = [train(spec, s, data, wd) for s in spec.pipeline.strategies]
evaluated = [evaluate(spec, s, t, data, wd) for s, t in zip(spec.pipeline.strategies, trained)]
report(spec.pipeline.name, trained, evaluated, wd, tracking_uri=spec.tracking.uri,
       experiment=spec.tracking.experiment)
"""

TRIGGER = """
import json, sys
from prefect.deployments import run_deployment
run = run_deployment("dllm-pipeline/smoke", timeout=1800, parameters={"workdir": sys.argv[1]})
print(json.dumps({"state": run.state.type.value}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return time.perf_counter() - t0


def _wait(url: str, seconds: int = 300) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url} did not answer")


def _measure(repeats: int, tmp: Path, env: dict, deployed_env: dict) -> dict[str, list[float]]:
    """Seconds of each path per repeat: plain stage calls, `dllm-flow run` in its process, a deployment run."""
    rows: dict[str, list[float]] = {"plain": [], "in-process": [], "deployment": []}
    run = [str(VENV / "bin" / "dllm-flow"), "run", "configs/smoke.yaml", "--workdir"]
    for r in range(repeats):
        rows["plain"].append(_timed([sys.executable, "-c", PLAIN, str(tmp / f"plain{r}")], env))
        rows["in-process"].append(_timed([*run, str(tmp / f"inproc{r}")], env))
        rows["deployment"].append(_timed([sys.executable, "-c", TRIGGER, str(tmp / f"deployed{r}")], deployed_env))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="orch-bench-"))
    env = {**os.environ, **QUIET}
    env.pop("PREFECT_API_URL", None)
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    served = {
        **env,
        "DLLM_SERVER_DIR": str(tmp / "server"),
        "PREFECT_PORT": str(port),
        "MLFLOW_PORT": str(_free_port()),
        "VENV_BIN": str(VENV / "bin"),
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_HOME": str(tmp / "home"),
    }
    make = ["make", "-o", "install", f"VENV={VENV}", f"DLLM_PREFECT_API={api}"]
    procs = [
        subprocess.Popen(
            [*make, "server"],
            cwd=ROOT,
            env=served,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        _wait(f"{api}/health")
        subprocess.run([*make, "deploy"], cwd=ROOT, env=served, check=True, capture_output=True)
        procs.append(
            subprocess.Popen(
                [*make, "worker-cpu"],
                cwd=ROOT,
                env=served,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        time.sleep(5)
        rows = _measure(args.repeats, tmp, env, {**served, "PREFECT_API_URL": api})
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=60)
    base = min(rows["plain"])
    print(f"smoke pipeline (prepare → train 30 steps → evaluate → report), {args.repeats} repeat(s), best of each")
    print(f"{'path':<14}{'seconds':>10}{'× plain':>10}")
    for name, times in rows.items():
        print(f"{name:<14}{min(times):>10.1f}{min(times) / base:>10.2f}")
    print(json.dumps({k: min(v) for k, v in rows.items()}))


if __name__ == "__main__":
    main()
