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
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger
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


def _stages(spec: PipelineSpec, wd: Path, record: RunRecord, parent_run_id: str) -> dict:
    """Run the graph the declared stages give for `spec` (`tasks.stages.derive`): the pipeline stages before the
    strategies, each strategy's chain (fanned out, `pipeline.max_parallel` at a time), the pipeline stages after.
    Imported here, not at module level: the task layer imports torch (a CPU pipeline worker never needs it)."""
    from strategies import strategy_class
    from tasks.stages import StageContext, derive
    from tasks.training import distributed

    graph = derive(spec, strategy_class)
    # node k > 0 of a multi-node training only lends its ranks to the trainings: node 0 runs the rest
    follower = distributed.node_rank(spec.train) > 0
    ctx = StageContext(spec, str(wd), parent_run_id, record.run_id)
    runner = GraphRunner(graph, ctx, StageRunner(record, wd, store_result_storage(wd)), follower)
    runner.run_checks()
    for node in graph.head:
        runner.execute(node)
    strategies = [s for s in spec.pipeline.strategies if s in graph.chains]
    fan_out(runner.chain, strategies, spec.pipeline.max_parallel, distributed.terminate_children)
    if follower:
        rank = distributed.node_rank(spec.train)
        print(f"[dllm-flow] node {rank} of {spec.train.nnodes}: trainings done; node 0 runs the rest")
    else:
        for node in graph.tail:
            runner.execute(node)
    return {"run_id": record.run_id, **runner.outputs, "stages": {s.name: s.status for s in record.stages}}


@dataclass
class GraphRunner:
    """Runs a derived graph's nodes through `StageRunner` (each its stage's Prefect task), handing each the refs
    of the nodes it reads and the context values its function takes; the stages' checks run as soon as the roles
    they read exist."""

    graph: object
    ctx: object
    run: StageRunner
    follower: bool
    refs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)

    def __post_init__(self) -> None:
        seen = set()
        for node in self.graph.nodes():
            if node.stage.name in seen or (self.follower and node.stage.leader_only):
                continue
            seen.add(node.stage.name)
            self.checks += [(node.stage.produces, roles, check) for roles, check in node.stage.checks]

    def run_checks(self) -> None:
        """The declared checks whose roles the pipeline stages run so far produced (each once)."""
        have = {n.stage.produces: self.refs[n.name] for n in self.graph.head if n.name in self.refs}
        for item in list(self.checks):
            _, roles, check = item
            if all(role in have for role in roles):
                self.checks.remove(item)
                check(self.ctx.spec, **{role: have[role] for role in roles})

    def chain(self, strategy: str) -> list:
        return [self.execute(node) for node in self.graph.chains[strategy]]

    def _value(self, value):
        if isinstance(value, dict):
            return {role: self._value(v) for role, v in value.items()}
        if isinstance(value, list):
            return [self.refs.get(n.name) for n in value if self.refs.get(n.name) is not None]
        return self.refs.get(value.name)

    def execute(self, node) -> StageRef | None:
        """Run `node` (None: skipped, on a follower node, or because what it reads was skipped)."""
        stage, ctx = node.stage, self.ctx
        if self.follower and (stage.leader_only or any(self.refs.get(u.name) is None for u in node.upstream())):
            return None
        kwargs = {param: self._value(value) for param, value in node.inputs.items()}
        wanted = stage.parameters(ctx.spec)
        kwargs.update({k: v for k, v in ctx.values(node.strategy).items() if k in wanted})
        ref = self.refs[node.name] = self.run(node.name, stage.task_of(ctx.spec), **kwargs)
        if stage.after is not None:
            self.outputs.update(stage.after(ref, kwargs, ctx) or {})
        if not node.strategy:
            self.run_checks()
        return ref
