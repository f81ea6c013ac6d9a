"""The pipeline flow: composition only. Load + validate the YAML once, then chain the stages:

    prepare_data → [dflash: pretrain_target | target → (regenerate) → cache_target] → train[strategy]
    → evaluate[strategy] (for each strategy) → report

Each stage is a cached Prefect task keyed by its store key; the flow records stage statuses in
the workdir's run record and opens the parent MLflow run. No torch import here.
"""

from __future__ import annotations

import hashlib
import subprocess
import time
from pathlib import Path

from prefect import flow

from dllm_common.config import PipelineSpec, config_sha256, flatten, load_config, validate_config
from dllm_common.runs import RunRecord
from tasks.cache_target import cache_target_task
from tasks.common import StageRef, check_workdir
from tasks.evaluate import evaluate_task
from tasks.prepare_data import prepare_data_task
from tasks.regenerate import regenerate_task
from tasks.report import publish_report, report_task
from tasks.target import stage_name as target_stage_name
from tasks.target import target_task
from tasks.train import check_strategies, train_remote_task, train_task


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


def _run_stage(record: RunRecord, record_dir: Path, storage: str, name: str, task, **kwargs) -> StageRef:
    status = record.stage(name)
    status.status = "RUNNING"
    record.save(record_dir)
    t0 = time.time()
    state = task.with_options(task_run_name=name, result_storage=storage)(**kwargs, return_state=True)
    status.seconds = round(time.time() - t0, 2)
    if not state.is_completed():
        status.status, status.error = "FAILED", str(state.message)[:2000]
        record.save(record_dir)
        state.result()  # re-raises the stage's exception
    ref: StageRef = state.result()
    reused = ref.reused or state.name == "Cached"
    status.status = "REUSED" if reused else "COMPLETED"
    status.key, status.mlflow_run_id = ref.key, ref.mlflow_run_id
    record.save(record_dir)
    print(f"[dllm-flow] {name}: {'reused' if reused else 'ran'} ({status.seconds:.1f}s) key={ref.key}", flush=True)
    return ref.as_reused() if reused else ref


def _open_parent(spec: PipelineSpec, workdir: Path, record: RunRecord):
    from dllm_common.tracking import Tracking

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

    overrides = list(overrides or [])
    spec = (
        validate_config(config, f"recorded config of run {resumed_from}")
        if config
        else load_config(config_path, overrides)
    )
    check_strategies(spec.pipeline.strategies)
    wd = check_workdir(workdir)
    record = RunRecord(
        run_id or RunRecord.new_id(),
        spec.pipeline.name,
        str(config_path),
        overrides,
        spec.model_dump(mode="json"),
        config_sha256(spec),
        prefect_flow_run_id=str(flow_run.id or ""),
        resumed_from=resumed_from,
    )
    parent = _open_parent(spec, wd, record)
    record.parent_mlflow_run_id = parent.run_id
    record.save(wd)
    try:
        result = _stages(spec, wd, record, parent.run_id)
    except BaseException:
        record.status, record.finished_at = "FAILED", time.time()
        record.save(wd)
        parent.close("FAILED")
        raise
    record.status, record.finished_at = "COMPLETED", time.time()
    record.save(wd)
    parent.set_tags({"dllm.reused_stages": ",".join(s.name for s in record.stages if s.status == "REUSED")})
    parent.close("FINISHED")
    return result


def _stages(spec: PipelineSpec, wd: Path, record: RunRecord, parent_run_id: str) -> dict:
    workdir = str(wd)
    storage = store_result_storage(wd)
    data = _run_stage(record, wd, storage, "prepare_data", prepare_data_task, spec=spec, workdir=workdir)
    inputs: dict[str, StageRef] = {}
    draft_data = data  # what the DFlash draft trains on: the prepared rows, or the target's rewrite of them
    if "dflash" in spec.pipeline.strategies:  # the frozen target, its own text (optional), its features (cached)
        inputs["target"] = _run_stage(
            record,
            wd,
            storage,
            target_stage_name(spec),
            target_task,
            spec=spec,
            data=data,
            workdir=workdir,
            parent_run_id=parent_run_id,
        )
        if spec.dflash.regenerate is not None:
            draft_data = _run_stage(
                record,
                wd,
                storage,
                "regenerate",
                regenerate_task,
                spec=spec,
                target=inputs["target"],
                data=data,
                workdir=workdir,
            )
        if spec.dflash.target_features == "cached":
            inputs["features"] = _run_stage(
                record,
                wd,
                storage,
                "cache_target",
                cache_target_task,
                spec=spec,
                target=inputs["target"],
                data=draft_data,
                workdir=workdir,
            )
    trained, evaluated = [], []
    trainer = train_remote_task if spec.pipeline.train_deployment else train_task
    for strategy in spec.pipeline.strategies:
        dflash = strategy == "dflash"
        t = _run_stage(
            record,
            wd,
            storage,
            f"train[{strategy}]",
            trainer,
            spec=spec,
            strategy=strategy,
            data=draft_data if dflash else data,
            workdir=workdir,
            parent_run_id=parent_run_id,
            inputs=inputs if dflash else None,
        )
        e = _run_stage(
            record,
            wd,
            storage,
            f"evaluate[{strategy}]",
            evaluate_task,
            spec=spec,
            strategy=strategy,
            trained=t,
            data=data,
            workdir=workdir,
        )
        trained.append(t)
        evaluated.append(e)
    rep = _run_stage(
        record,
        wd,
        storage,
        "report",
        report_task,
        pipeline_name=spec.pipeline.name,
        trained=trained,
        evaluated=evaluated,
        workdir=workdir,
        tracking_uri=spec.tracking.uri,
        experiment=spec.tracking.experiment,
    )
    publish_report(
        rep,
        trained,
        evaluated,
        workdir,
        parent_run_id,
        spec.tracking.uri,
        spec.tracking.experiment or spec.pipeline.name,
    )
    return {
        "run_id": record.run_id,
        "report": str(Path(rep.path) / "report.md"),
        "stages": {s.name: s.status for s in record.stages},
    }
