"""`dllm-flow` command line: run | resume | validate | runs | ui.

Environment is set before Prefect/MLflow are imported: telemetry off, hub offline unless the
user says otherwise, and (when no Prefect server is configured) Prefect's state kept inside the
workdir so a pipeline's whole history lives in one folder.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dllm_common.checkpoint import CorruptCheckpointError
from dllm_common.config import ConfigError, load_config
from dllm_common.tracking import quiet_environment

DEFAULT_WORKDIR = "work"


def _prefect_env(workdir: Path) -> None:
    quiet_environment()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "PREFECT_API_URL" not in os.environ:
        (workdir / ".prefect").mkdir(exist_ok=True)
        os.environ.setdefault("PREFECT_HOME", str(workdir.resolve() / ".prefect"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # a loaded 2-core machine can take longer than Prefect's default 20 s to boot the local API
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")


def cmd_run(args) -> int:
    load_config(args.config, args.set)  # fail fast, before any service starts
    from tasks.common import check_workdir

    workdir = check_workdir(args.workdir)
    _prefect_env(workdir)
    from flows.pipeline import dllm_pipeline

    result = dllm_pipeline(config_path=str(args.config), overrides=args.set, workdir=str(workdir))
    print(f"[dllm-flow] pipeline run {result['run_id']} completed; report: {result['report']}")
    print(f"[dllm-flow] browse it with: dllm-flow ui --workdir {workdir}")
    return 0


def cmd_resume(args) -> int:
    """Rerun a failed or crashed pipeline run with its recorded config; completed stages are reused."""
    from dllm_common.runs import find_record
    from tasks.common import check_workdir

    workdir = check_workdir(args.workdir)
    record = find_record(workdir, args.run_id)
    if record.status == "COMPLETED":
        print(f"[dllm-flow] pipeline run {record.run_id} completed; nothing to resume")
        return 0
    if record.status == "RUNNING":
        raise ValueError(f"pipeline run {record.run_id} is still running (pid {record.pid} on {record.host}); "
                         "wait for it or stop it before resuming")
    done = [s.name for s in record.stages if s.status in ("COMPLETED", "REUSED")]
    todo = [s.name for s in record.stages if s.status not in ("COMPLETED", "REUSED")]
    print(f"[dllm-flow] resuming pipeline run {record.run_id} ({record.status}) with its recorded config")
    print(f"[dllm-flow] completed before, will be reused: {', '.join(done) or 'none'}")
    print(f"[dllm-flow] to run again: {', '.join(todo) or 'none recorded'} (and every stage after them)")
    _prefect_env(workdir)
    from flows.pipeline import dllm_pipeline

    result = dllm_pipeline(config_path=record.config_path, overrides=record.overrides, workdir=str(workdir),
                           config=record.config, resumed_from=record.run_id)
    print(f"[dllm-flow] pipeline run {result['run_id']} (resuming {record.run_id}) completed; report: {result['report']}")
    return 0


def cmd_validate(args) -> int:
    spec = load_config(args.config, args.set)
    from tasks.train import check_strategies

    check_strategies(spec.pipeline.strategies)
    print(json.dumps(spec.model_dump(mode="json"), indent=2))
    return 0


def cmd_runs(args) -> int:
    from dllm_common.runs import list_records

    records = list_records(Path(args.workdir))
    if not records:
        print(f"no pipeline runs in {args.workdir}")
        return 0
    for r in records:
        resumed = f"  resumes={r.resumed_from}" if r.resumed_from else ""
        print(f"{r.run_id}  {r.status:<9}  {r.pipeline}  config={r.config_path}  mlflow_parent={r.parent_mlflow_run_id}"
              f"{resumed}")
        for s in r.stages:
            extra = f"  mlflow_run={s.mlflow_run_id}" if s.mlflow_run_id else ""
            err = f"  error={s.error.splitlines()[0][:120]}" if s.error else ""
            print(f"    {s.name:<28} {s.status:<9} {s.seconds or 0:>8.1f}s{extra}{err}")
    return 0


def chart_view_url(host: str, port: int, experiment_id: str) -> str:
    """The experiment's training-runs page in chart mode (MLflow 3 would open on its GenAI overview)."""
    return f"http://{host}:{port}/#/experiments/{experiment_id}/runs?compareRunsMode=CHART"


def latest_experiment(uri: str) -> str:
    """The most recently created experiment of a workdir (what the last `run` wrote to)."""
    from mlflow.tracking import MlflowClient

    experiments = [e for e in MlflowClient(uri).search_experiments() if e.name != "Default"]
    if not experiments:
        raise FileNotFoundError("no dllm-flow experiments in this workdir yet; run a pipeline first (dllm-flow run CONFIG)")
    return max(experiments, key=lambda e: e.creation_time).name


def cmd_ui(args) -> int:
    import subprocess

    from dllm_common.tracking import Tracking, artifact_root, default_tracking_uri

    workdir = Path(args.workdir)
    quiet_environment()
    uri = default_tracking_uri(workdir)
    experiment_id = Tracking(workdir, uri, args.experiment or latest_experiment(uri)).experiment_id
    url = chart_view_url(args.host, args.port, experiment_id)
    print(f"MLflow UI for {workdir.resolve()}: {url}", flush=True)
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--default-artifact-root",
           artifact_root(workdir), "--host", args.host, "--port", str(args.port), "--workers", "1"]
    return subprocess.call(cmd)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dllm-flow", description="Declarative training pipelines for diffusion LMs.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a pipeline config (stages already done are reused)")
    run.add_argument("config")
    run.add_argument("--set", action="append", default=[], metavar="dotted.key=value", help="override a config key")
    run.add_argument("--workdir", default=DEFAULT_WORKDIR)
    run.set_defaults(func=cmd_run)
    res = sub.add_parser("resume", help="rerun a failed/crashed pipeline run with its recorded config")
    res.add_argument("run_id")
    res.add_argument("--workdir", default=DEFAULT_WORKDIR)
    res.set_defaults(func=cmd_resume)
    val = sub.add_parser("validate", help="print the resolved config, or what is wrong with it")
    val.add_argument("config")
    val.add_argument("--set", action="append", default=[], metavar="dotted.key=value")
    val.set_defaults(func=cmd_validate)
    runs = sub.add_parser("runs", help="past pipeline runs with the status of each stage")
    runs.add_argument("--workdir", default=DEFAULT_WORKDIR)
    runs.set_defaults(func=cmd_runs)
    ui = sub.add_parser("ui", help="MLflow UI on 127.0.0.1 for a workdir")
    ui.add_argument("--workdir", default=DEFAULT_WORKDIR)
    ui.add_argument("--experiment", default=None, help="default: the workdir's most recent experiment")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=5000)
    ui.set_defaults(func=cmd_ui)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, CorruptCheckpointError, FileNotFoundError, PermissionError, ValueError) as exc:
        print(f"dllm-flow: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
