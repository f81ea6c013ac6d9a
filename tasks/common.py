"""What every stage shares: the small descriptor a stage returns, code versions, the Prefect wrapper.

Stages exchange `StageRef`s (store paths, keys, run ids), never tensors or models.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prefect import task

from dllm_common.config import PipelineSpec
from dllm_common.lineage import code_digest, import_closure, same_project
from dllm_common.store import Store, refuse_read_only
from dllm_common.tracking import Tracking


@dataclass(frozen=True)
class StageRef:
    stage: str  # e.g. "prepare_data", "train[mdlm]"
    key: str
    path: str  # published store entry
    reused: bool = False
    mlflow_run_id: str | None = None
    info: dict = field(default_factory=dict)

    def as_reused(self) -> StageRef:
        return replace(self, reused=True)

    @classmethod
    def of(cls, entry, reused: bool, name: str | None = None, run_id_key: str = "mlflow_run_id", **info) -> StageRef:
        """The descriptor of a published store entry: its manifest's `info` (plus `info` given here); the
        MLflow run is `info[run_id_key]`; `name` defaults to the entry's stage."""
        merged = {**entry.manifest["info"], **info}
        return cls(name or entry.stage, entry.key, str(entry.path), reused, merged.get(run_id_key), merged)


def stage_code_version(entry: str, strategy: str | None = None, evaluation: bool | None = None) -> str:
    """The code version in a stage's key: a digest of every first-party module the stage module `entry` imports,
    directly or not (`dllm_common.lineage`), and for a stage of one strategy, of the modules the registry loads
    on demand for it (`strategies.registry.on_demand_modules`) and their imports. Editing any of them rebuilds
    the stage and everything downstream; no list of modules is kept by hand (docs/architecture.md, "Stage
    keys").

    `evaluation`: whether the stage runs the strategy's evaluation hooks (samplers, likelihood rows), so that its
    evaluator's modules are keyed too; None (the default) decides from the code: a stage whose import closure
    holds the evaluators' base module (`strategies.registry.evaluation_api`, where `SampleRequest` lives) does.
    A training stage never does, so editing a sampler re-runs evaluation and never training."""
    if strategy is None:
        return code_digest(entry)
    from strategies.registry import evaluation_api, on_demand_modules

    if evaluation is None:
        evaluation = evaluation_api() in import_closure(entry)
    own, other = [], []  # a strategy registered from a package outside the project is keyed by its own closure
    for module in on_demand_modules(strategy, evaluation=evaluation):
        (own if same_project(entry, module) else other).append(module)
    return "-".join([code_digest(entry, *own), *(code_digest(m) for m in other)])


def tracking_for(spec: PipelineSpec, workdir: str | Path) -> Tracking:
    """The pipeline's MLflow tracking (the workdir's sqlite store unless `tracking.uri` is set)."""
    return Tracking(Path(workdir), spec.tracking.uri, spec.tracking.experiment or spec.pipeline.name)


def store_for(workdir: str | Path) -> Store:
    return Store(Path(workdir) / "store")


def published_results(workdir: str | Path) -> dict:
    """What a workdir's store published, per strategy: the trained weights' sha256 and the evaluation's metrics
    (throughputs left out: they are timings). Two runs that computed the same thing give equal dicts."""
    out: dict = {}
    root = Path(workdir) / "store"
    for manifest in (root / "train").glob("*/manifest.json"):
        m = json.loads(manifest.read_text())
        out.setdefault(m["strategy"], {})["weights"] = m["files"]["model/model.safetensors"]["sha256"]
    for manifest in (root / "evaluate").glob("*/manifest.json"):
        m = json.loads(manifest.read_text())
        metrics = {k: v for k, v in m["info"]["metrics"].items() if not k.endswith("per_s")}
        out.setdefault(m["strategy"], {})["eval"] = metrics
    return out


def check_workdir(workdir: str | Path) -> Path:
    """Create the workdir, or say clearly why it cannot be used."""
    p = Path(workdir).resolve()
    if p.exists() and not p.is_dir():
        raise FileExistsError(f"--workdir {p} is a file, not a directory; pass --workdir DIR with a directory path")
    blocker = next((a for a in p.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise FileExistsError(
            f"--workdir {p} is not writable: {blocker} is a file, not a directory; pass --workdir DIR with a "
            "writable path"
        )
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(
            f"workdir {p} is not writable ({exc.strerror}); pass --workdir DIR with a writable path"
        ) from None
    # a read-only mount at one stage's folder of the store: refused here, before any stage, not by that stage's first
    # write after the stages before it ran (the mount's flag alone: a folder another user owns in a shared store
    # may belong to a stage this pipeline never runs)
    for folder in sorted(f for f in (p / "store").iterdir() if f.is_dir()) if (p / "store").is_dir() else []:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            raise PermissionError(
                f"{folder} is on a read-only mount: stage {folder.name} publishes there; remount it read-write or "
                "pass --workdir DIR with a writable path"
            )
    for folder in (p / "store", p / "runs"):  # a read-only mount inside it: refused here, not by a stage's write
        if folder.is_dir():
            refuse_read_only(
                folder,
                f"{folder} is not writable",
                "every stage publishes and every run records there; make it writable (remount it read-write) or "
                "pass --workdir DIR with a writable path",
            )
    return p


def prefect_task(
    fn: Callable,
    *,
    name: str,
    stage_of: Callable[..., tuple[str, str]],
    retries: int = 0,
    side_effects_for: Callable[..., str] | None = None,
) -> Any:
    """Thin Prefect `@task` over a plain stage function, cached by the stage's store key.

    The cache key is `<stage>/<key>/prefect-result-<hash of the store's path>` and the flow roots
    result storage at the store (`flows.pipeline.store_result_storage`), so Prefect's cached result lives
    *inside* the published entry: deleting an entry also drops Prefect's memory of it, and a half-written
    stage is never served from cache. The entry is checked before Prefect looks (`Store.lookup`): a damaged
    entry is moved aside with the cached result inside it, so a cache hit never skips the verification.
    `side_effects_for(**parameters)` names what the body does outside the store (the MLflow run an evaluation
    logs into): a different answer misses Prefect's cache, so the body runs, reuses the entry and redoes them.
    """

    def cache_key(_context, parameters: dict) -> str:
        stage, key = stage_of(**parameters)
        if parameters.get("workdir") is None:
            return f"{stage}/{key}/prefect-result"
        store = store_for(parameters["workdir"])
        store.lookup(stage, key)
        # the cached StageRef holds absolute paths: a result is only valid where the store was when it was written
        # (a moved or copied workdir misses once, reuses its entries and caches refs to its own files)
        where = str(store.root.resolve())
        if side_effects_for is not None:
            where += "\0" + side_effects_for(**parameters)
        return f"{stage}/{key}/prefect-result-{hashlib.sha256(where.encode()).hexdigest()[:12]}"

    return task(fn, name=name, cache_key_fn=cache_key, persist_result=True, retries=retries)


def fmt_number(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)
