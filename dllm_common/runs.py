"""Pipeline run records: `<workdir>/runs/<id>.json`, rewritten atomically as stages finish.

They back `dllm-flow runs` (status of each stage, MLflow run ids) and hold the resolved config,
so a failed run can be rerun with exactly what it was given.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dllm_common.store import atomic_write_text

# fanned-out strategies save the record from several threads: each save serializes and replaces the file
# whole, one at a time, so the last save on disk holds the latest state (never an older snapshot written late)
_SAVING = threading.Lock()


@dataclass
class StageStatus:
    name: str
    status: str = "PENDING"  # PENDING | RUNNING | COMPLETED | REUSED | FAILED | CRASHED | INTERRUPTED
    key: str | None = None
    mlflow_run_id: str | None = None
    seconds: float | None = None
    error: str | None = None


@dataclass(kw_only=True)
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
    pid: int | None = field(default_factory=os.getpid)  # the process running the flow ...
    host: str | None = field(default_factory=socket.gethostname)  # ... and its machine (crash detection)
    resumed_from: str | None = None  # the failed run this one reran (`dllm-flow resume`)

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
        with _SAVING:
            atomic_write_text(self.path(workdir), json.dumps(asdict(self), indent=2, default=str))


class UnreadableRecord(ValueError):
    """A run record that does not parse (truncated, edited by hand, another version's)."""


def load_record(path: Path) -> RunRecord:
    try:
        raw = json.loads(Path(path).read_text())
        raw["stages"] = [StageStatus(**s) for s in raw.get("stages", [])]
        return RunRecord(**raw)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise UnreadableRecord(f"run record {path} is unreadable ({type(exc).__name__}: {exc})") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def detect_crash(record: RunRecord, workdir: Path) -> RunRecord:
    """A record still "RUNNING" whose process is gone (killed, OOM, dead worker) becomes CRASHED, as do
    its running stages. Only decidable on the machine that ran it; elsewhere the record is left as is."""
    if record.status == "RUNNING" and record.pid and record.host == socket.gethostname() and not _alive(record.pid):
        record.status = "CRASHED"
        for stage in record.stages:
            if stage.status == "RUNNING":
                stage.status = "CRASHED"
        record.save(workdir)
    return record


def read_records(workdir: Path) -> tuple[list[RunRecord], list[str]]:
    """(the readable run records, oldest first; one message per unreadable record): a damaged record hides
    only itself."""
    folder = Path(workdir) / "runs"
    records, unreadable = [], []
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            records.append(detect_crash(load_record(p), workdir))
        except UnreadableRecord as exc:
            unreadable.append(str(exc))
    return sorted(records, key=lambda r: r.started_at), unreadable


def list_records(workdir: Path) -> list[RunRecord]:
    return read_records(workdir)[0]


def find_record(workdir: Path, run_id: str) -> RunRecord:
    path = Path(workdir) / "runs" / f"{run_id}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no pipeline run {run_id!r} in {workdir}; `dllm-flow runs --workdir {workdir}` lists them"
        )
    return detect_crash(load_record(path), workdir)
