"""The pipeline flow: composition only. Load + validate the YAML once, then chain the stages:

    prepare_data → [dflash: pretrain_target | target → (regenerate) → cache_target] → train[strategy]
    → evaluate[strategy] (for each strategy) → report

Each stage is a cached Prefect task keyed by its store key; the flow records stage statuses in
the workdir's run record and opens the parent MLflow run. Which upstream stages run, and on which
data each strategy trains, is what the strategies declare (`upstream_stages`, `training_data`).

No torch import at module level: `_stage_tasks` imports the task layer when the flow runs, the one
place where flows/ crosses into torch (a CPU pipeline worker and `prefect deploy` never need it).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import MissingContextError

from dllm_common.config import PipelineSpec, config_sha256, flatten
from dllm_common.interrupt import Interrupted
from dllm_common.interrupt import requested as interrupt_requested
from dllm_common.runs import RunRecord
from dllm_common.tracking import Tracking, check_tracking_server
from tasks.common import StageRef, check_workdir


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def store_result_storage(workdir: Path) -> str:
    """A Prefect storage block rooted at the workdir's stage store, so each task's cached result is
    written inside its own store entry (see `tasks.common.prefect_task`), under any worker."""
    from prefect.filesystems import LocalFileSystem

    root = (workdir / "store").resolve()
    root.mkdir(parents=True, exist_ok=True)
    name = "dllm-store-" + hashlib.sha256(str(root).encode()).hexdigest()[:12]
    LocalFileSystem(basepath=str(root)).save(name, overwrite=True)
    return f"local-file-system/{name}"


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The flow run's logger (its lines are the flow run's Logs tab in the Prefect UI); a plain logger
    outside a flow run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("dllm_flow")


def report_artifact_key(pipeline_name: str) -> str:
    """Prefect artifact keys take lowercase letters, digits and dashes."""
    return "dllm-report-" + (re.sub(r"[^a-z0-9]+", "-", pipeline_name.lower()).strip("-") or "pipeline")


@dataclass
class StageRunner:
    """Runs a stage's Prefect task with the store-rooted result storage and records its status."""

    record: RunRecord
    record_dir: Path
    storage: str
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, name: str, task, **kwargs) -> StageRef:
        record, log = self.record, run_logger()
        with self.lock:  # strategies fanned out run stages from several threads
            status = record.stage(name)
            status.status = "RUNNING"
            record.save(self.record_dir)
        log.info("%s: started", name)
        t0 = time.time()
        try:
            state = task.with_options(task_run_name=name, result_storage=self.storage)(**kwargs, return_state=True)
        except Interrupted as exc:
            with self.lock:
                status.status, status.seconds, status.error = "INTERRUPTED", round(time.time() - t0, 2), str(exc)
                record.save(self.record_dir)
            exc.stage = name
            raise
        status.seconds = round(time.time() - t0, 2)
        if not state.is_completed():
            with self.lock:
                status.status, status.error = "FAILED", str(state.message)[:2000]
                record.save(self.record_dir)
            log.error("%s: FAILED after %.1fs: %s", name, status.seconds, status.error)
            state.result()  # re-raises the stage's exception
        ref: StageRef = state.result()
        reused = ref.reused or state.name == "Cached"
        with self.lock:
            status.status = "REUSED" if reused else "COMPLETED"
            status.key, status.mlflow_run_id = ref.key, ref.mlflow_run_id
            record.save(self.record_dir)
        line = f"{name}: {'reused' if reused else 'ran'} ({status.seconds:.1f}s) key={ref.key}"
        print(f"[dllm-flow] {line}", flush=True)
        why = "a published store entry with this key" if ref.reused else "Prefect's cached result for this key"
        log.info("%s%s%s", line, f"; reused {why}" if reused else "", f"; entry {ref.path}" if ref.path else "")
        return ref.as_reused() if reused else ref


def _open_parent(spec: PipelineSpec, workdir: Path, record: RunRecord):
    check_tracking_server(spec.tracking.uri)  # seconds, not MLflow's minutes of retries, before any stage
    tracking = Tracking(workdir, spec.tracking.uri, spec.tracking.experiment or spec.pipeline.name)
    tags = {
        "dllm.pipeline": spec.pipeline.name,
        "dllm.config_sha256": record.config_sha256,
        "dllm.git_commit": git_commit(),
        "dllm.prefect_flow_run_id": record.prefect_flow_run_id or "",
        "dllm.pipeline_run_id": record.run_id,
    }
    parent = tracking.start_run(f"{spec.pipeline.name}-{record.run_id}", tags)
    parent.log_params(flatten(spec))
    return parent


@flow(name="dllm-pipeline")
def dllm_pipeline(
    config_path: str,
    overrides: list[str] | None = None,
    workdir: str = "work",
    run_id: str | None = None,
    config: dict | None = None,
    resumed_from: str | None = None,
) -> dict:
    """Run every stage of the pipeline declared in `config_path` (with `--set` overrides), or of the
    resolved `config` mapping recorded by an earlier run (what `dllm-flow resume` passes)."""
    from prefect.runtime import flow_run

    from dllm_common import interrupt
    from strategies.options import load_config, validate_config  # the strategy registry (imports torch)

    interrupt.install()  # over Prefect's own SIGTERM bridge, which would abort a training step mid-way

    overrides = list(overrides or [])
    spec = (
        validate_config(config, f"recorded config of run {resumed_from}")
        if config
        else load_config(config_path, overrides, note=False)  # the command that started the flow noted it
    )
    wd = check_workdir(workdir)
    record = RunRecord(
        run_id=run_id or RunRecord.new_id(),
        pipeline=spec.pipeline.name,
        config_path=str(config_path),
        overrides=overrides,
        config=spec.model_dump(mode="json"),
        config_sha256=config_sha256(spec),
        prefect_flow_run_id=str(flow_run.id or ""),
        resumed_from=resumed_from,
    )
    parent = _open_parent(spec, wd, record)
    record.parent_mlflow_run_id = parent.run_id
    record.save(wd)
    log = run_logger()
    log.info(
        "pipeline run %s of %s (strategies: %s)%s; workdir %s; MLflow parent run %s",
        record.run_id,
        spec.pipeline.name,
        ", ".join(spec.pipeline.strategies),
        f", resuming {resumed_from}" if resumed_from else "",
        wd,
        parent.run_id,
    )
    try:
        result = _stages(spec, wd, record, parent.run_id)
    except BaseException as exc:
        _record_end(exc, record, wd, parent)
        raise
    record.status, record.finished_at = "COMPLETED", time.time()
    record.save(wd)
    parent.set_tags({"dllm.reused_stages": ",".join(s.name for s in record.stages if s.status == "REUSED")})
    parent.close("FINISHED")
    return result


def _record_end(exc: BaseException, record: RunRecord, wd: Path, parent) -> None:
    """A run that did not complete: INTERRUPTED with its MLflow runs KILLED (a signal), else FAILED. The tracking
    server may be what failed: a second error from it never hides the first."""
    log = run_logger()
    interrupted = isinstance(exc, Interrupted)
    record.status, record.finished_at = ("INTERRUPTED" if interrupted else "FAILED"), time.time()
    record.save(wd)
    try:
        if interrupted:
            end_open_runs(parent, "KILLED")
        else:
            parent.close("FAILED")
    except Exception as tracking_error:
        log.warning("could not end the MLflow runs of %s: %s", record.run_id, tracking_error)
    if interrupted:
        log.info("pipeline run %s %s", record.run_id, exc)
        exc.run_id, exc.flow_run_id = record.run_id, record.prefect_flow_run_id
    else:
        if getattr(exc, "run_id", False) is None:  # an error whose fix is to resume this run (tasks/rows.py)
            exc.run_id = record.run_id
        log.error("pipeline run %s failed: %s: %s", record.run_id, type(exc).__name__, str(exc)[:2000])
        with contextlib.suppress(AttributeError, TypeError):  # the command names the run to resume
            exc.run_id = record.run_id


class StrategiesFailed(RuntimeError):
    """Some strategies of a fanned-out pipeline failed; the others finished (`dllm-flow resume` reruns these)."""


def fan_out(chain, strategies, limit: int, terminate) -> dict:
    """`chain(strategy)` for every strategy, at most `limit` at a time (in threads of this flow, each with the
    flow's context, so the Prefect UI shows their task runs side by side; the heavy work of each runs in its
    own process, tasks/training/distributed.py). One failing strategy does not stop the others: once all have ended,
    `StrategiesFailed` names the ones that failed. A signal stops the children and raises `Interrupted`."""
    if limit == 1 or len(strategies) == 1:
        return {s: chain(s) for s in strategies}
    slots, results, errors = threading.Semaphore(limit), {}, {}

    def one(strategy: str) -> None:
        with slots:
            if interrupt_requested():  # the run is stopping: start nothing more
                return
            try:
                results[strategy] = chain(strategy)
            except BaseException as exc:  # kept for the summary; the other strategies go on
                errors[strategy] = exc

    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(one, s), name=f"strategy-{s}", daemon=True)
        for s in strategies
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.2)  # short waits: the main thread stays responsive to signals
    except Interrupted:
        terminate()  # the trainings checkpoint and stop; the threads waiting on them end with them
        deadline = time.time() + 8
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.time()))
        raise
    if errors:
        first = next(iter(errors.values()))
        lines = "; ".join(
            f"{s}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}" for s, e in errors.items()
        )
        done = [s for s in strategies if s in results]
        failed = StrategiesFailed(
            f"{len(errors)} of {len(strategies)} strategies failed ({lines}); finished: {', '.join(done) or 'none'}. "
            "`dllm-flow resume` reruns only what failed"
        )
        failed.errors = errors
        raise failed from first
    return results


def end_open_runs(parent, status: str) -> None:
    """End the parent MLflow run and every child run still open (the interrupted stage's) with `status`."""
    client = parent.client
    experiment = client.get_run(parent.run_id).info.experiment_id
    children = client.search_runs(
        [experiment], f"tags.`mlflow.parentRunId` = '{parent.run_id}' and attributes.status = 'RUNNING'"
    )
    for run in children:
        client.set_terminated(run.info.run_id, status=status)
    parent.close(status)


def cancel_flow_run(flow_run_id: str | None, message: str) -> None:
    """Mark an interrupted pipeline's Prefect flow run Cancelled (the engine leaves it Crashed)."""
    if not flow_run_id:
        return
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=True)
    except Exception as exc:  # the API is gone: the run record still says INTERRUPTED
        logging.getLogger("dllm_flow").warning("could not mark flow run %s cancelled: %s", flow_run_id, exc)


def _stage_tasks() -> SimpleNamespace:
    """The task layer's Prefect tasks and the strategy registry, imported when a flow runs (they import
    torch), not when flows/ is imported."""
    from dllm_common.harness_tasks import check_harness_tasks
    from strategies import strategy_class
    from tasks import cache_target, evaluate, prepare_data, regenerate, report, target, train
    from tasks.training import distributed

    return SimpleNamespace(
        strategy_class=strategy_class,
        prepare_data=prepare_data.prepare_data_task,
        target=target.target_task,
        target_stage_name=target.stage_name,
        regenerate=regenerate.regenerate_task,
        cache_target=cache_target.cache_target_task,
        train=train.train_task,
        train_remote=train.train_remote_task,
        evaluate=evaluate.evaluate_task,
        check_samples_fit=evaluate.check_samples_fit,
        check_harness_tasks=check_harness_tasks,
        report=report.report_task,
        publish_report=report.publish_report,
        ParentRun=report.ParentRun,
        node_rank=distributed.node_rank,
        terminate_children=distributed.terminate_children,
    )


def _upstream(spec: PipelineSpec, run: StageRunner, t: SimpleNamespace, data: StageRef, parent_run_id: str):
    """The stages the pipeline's strategies declare (a frozen target, its regenerated text, its feature
    cache), each run once; returns (inputs by role, the regenerated data or None)."""
    classes = [t.strategy_class(name) for name in spec.pipeline.strategies]
    roles = {role for cls in classes for role in cls.upstream_stages(spec)}
    regenerated = any(cls.training_data(spec) == "regenerated" for cls in classes)
    inputs: dict[str, StageRef] = {}
    if "target" in roles or regenerated:
        inputs["target"] = run(
            t.target_stage_name(spec),
            t.target,
            spec=spec,
            data=data,
            workdir=str(run.record_dir),
            parent_run_id=parent_run_id,
        )
    new_data = None
    if regenerated:
        new_data = run(
            "regenerate", t.regenerate, spec=spec, target=inputs["target"], data=data, workdir=str(run.record_dir)
        )
    if "features" in roles:  # the target's features over the rows its users train on
        inputs["features"] = run(
            "cache_target",
            t.cache_target,
            spec=spec,
            target=inputs["target"],
            data=new_data or data,
            workdir=str(run.record_dir),
        )
    return inputs, new_data


def _stages(spec: PipelineSpec, wd: Path, record: RunRecord, parent_run_id: str) -> dict:
    workdir, t = str(wd), _stage_tasks()
    run = StageRunner(record, wd, store_result_storage(wd))
    t.check_harness_tasks(spec.eval.lm_eval)  # a resumed or deployed run checks too (cached after the CLI's check)
    data = run("prepare_data", t.prepare_data, spec=spec, workdir=workdir)
    # node k > 0 of a multi-node training only lends its ranks to the trainings: node 0 evaluates and reports
    follower = t.node_rank(spec.train) > 0
    if not follower:  # what only the data's tokenizer shows, refused before any training
        t.check_samples_fit(spec, data)
    upstream, regenerated = _upstream(spec, run, t, data, parent_run_id)
    trainer = t.train_remote if spec.pipeline.train_deployment else t.train

    def chain(strategy: str) -> tuple[StageRef, StageRef | None]:
        """One strategy: its training, then (as soon as that ends) its evaluation."""
        cls = t.strategy_class(strategy)
        own = {role: upstream[role] for role in cls.upstream_stages(spec)}
        train_data = regenerated if cls.training_data(spec) == "regenerated" else data
        trained = run(
            f"train[{strategy}]",
            trainer,
            spec=spec,
            strategy=strategy,
            data=train_data,
            workdir=workdir,
            parent_run_id=parent_run_id,
            inputs=own or None,
        )
        if follower:
            return trained, None
        evaluated = run(
            f"evaluate[{strategy}]",
            t.evaluate,
            spec=spec,
            strategy=strategy,
            trained=trained,
            data=data,
            workdir=workdir,
        )
        return trained, evaluated

    results = fan_out(chain, spec.pipeline.strategies, spec.pipeline.max_parallel, t.terminate_children)
    trained = [results[s][0] for s in spec.pipeline.strategies]
    evaluated = [results[s][1] for s in spec.pipeline.strategies]
    if follower:
        print(f"[dllm-flow] node {t.node_rank(spec.train)} of {spec.train.nnodes}: trainings done; node 0 evaluates")
        return {"run_id": record.run_id, "report": None, "stages": {s.name: s.status for s in record.stages}}
    rep = run(
        "report",
        t.report,
        pipeline_name=spec.pipeline.name,
        trained=trained,
        evaluated=evaluated,
        workdir=workdir,
        tracking_uri=spec.tracking.uri,
        experiment=spec.tracking.experiment,
    )
    parent = t.ParentRun(parent_run_id, spec.tracking.uri, spec.tracking.experiment or spec.pipeline.name)
    t.publish_report(rep, trained, evaluated, workdir, parent)
    publish_report_artifact(Path(rep.path) / "report.md", spec.pipeline.name, record, wd, parent_run_id)
    return {
        "run_id": record.run_id,
        "report": str(Path(rep.path) / "report.md"),
        "stages": {s.name: s.status for s in record.stages},
    }


def publish_report_artifact(report_md: Path, pipeline_name: str, record: RunRecord, wd: Path, parent_run_id: str):
    """The report as a markdown artifact of the flow run (its Artifacts tab in the Prefect UI). Its plots
    are files beside report.md, which the Prefect UI cannot show: they are named by their paths instead."""
    text = re.sub(r"!\[[^\]]*\]\(([^)]+)\)", lambda m: f"- `{wd / m.group(1)}`", report_md.read_text())
    create_markdown_artifact(
        markdown=text,
        key=report_artifact_key(pipeline_name),
        description=(
            f"dllm-flow report of pipeline run {record.run_id} ({pipeline_name}); "
            f"MLflow parent run {parent_run_id}; {wd / 'report.md'}"
        ),
    )
    run_logger().info(
        "report: %s, published as Prefect artifact %s", wd / "report.md", report_artifact_key(pipeline_name)
    )
