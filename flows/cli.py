"""`dllm-flow` command line: run | resume | validate | plan | runs | generate | report | ui | export.

Environment is set before Prefect/MLflow are imported: telemetry off, hub offline unless the
user says otherwise, and (when no Prefect server is configured) Prefect's state kept inside the
workdir so a pipeline's whole history lives in one folder.

This module is the entry point and runs the pipeline (`run`, `resume`); the parser is in flows/cli_parser.py, the
other commands in flows/cli_commands.py, the checks before a run in flows/cli_checks.py, the exit status and error
lines in flows/cli_errors.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flows import cli_parser
from flows.cli_checks import check_device, check_sampled_serving, check_served_target, check_tracking, set_verification
from flows.cli_commands import cmd_export, cmd_generate, cmd_plan, cmd_report, cmd_runs, cmd_validate
from flows.cli_errors import USER_ERRORS, Session, run_command
from flows.cli_errors import resume_hint as _resume_hint
from flows.cli_parser import EXPORT_FORMATS, GPU_MEMORY_ENV
from flows.environment import DEBUG_ENV, prefect_env
from flows.ui import cmd_ui

__all__ = [
    "EXPORT_FORMATS",
    "GPU_MEMORY_ENV",
    "USER_ERRORS",
    "_resume_hint",
    "build_parser",
    "cmd_export",
    "cmd_generate",
    "cmd_plan",
    "cmd_report",
    "cmd_resume",
    "cmd_run",
    "cmd_runs",
    "cmd_ui",
    "cmd_validate",
    "main",
]


def build_parser() -> argparse.ArgumentParser:
    """The parser, each subcommand bound to the `cmd_*` function this module names when it is called."""
    commands = {
        "run": cmd_run,
        "resume": cmd_resume,
        "validate": cmd_validate,
        "plan": cmd_plan,
        "runs": cmd_runs,
        "generate": cmd_generate,
        "report": cmd_report,
        "ui": cmd_ui,
        "export": cmd_export,
    }
    return cli_parser.build_parser(commands)


def _warn_if_too_big(spec, declared: str | None, workdir: Path) -> None:
    """One warning line per strategy that the plan says will not fit the training GPU: the memory given by
    `--gpu-memory` or $DLLM_FLOW_GPU_MEMORY, else the visible CUDA device's; none for a CPU training."""
    declared = declared or os.environ.get(GPU_MEMORY_ENV) or None
    if declared is None and (spec.train.device == "cpu" or spec.pipeline.train_deployment is not None):
        return
    import torch  # already imported by the config's checks

    if declared is None and not torch.cuda.is_available():  # nothing to plan for: Prefect is not imported yet
        return
    prefect_env(workdir)  # tasks/ imports Prefect, which reads its (quiet) logging settings once, at import
    from tasks.commands.plan import fit_warnings

    for line in fit_warnings(spec, declared):
        print(f"dllm-flow: warning: {line}", file=sys.stderr, flush=True)


def cmd_run(args) -> int:
    from strategies.options import load_config  # the strategy registry imports torch: not at import time

    spec = load_config(args.config, args.set)
    check_device(spec)  # fail fast, before any service starts
    # a DFlash target's own special tokens; a sampled draft that learns the argmax alone (docs/strategies.md §10.13)
    for line in [*check_served_target(spec), *check_sampled_serving(spec)]:
        print(f"dllm-flow: warning: {line}", file=sys.stderr, flush=True)
    _warn_if_too_big(spec, args.gpu_memory, Path(args.workdir))
    check_tracking(spec.tracking.uri, Path(args.workdir))
    set_verification(args)
    result = _run_pipeline(args, config_path=str(args.config), overrides=args.set)
    if isinstance(result, int):
        return result
    report = f"report: {result['report']}" if result.get("report") else "its report is node 0's"
    print(f"[dllm-flow] pipeline run {result['run_id']} completed; {report}")
    print(f"[dllm-flow] browse it with: dllm-flow ui --workdir {Path(args.workdir).resolve()}")
    return 0


def _run_pipeline(args, **kwargs) -> dict | int:
    """The pipeline flow under a detached local Prefect API (flows/local_api.py), with SIGINT/SIGTERM ending
    it cleanly: the flow's result, or the exit status of an interrupted run (128 + the signal's number)."""
    from dllm_common import interrupt

    prefect_env(Path(args.workdir))
    from tasks.common import check_workdir

    workdir = check_workdir(args.workdir)
    interrupt.install()
    from flows.environment import open_log_file
    from flows.local_api import local_prefect_api

    Session.log_file = open_log_file(workdir)
    from flows.pipeline import cancel_flow_run, dllm_pipeline

    with local_prefect_api():
        try:
            return dllm_pipeline(workdir=str(workdir), **kwargs)
        except interrupt.Interrupted as exc:
            run_id = getattr(exc, "run_id", None)
            cancel_flow_run(getattr(exc, "flow_run_id", None), str(exc))
            where = f" during {exc.stage}" if getattr(exc, "stage", None) and not exc.where else ""
            how = (
                f"resume with: dllm-flow resume {run_id} --workdir {args.workdir}"
                if run_id
                else f"rerun: dllm-flow {args.command} ... --workdir {args.workdir}"
            )
            print(f"dllm-flow: {exc}{where}; {how}", file=sys.stderr, flush=True)
            return exc.exit_code


def cmd_resume(args) -> int:
    """Rerun a failed or crashed pipeline run with its recorded config; completed stages are reused."""
    from dllm_common.runs import find_record

    record = find_record(Path(args.workdir), args.run_id)
    if record.status == "COMPLETED":
        print(f"[dllm-flow] pipeline run {record.run_id} completed; nothing to resume")
        return 0
    if record.status == "RUNNING":
        raise ValueError(
            f"pipeline run {record.run_id} is still running (pid {record.pid} on {record.host}); "
            "wait for it or stop it before resuming"
        )
    check_tracking((record.config.get("tracking") or {}).get("uri"), Path(args.workdir))
    done = [s.name for s in record.stages if s.status in ("COMPLETED", "REUSED")]
    todo = [s.name for s in record.stages if s.status not in ("COMPLETED", "REUSED")]
    set_verification(args)
    config, overrides = record.config, list(record.overrides)
    if args.set:  # e.g. another layout, or train.skip_nonfinite_steps after a diverged step
        from dllm_common.config import apply_overrides

        config, overrides = apply_overrides(record.config, args.set), overrides + list(args.set)
    changed = f" and {' '.join('--set ' + s for s in args.set)}" if args.set else ""
    print(f"[dllm-flow] resuming pipeline run {record.run_id} ({record.status}) with its recorded config{changed}")
    print(f"[dllm-flow] completed before, will be reused: {', '.join(done) or 'none'}")
    print(f"[dllm-flow] to run again: {', '.join(todo) or 'none recorded'} (and every stage after them)")
    result = _run_pipeline(
        args,
        config_path=record.config_path,
        overrides=overrides,
        config=config,
        resumed_from=record.run_id,
    )
    if isinstance(result, int):
        return result
    print(
        f"[dllm-flow] pipeline run {result['run_id']} (resuming {record.run_id}) completed; report: {result['report']}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit 0, 2 with one `dllm-flow: error:` line for what the user can change (a stage's traceback is in the
    command's log file), 1 with one line for anything else, 128 + N after signal N (flows/cli_errors.py).
    `--debug` prints tracebacks."""
    args = build_parser().parse_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
