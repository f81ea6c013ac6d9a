"""What an exported model card reports about a checkpoint: its evaluation, data digest and training config.

Looked up in the stores that may hold them, then in the training's MLflow run: an `evaluate` store entry
whose upstream train key is the checkpoint's stage key (newest first), else the training's MLflow run
(metrics and its `eval/<key>/` artifacts), else none, and the card says so. Metric meanings:
docs/evaluation.md §4.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mlflow.tracking import MlflowClient

from dllm_common.store import MANIFEST
from dllm_common.tracking import default_tracking_uri, quiet_environment
from tasks.prepare_data import data_digest

METRIC_PREFIXES = ("eval/", "dflash/")
TRAIN_MODEL_DIR = "model"  # a train store entry keeps its checkpoint in `<store>/train/<key>/model`


class Checkpoint(Protocol):
    """What the look-ups read of the verified checkpoint (`tasks.commands.export.Source` is one)."""

    path: Path
    meta: dict
    digest: str  # checkpoint_digest: what an evaluation's repro card records


@dataclass
class Evaluation:
    source: str  # where the numbers come from, in words
    key: str | None = None
    metrics: dict = field(default_factory=dict)
    samples: str | None = None
    repro_card: dict | None = None
    others: list[str] = field(default_factory=list)  # other evaluations of the same checkpoint


@dataclass
class Provenance:
    evaluation: Evaluation | None = None
    data_digest: str | None = None
    data_digest_source: str | None = None
    train_config: dict | None = None
    train_config_source: str | None = None
    registered_model: str | None = None
    tracking_uri: str | None = None
    notes: list[str] = field(default_factory=list)  # what could not be found, and why


def find_provenance(source: Checkpoint, workdir: Path, tracking_uri: str | None) -> Provenance:
    """Evaluation, data digest and training config from the stores that may hold them, then MLflow."""
    found = Provenance()
    stores = _stores(source.path, workdir)
    meta = source.meta
    found.evaluation = _store_evaluation(stores, meta.get("stage_key"), source.digest)
    for store in stores:
        manifest = _read_json(store / "train" / str(meta.get("stage_key")) / MANIFEST)
        if manifest and "config" in manifest and found.train_config is None:
            found.train_config = manifest["config"]
            found.train_config_source = f"train store entry {store / 'train' / meta['stage_key']}"
        data_entries = sorted(store.glob(f"*/{meta['data_key']}/{MANIFEST}")) if meta.get("data_key") else []
        for entry in data_entries:
            digest = _data_digest(entry)
            if digest and found.data_digest is None:
                found.data_digest, found.data_digest_source = digest, f"store entry {entry.parent}"
    run_id = meta.get("mlflow_run_id")
    complete = found.evaluation and found.data_digest and found.train_config
    if run_id and not complete:
        _from_mlflow(found, run_id, _tracking_uris(source.path, workdir, tracking_uri))
    elif not run_id:
        found.notes.append("the checkpoint records no MLflow run")
    return found


def _stores(ckpt: Path, workdir: Path) -> list[Path]:
    """The store a checkpoint lives in (`<store>/train/<key>/model`) and the workdir's."""
    candidates = []
    p = ckpt.resolve()
    if p.name == TRAIN_MODEL_DIR and p.parent.parent.name == "train":
        candidates.append(p.parent.parent.parent)
    candidates.append((Path(workdir) / "store").resolve())
    unique = []
    for c in candidates:
        if c.is_dir() and c not in unique:
            unique.append(c)
    return unique


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _data_digest(manifest_file: Path) -> str | None:
    manifest = _read_json(manifest_file)
    try:
        return data_digest(manifest) if manifest else None
    except KeyError:  # not a prepared-rows entry
        return None


def _store_evaluation(stores: list[Path], stage_key: str | None, ckpt_digest: str) -> Evaluation | None:
    """The newest published evaluation of this checkpoint in the stores."""
    if not stage_key:
        return None
    found = []
    for store in stores:
        for manifest_file in (store / "evaluate").glob(f"*/{MANIFEST}"):
            manifest = _read_json(manifest_file)
            if not manifest or manifest.get("upstream", {}).get("train") != stage_key:
                continue
            entry = manifest_file.parent
            card = _read_json(entry / "repro_card.json")
            if card and card.get("checkpoint_digest") not in (None, ckpt_digest):
                continue  # evaluated other weights under the same key
            found.append((manifest.get("published_at", 0.0), entry, manifest, card))
    if not found:
        return None
    found.sort(key=lambda f: f[0], reverse=True)
    _, entry, manifest, card = found[0]
    metrics = _read_json(entry / "metrics.json") or manifest.get("info", {}).get("metrics", {})
    samples = (entry / "samples.txt").read_text() if (entry / "samples.txt").is_file() else None
    others = [f[1].name for f in found[1:]]
    return Evaluation(f"evaluate store entry {entry}", entry.name, metrics, samples, card, others)


def _tracking_uris(ckpt: Path, workdir: Path, tracking_uri: str | None) -> list[str]:
    """The explicit URI, else the workdir's (and the checkpoint's workdir's) MLflow database where it exists:
    looking never creates a database."""
    if tracking_uri:
        return [tracking_uri]
    uris = []
    for store in _stores(ckpt, workdir):
        if (store.parent / "mlflow.db").is_file():
            uris.append(default_tracking_uri(store.parent))
    if (Path(workdir) / "mlflow.db").is_file():
        uris.append(default_tracking_uri(Path(workdir)))
    return list(dict.fromkeys(uris))


def _from_mlflow(found: Provenance, run_id: str, uris: list[str]) -> None:
    if not uris:
        found.notes.append(f"no MLflow tracking store to read run {run_id} from (pass --tracking-uri or --workdir)")
        return
    quiet_environment()
    for uri in uris:
        client = MlflowClient(uri, registry_uri=uri)
        try:
            run = client.get_run(run_id)
        except Exception as exc:  # MlflowException (unknown run), or an unreachable server
            found.notes.append(f"MLflow run {run_id} not readable at {uri}: {str(exc).splitlines()[0]}")
            continue
        found.tracking_uri = uri
        found.registered_model = run.data.tags.get("dllm.registered_model")
        if found.evaluation is None:
            found.evaluation = _mlflow_evaluation(client, run)
        if found.data_digest is None:
            _mlflow_dataset(found, run)
        if found.train_config is None and run.data.params:
            found.train_config = dict(sorted(run.data.params.items()))
            found.train_config_source = f"the params of MLflow run {run_id}"
        return


def _mlflow_evaluation(client, run) -> Evaluation | None:
    """The run's `eval/*` and `dflash/*` metrics, and the files of the `eval/<key>/` folder that logged them."""
    run_id = run.info.run_id
    metrics = {k: v for k, v in run.data.metrics.items() if k.startswith(METRIC_PREFIXES)}
    folders = []
    try:
        folders = sorted(a.path for a in client.list_artifacts(run_id, "eval") if a.is_dir)
    except Exception:  # no artifact store reachable: the metrics alone
        pass
    chosen, files = None, {}
    with tempfile.TemporaryDirectory(prefix="dllm-export-eval-") as tmp, _no_progress_bars():
        for folder in folders:
            got = {}
            for name in ("metrics.json", "samples.txt", "repro_card.json"):
                try:
                    got[name] = Path(client.download_artifacts(run_id, f"{folder}/{name}", tmp)).read_text()
                except Exception:  # a file this evaluation did not log
                    pass
            logged = json.loads(got.get("metrics.json", "{}"))
            if chosen is None or (logged and all(metrics.get(k) == v for k, v in logged.items())):
                chosen, files = folder, got
    if not metrics and chosen is None:
        return None
    if chosen is not None and "metrics.json" in files:  # that evaluation's own set: no key of another one
        metrics = json.loads(files["metrics.json"])
    key = chosen.rsplit("/", 1)[-1] if chosen else None
    where = f"MLflow run {run_id}" + (f", artifacts {chosen}/" if chosen else "")
    card = json.loads(files["repro_card.json"]) if "repro_card.json" in files else None
    others = [f.rsplit("/", 1)[-1] for f in folders if f != chosen]
    return Evaluation(where, key, metrics, files.get("samples.txt"), card, others)


@contextlib.contextmanager
def _no_progress_bars():
    """MLflow draws a progress bar per downloaded artifact; the card's few small files need none."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(name)
    os.environ[name] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _mlflow_dataset(found: Provenance, run) -> None:
    """The training dataset input: its store entry's full digest where the source is still on disk,
    else the digest MLflow recorded (the first 36 hex digits)."""
    for ds_input in run.inputs.dataset_inputs if run.inputs else []:
        ds = ds_input.dataset
        try:
            uri = json.loads(ds.source).get("uri", "")
        except (TypeError, json.JSONDecodeError):
            uri = ""
        local = Path(uri.removeprefix("file://")) if uri.startswith("file://") else None
        digest = _data_digest(local / MANIFEST) if local else None
        if digest:
            found.data_digest, found.data_digest_source = digest, f"store entry {local} (MLflow dataset input)"
        else:
            found.data_digest = ds.digest
            found.data_digest_source = f"MLflow dataset input {ds.name!r} (digest as MLflow records it: 36 hex digits)"
        return
