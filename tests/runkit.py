"""Running `dllm-flow` as a user would, for the signal and fault suites: the smoke pipeline at a length
where a signal or a fault lands mid-training, and what a finished run left behind."""

import json
import os
import subprocess
import sys

from conftest import ROOT

# long enough that a fault lands mid-training, short enough for CI
STEPS = ["--set", "train.steps=150", "--set", "train.checkpoint_every=10", "--set", "train.log_every=1"]


def environ(api: str | None = None, **extra) -> dict:
    """The test environment; `api`: a running Prefect server (else the run boots its own local API)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "DLLM_FLOW_FAULT")}
    if api:
        env["PREFECT_API_URL"] = api
    return {**env, **extra}


def start_run(workdir, *extra, api=None, fault=None, config="configs/smoke.yaml"):
    """`dllm-flow run` of the smoke pipeline in its own session (so a test can signal its process group)."""
    cmd = [sys.executable, "-m", "flows.cli", "run", config, *STEPS, *extra, "--workdir", str(workdir)]
    env = environ(api, **({"DLLM_FLOW_FAULT": fault} if fault else {}))
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run(workdir, *extra, api=None, fault=None, timeout=900):
    """`start_run` to its end: (exit status, stdout, stderr)."""
    proc = start_run(workdir, *extra, api=api, fault=fault)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def run_twice(script: str, args: list[str], workdir, api=None, timeout=900) -> list[dict]:
    """`python -c script *args`, a script that runs `dllm-flow run` twice in one process and prints the two exit
    statuses as JSON: both must be 0; returns the two run records `workdir` then holds, oldest first."""
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=environ(api),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0 and json.loads(out.stdout.strip().splitlines()[-1]) == [0, 0], out.stderr[-4000:]
    return [json.loads(p.read_text()) for p in sorted((workdir / "runs").glob("*.json"))]


def weights_digest(workdir) -> str:
    manifest = next(p for p in (workdir / "store" / "train").glob("*/manifest.json") if ".damaged-" not in str(p))
    return json.loads(manifest.read_text())["files"]["model/model.safetensors"]["sha256"]


def mlflow_statuses(workdir, experiment="smoke") -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment).experiment_id
    return {r.info.run_name: r.info.status for r in client.search_runs([exp])}


def processes_of(workdir) -> list[str]:
    """Processes whose command line or environment names the workdir (a run, its API server, torchrun)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid == os.getpid():
                continue
            text = " ".join(p.info["cmdline"] or []) + " ".join(f"{k}={v}" for k, v in p.environ().items())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if str(workdir) in text:
            found.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}")
    return found


def unverified_entries(workdir) -> list[str]:
    """Every published entry of the workdir's store re-hashed: what is wrong with any of them."""
    from dllm_common.store import MANIFEST, StageEntry, Store

    store, problems = Store(workdir / "store"), []
    for manifest in (workdir / "store").glob(f"*/*/{MANIFEST}"):
        entry_dir = manifest.parent
        if ".damaged-" in entry_dir.name:
            continue
        entry = StageEntry(entry_dir.parent.name, entry_dir.name, entry_dir)
        problems += [f"{entry_dir}: {p}" for p in store.verify(entry)]
    return problems


def cli(*args, workdir=None, timeout=600, api=None):
    """`dllm-flow ARGS` in a fresh interpreter; `api` points it at a running Prefect server (the
    `prefect_api` fixture) instead of letting it boot a temporary one."""
    import os

    cmd = [sys.executable, "-m", "flows.cli", *args] + (["--workdir", str(workdir)] if workdir else [])
    env = {**os.environ, "PREFECT_API_URL": api} if api else None
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def latest_record(workdir):
    """The newest run record a `dllm-flow run` left in `workdir`."""
    records = sorted((workdir / "runs").glob("*.json"))
    return json.loads(records[-1].read_text())


def metric_history(workdir, run_id, key):
    """[(step, value)] of metric `key` of MLflow run `run_id` in a workdir's own tracking store."""
    from mlflow.tracking import MlflowClient

    from dllm_common.tracking import default_tracking_uri

    client = MlflowClient(default_tracking_uri(workdir))
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
