"""`dllm-flow ui`: the MLflow UI on every strategy's curves, or (`--prefect`) the Prefect UI on a
pipeline run's flow run. Torch-free: MLflow and Prefect are imported when a command runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from dllm_common import interrupt
from dllm_common.tracking import quiet_environment
from flows.environment import prefect_env


def chart_view_url(host: str, port: int, experiment_id: str) -> str:
    """The experiment's training-runs page in chart mode (MLflow 3 would open on its GenAI overview)."""
    return f"http://{host}:{port}/#/experiments/{experiment_id}/runs?compareRunsMode=CHART"


def landing_url(host: str, port: int, experiment_id: str, share_key: str | None) -> str:
    """The chart view in MLflow's model-training mode, opened on the saved view `share_key`
    (dllm_common/landing.py: the latest pipeline run's strategies, learning curves and evaluation first).

    The saved view carries the runs search and sort itself: MLflow ignores a saved view whose URL also
    names a search (`searchFilter`, `orderByKey`, ...), so the URL names none. Without a view (no pipeline
    run yet) the page is MLflow's own chart view of every run."""
    url = chart_view_url(host, port, experiment_id) + "&workflowType=machine_learning"
    return url + (f"&viewStateShareKey={share_key}" if share_key else "")


def latest_experiment(uri: str) -> str:
    """The most recently created experiment of a workdir (what the last `run` wrote to)."""
    from mlflow.tracking import MlflowClient

    experiments = [e for e in MlflowClient(uri).search_experiments() if e.name != "Default"]
    if not experiments:
        raise FileNotFoundError(
            "no dllm-flow experiments in this workdir yet; run a pipeline first (dllm-flow run CONFIG)"
        )
    return max(experiments, key=lambda e: e.creation_time).name


def latest_strategy_runs(client, experiment_id: str) -> list[str]:
    """The MLflow runs of the latest pipeline run's strategies: those its report compared (parent tag
    `dllm.report_runs`, docs/architecture.md, the tracking contract; a reused training keeps its earlier
    run), else the parent's child runs; empty when the experiment has no pipeline run."""
    parents = client.search_runs(
        [experiment_id],
        "tags.`dllm.pipeline_run_id` LIKE '%'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not parents:
        return []
    parent = parents[0]
    compared = json.loads(parent.data.tags.get("dllm.report_runs", "[]"))
    if compared:
        return [item["run_id"] for item in compared]
    children = client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return [c.info.run_id for c in children]


def mlflow_ui_command(workdir: Path, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """`mlflow server` for a workdir's tracking store, and its environment: without MLflow's job runner
    (a huey consumer that GenAI jobs need and a training workdir does not)."""
    from dllm_common.tracking import artifact_root, default_tracking_uri

    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        default_tracking_uri(workdir),
        "--default-artifact-root",
        artifact_root(workdir),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    return cmd, {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def cmd_ui(args) -> int:
    if args.prefect:
        return prefect_ui(args)
    from dllm_common.landing import save_landing_view
    from dllm_common.tracking import Tracking, default_tracking_uri

    workdir = Path(args.workdir)
    quiet_environment()
    uri = default_tracking_uri(workdir)
    tracking = Tracking(workdir, uri, args.experiment or latest_experiment(uri))  # marks it a training experiment
    runs = latest_strategy_runs(tracking.client, tracking.experiment_id)
    key = save_landing_view(tracking.client, tracking.experiment_id, runs) if runs else None
    url = landing_url(args.host, args.port or 5000, tracking.experiment_id, key)
    print(f"MLflow UI for {workdir.resolve()}: {url}", flush=True)
    cmd, env = mlflow_ui_command(workdir, args.host, args.port or 5000)
    return serve(cmd, env)


def serve(cmd: list[str], env: dict[str, str] | None = None, watch=None) -> int:
    """Run a server (`mlflow server`, `prefect server start`) until it exits or this command gets SIGINT or
    SIGTERM; either way its whole process group (uvicorn and its workers) is gone before this returns.

    The server runs in its own session, so a Ctrl-C to the terminal's group reaches this command alone, which
    stops the server's group once; a SIGTERM to this command alone (`kill`, a service manager) does the same
    instead of leaving the server to hold its port (docs/operations.md, "The local Prefect API, and no
    orphans"). `watch(proc)` runs once it
    has started. A signal ends the command with 128 + its number (dllm_common/interrupt.py)."""
    interrupt.install()
    proc = subprocess.Popen(cmd, env=env, preexec_fn=interrupt.detach_and_die_with_parent)
    try:
        if watch is not None:
            watch(proc)
        return proc.wait()
    finally:
        stop_group(proc)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (its exited, unreaped members aside)."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: whether the group has any member at all
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                return True
    return False


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop a child started in its own session and everything in its process group: SIGTERM, then SIGKILL to
    what is left after `grace` seconds, or at once on another signal meanwhile."""

    def signal_group(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    done = False
    try:
        signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(proc.pid):
                done = True
                return
            time.sleep(0.1)
    finally:
        if not done:
            signal_group(signal.SIGKILL)
        proc.wait()


def prefect_ui(args) -> int:
    """The Prefect UI on a pipeline run's flow run (its graph, Logs and Artifacts tabs): the configured
    server's (PREFECT_API_URL), or a server started here on the workdir's own Prefect home."""
    from dllm_common.runs import find_record, list_records

    workdir = Path(args.workdir)
    if args.run_id:
        record = find_record(workdir, args.run_id)
    else:
        records = list_records(workdir)
        if not records:
            raise FileNotFoundError(f"no pipeline runs in {workdir}; run a pipeline first (dllm-flow run CONFIG)")
        record = records[-1]
    if not record.prefect_flow_run_id:
        raise FileNotFoundError(f"pipeline run {record.run_id} recorded no Prefect flow run")
    configured = "PREFECT_API_URL" in os.environ
    prefect_env(workdir)
    port = args.port or 4200
    if not configured:
        os.environ["PREFECT_API_URL"] = f"http://{args.host}:{port}/api"  # where the UI below will serve
    from prefect.settings import Settings

    url = f"{Settings().ui_url}/runs/flow-run/{record.prefect_flow_run_id}"
    print(f"Prefect UI for pipeline run {record.run_id}: {url}", flush=True)
    if configured:
        return 0
    server = Path(sys.executable).parent / "prefect"

    def warn_if_missing(proc) -> None:
        if flow_run_missing(os.environ["PREFECT_API_URL"], record.prefect_flow_run_id, proc):
            print(
                f"dllm-flow: warning: flow run {record.prefect_flow_run_id} is not in {workdir / '.prefect'}: "
                f"pipeline run {record.run_id} ran against another Prefect server; set PREFECT_API_URL to "
                "that server's API and run this again",
                file=sys.stderr,
                flush=True,
            )

    return serve([str(server), "server", "start", "--host", args.host, "--port", str(port)], watch=warn_if_missing)


def flow_run_missing(api: str, flow_run_id: str, proc, seconds: float = 180) -> bool:
    """Whether the server at `api` (started as `proc`) answers 404 for the flow run, once it is up."""
    deadline = time.time() + seconds
    while proc.poll() is None and time.time() < deadline:
        try:
            urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}", timeout=5)
            return False
        except urllib.error.HTTPError as exc:
            return exc.code == 404
        except OSError:
            time.sleep(1)
    return False
