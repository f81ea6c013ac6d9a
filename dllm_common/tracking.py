"""Experiment tracking: a four-method `Tracker` (params, metrics, artifact, close) over MLflow.

MLflow's "active run" is thread-local and Prefect runs tasks in threads, so everything here goes
through `MlflowClient` with explicit run ids: one parent run per pipeline run, one child run per
strategy created with an explicit `mlflow.parentRunId` tag. `NullTracker` is the no-op twin.

MLflow itself is imported inside the methods that use it: `flows` imports this module at start-up,
before `quiet_environment()` has switched telemetry off, and must stay light.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from dllm_common.config import ConfigError

TELEMETRY_OFF = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# MLflow's UI opens an experiment carrying this kind in its model-training mode (runs, metric charts),
# not on the GenAI overview an untagged experiment may be shown as.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"


def quiet_environment() -> None:
    """Telemetry off everywhere; set before MLflow/Prefect/transformers are imported."""
    for k, v in TELEMETRY_OFF.items():
        os.environ.setdefault(k, v)


def default_tracking_uri(workdir: Path) -> str:
    """The workdir's own MLflow store (sqlite), checked and relocated first if the workdir was moved or copied."""
    relocate_local_store(workdir)
    return f"sqlite:///{Path(workdir).resolve() / 'mlflow.db'}"


class DamagedStoreError(ValueError):
    """A local MLflow sqlite store that sqlite cannot read (truncated, overwritten): a problem a person fixes by
    moving the file aside; the message says how."""


def check_local_store(db: Path, workdir: Path | None = None) -> None:
    """Refuse a damaged sqlite store before MLflow opens it (it would fail deep inside SQLAlchemy): one
    read-only open and `PRAGMA quick_check`. The file is never written, moved or deleted. A missing or empty
    file is fine (MLflow creates its tables), and so is a store that is only busy (locked by a writer)."""
    import sqlite3

    db = Path(db)
    if not db.is_file() or db.stat().st_size == 0:
        return
    problem = None
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=30)) as con:
            rows = [r[0] for r in con.execute("PRAGMA quick_check(3)")]
            if rows != ["ok"]:
                problem = "; ".join(str(r) for r in rows)
    except sqlite3.OperationalError:
        return  # locked, busy or unreadable for now: not damage; MLflow reports what it finds
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        problem = str(exc)
    if problem is None:
        return
    stage_store = (Path(workdir).resolve() if workdir is not None else db.parent) / "store"
    raise DamagedStoreError(
        f"MLflow store {db} is damaged ({problem}); move it aside (mv {db} {db}.damaged) to start a fresh "
        f"tracking store — the stage store under {stage_store} is untouched"
    )


REACH_SECONDS = 5.0  # how long a tracking server has to answer before a run starts (MLflow's client would retry ~4 min)


class UnreachableTrackingServer(ConfigError):
    """An http(s) tracking URI where nothing answers: a setting to change (or a server to start), said at once
    instead of after MLflow's client has retried for minutes."""


class TrackingLoginRefused(ConfigError):
    """A tracking server that refuses the login (HTTP 401): said at once, naming the variables that hold the login
    (docs/operations.md, "Credentials"), instead of MLflow's raw 401 after its client's retries."""


def _login_headers() -> tuple[dict[str, str], str | None]:
    """The Authorization header MLflow's client would send (basic auth from MLFLOW_TRACKING_USERNAME/PASSWORD,
    which dllm-flow sets from DLLM_SERVER_* (dllm_common/credentials.py), else MLFLOW_TRACKING_TOKEN), and the
    user it names."""
    import base64

    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}, user
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        return {"Authorization": f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"}, None
    return {}, None


def check_tracking_server(uri: str | None, key: str = "tracking.uri", seconds: float = REACH_SECONDS) -> None:
    """Refuse an http(s) tracking URI that does not answer within `seconds`, or whose server refuses the login
    (HTTP 401 to an API request that carries it; MLflow's /health needs none). Any other HTTP answer counts (a
    proxy, a path prefix: something is there, and MLflow reports what it finds), and so does a TLS handshake that
    failed (the port is open); only no answer at all (refused, unreachable, unknown host, timed out) is refused.
    Other URIs (sqlite, file, databricks) are not servers to reach."""
    if not uri or not uri.startswith(("http://", "https://")):
        return
    import socket
    import ssl
    import urllib.error
    import urllib.request

    headers, user = _login_headers()
    probe = urllib.request.Request(
        uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1", headers=headers
    )
    try:
        urllib.request.urlopen(probe, timeout=seconds).close()
        return
    except urllib.error.HTTPError as exc:
        if exc.code != 401:
            return
        who = (
            f"of user {user!r} (a wrong password or an unknown user)"
            if user
            else "of MLFLOW_TRACKING_TOKEN"
            if headers
            else "(no credentials are set)"
        )
        raise TrackingLoginRefused(
            f"{key} {uri}: the MLflow server refused the login {who}; set DLLM_SERVER_USER and "
            "DLLM_SERVER_PASSWORD, or DLLM_SERVER_AUTH_FILE (one line USER:PASSWORD, mode 0600), to a login it "
            'accepts (docs/operations.md, "Credentials")'
        ) from None
    except urllib.error.URLError as exc:
        reason = exc.reason
    except (OSError, ValueError) as exc:  # a timeout while reading, an URL urllib cannot parse
        reason = exc
    if isinstance(reason, ssl.SSLError):
        return
    timed_out = isinstance(reason, (TimeoutError, socket.timeout))
    what = f"no answer in {seconds:g} s" if timed_out else str(getattr(reason, "strerror", None) or reason)
    flag = key.startswith("--")
    drop = (
        f"drop {key} to read the workdir's own store (WORKDIR/mlflow.db)"
        if flag
        else f"remove {key} to track into the workdir's own store (WORKDIR/mlflow.db)"
    )
    raise UnreachableTrackingServer(
        f"{key} {uri}: no MLflow tracking server answers there ({what}); start it (`make server` serves one at "
        f"http://127.0.0.1:5000) or {drop}"
    )


# where MLflow's sqlite store keeps absolute artifact paths: (table, column)
_ARTIFACT_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
    ("logged_models", "artifact_location"),
)


def relocate_local_store(workdir: Path) -> str | None:
    """A workdir that was moved, copied or mounted elsewhere still has the old absolute artifact root in its
    `mlflow.db` (MLflow stores absolute paths), so its runs would read, and new artifacts land, under the old
    location. Rewrite that root to this workdir's `mlartifacts` (one line says so); returns the old root, or
    None when nothing had to change. Only the workdir's own sqlite store is touched."""
    import sqlite3

    db = Path(workdir).resolve() / "mlflow.db"
    if not db.is_file():
        return None
    check_local_store(db, workdir)
    new = artifact_root(workdir)
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as con:
        try:
            locations = [r[0] for r in con.execute("SELECT artifact_location FROM experiments")]
        except sqlite3.DatabaseError:
            return None  # not an MLflow store (yet): MLflow itself reports that
        old = {loc[: loc.index("/mlartifacts") + len("/mlartifacts")] for loc in locations if "/mlartifacts" in loc}
        old.discard(new)
        if len(old) != 1:
            return None
        (previous,) = old
        with con:
            for table, column in _ARTIFACT_COLUMNS:
                try:
                    con.execute(
                        f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE substr({column}, 1, ?) = ?",
                        (new, len(previous) + 1, len(previous), previous),
                    )
                except sqlite3.OperationalError:  # a column this MLflow version does not have
                    continue
    print(f"[dllm-flow] workdir moved: MLflow's artifact paths rewritten from {previous} to {new}", file=sys.stderr)
    return previous


def artifact_root(workdir: Path) -> str:
    return (Path(workdir).resolve() / "mlartifacts").as_uri()


class NullTracker:
    run_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...


class MlflowTracker:
    """Tracker bound to one MLflow run id; safe to use from any thread."""

    def __init__(self, client, run_id: str):
        self.client = client
        self.run_id = run_id

    def log_params(self, params: dict[str, Any]) -> None:
        # lazy: mlflow loads only after quiet_environment() and stays off the flows import path
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        items = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # lazy: mlflow loads only after quiet_environment() and stays off the flows import path
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(k, float(v), now, int(step)) for k, v in metrics.items() if v is not None and v == v
        ]  # None/NaN: nothing to log
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def last_step(self, key: str) -> int:
        """Highest step logged for `key` (-1 if none): a resumed run skips what is already there."""
        history = self.client.get_metric_history(self.run_id, key)
        return max((m.step for m in history), default=-1)

    def set_tags(self, tags: dict[str, Any]) -> None:
        # lazy: mlflow loads only after quiet_environment() and stays off the flows import path
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        p = Path(path)
        if p.is_dir():
            self.client.log_artifacts(self.run_id, str(p), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(p), artifact_path)

    def log_dataset(self, path: Path, name: str, digest: str, context: str = "training") -> None:
        # lazy: mlflow loads only after quiet_environment() and stays off the flows import path
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        with warnings.catch_warnings():  # two equivalent local-source classes are registered; either is right
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(Path(path).resolve().as_uri())
        ds = MetaDataset(source=source, name=name, digest=digest[:36])
        entity = DatasetInput(dataset=ds._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])
        try:
            self.client.log_inputs(self.run_id, datasets=[entity])
        except Exception as exc:
            # two trainings of one pipeline on two workers log the same dataset at once: the server looks it up,
            # finds none, and both insert it; the second insert breaks the unique key (PostgreSQL's
            # UniqueViolation on dataset_pk, sqlite's UNIQUE constraint). Logged again, the dataset now exists
            # and only this run's input is added.
            if not any(word in str(exc) for word in ("UniqueViolation", "UNIQUE constraint", "duplicate key")):
                raise
            time.sleep(0.5)
            self.client.log_inputs(self.run_id, datasets=[entity])

    def register_model(self, name: str, artifact_path: str) -> str:
        """Register `runs:/<run>/<artifact_path>`; MLflow resolves the reserved alias `latest` to it."""
        # lazy: mlflow loads only after quiet_environment() and stays off the flows import path
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException:
            pass  # already registered
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/{artifact_path}"
        version = self.client.create_model_version(name, source=source, run_id=self.run_id)
        return version.version

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


@contextlib.contextmanager
def _store_lock(uri: str):
    """An exclusive lock beside a local sqlite store while it is created or migrated (MLflow's schema migration
    is not safe against a second process doing the same); a no-op for a tracking server."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


class Tracking:
    """Opens the experiment and creates/reopens runs. `uri=None` → sqlite in the workdir."""

    def __init__(self, workdir: Path, uri: str | None, experiment: str):
        quiet_environment()
        from mlflow.tracking import MlflowClient  # lazy: only after quiet_environment() (telemetry off)

        self.workdir = Path(workdir)
        if uri and uri.startswith("sqlite:///"):  # a given (or recorded) local store: checked like the workdir's
            check_local_store(Path(uri.removeprefix("sqlite:///").split("?", 1)[0]), self.workdir)
        self.uri = uri or default_tracking_uri(self.workdir)
        with _store_lock(self.uri):  # two runs starting on one workdir: one creates the store, the other waits
            self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
            exp_id = self._experiment(experiment)
        self.experiment_id = exp_id

    def _experiment(self, experiment: str) -> str:
        """The experiment's id, created (with its kind tag) if it is new."""
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            location = artifact_root(self.workdir) if self.uri.startswith("sqlite") else None
            exp_id = self.client.create_experiment(
                experiment, artifact_location=location, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND}
            )
        else:
            exp_id = exp.experiment_id
            if EXPERIMENT_KIND_TAG not in exp.tags:  # created before the tag, or by hand: mark it, keep a chosen kind
                self.client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        return exp_id

    def start_run(self, name: str, tags: dict[str, Any], parent_run_id: str | None = None) -> MlflowTracker:
        all_tags = {k: str(v) for k, v in tags.items()}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return MlflowTracker(self.client, run.info.run_id)

    def reopen(self, run_id: str) -> MlflowTracker:
        """Continue an existing run (a resumed training stage keeps its child run)."""
        self.client.update_run(run_id, status="RUNNING")
        return MlflowTracker(self.client, run_id)

    def run_exists(self, run_id: str | None) -> bool:
        if not run_id:
            return False
        try:
            self.client.get_run(run_id)
            return True
        except Exception:
            return False
