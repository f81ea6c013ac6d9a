"""Pipeline run records: `<workdir>/runs/<id>.json`, rewritten atomically as stages finish.

They back `dllm-flow runs` (status of each stage, MLflow run ids) and hold the resolved config,
so a failed run can be rerun with exactly what it was given.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dllm_common.store import atomic_write_text


@dataclass
class StageStatus:
    name: str
    status: str = "PENDING"  # PENDING | RUNNING | COMPLETED | REUSED | FAILED
    key: str | None = None
    mlflow_run_id: str | None = None
    seconds: float | None = None
    error: str | None = None


@dataclass
class RunRecord:
    run_id: str
    pipeline: str
    config_path: str
    overrides: list[str]
    config: dict
    config_sha256: str
    status: str = "RUNNING"
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    parent_mlflow_run_id: str | None = None
    prefect_flow_run_id: str | None = None
    stages: list[StageStatus] = field(default_factory=list)

    @staticmethod
    def new_id() -> str:
        return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]

    def path(self, workdir: Path) -> Path:
        return Path(workdir) / "runs" / f"{self.run_id}.json"

    def stage(self, name: str) -> StageStatus:
        for s in self.stages:
            if s.name == name:
                return s
        s = StageStatus(name)
        self.stages.append(s)
        return s

    def save(self, workdir: Path) -> None:
        atomic_write_text(self.path(workdir), json.dumps(asdict(self), indent=2, default=str))


def load_record(path: Path) -> RunRecord:
    raw = json.loads(Path(path).read_text())
    raw["stages"] = [StageStatus(**s) for s in raw.get("stages", [])]
    return RunRecord(**raw)


def list_records(workdir: Path) -> list[RunRecord]:
    folder = Path(workdir) / "runs"
    if not folder.is_dir():
        return []
    return sorted((load_record(p) for p in folder.glob("*.json")), key=lambda r: r.started_at)
