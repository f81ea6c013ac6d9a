"""`dllm-flow export CHECKPOINT OUT`: a trained checkpoint as a Hugging Face folder with a model card.

CHECKPOINT is anything `dllm-flow generate --checkpoint` takes (a checkpoint dir, a train store entry,
`models:/NAME@ALIAS`, `runs:/ID/model`). Its digests are verified before anything is written; the
folder is built in a temporary directory beside OUT and renamed into place, and an existing non-empty
OUT is never overwritten.

Layout of OUT:
    config.json, model.safetensors      the backbone as a plain transformers causal LM (`architectures`
      (or model-0000i-of-0000n.safetensors + model.safetensors.index.json above `max_shard_size`)
    tokenizer files                     as trained
    generation_config.json              token ids and the strategy's sampler settings (`dllm_*` keys)
    dllm.json, digests.json             the dllm-flow checkpoint record: `dllm-flow generate --checkpoint OUT`
    README.md                           the model card: model, loading, lineage, metrics, samples, repro card

One set of files serves both loaders where the checkpoint's weights *are* the backbone's (mdlm, scdd,
idlm; LoRA merged here first). A wrapped model (hybrid, block_diffusion: strategies/models.py keeps the
backbone as `.lm`, so its keys carry an `lm.` prefix and block_diffusion adds `self_cond`) and a sharded
export are written twice: the top level is the transformers backbone, `model/` the dllm-flow checkpoint
(`resolve_checkpoint` looks there; docs/strategies.md §8.3, §9.5). A DFlash draft is no transformers
model (it reads a frozen target's hidden states, docs/strategies.md §10.1): the top level is its
dllm-flow checkpoint and the card says which target it needs.

The card's metrics come from the checkpoint's evaluation: an `evaluate` store entry whose upstream
train key is the checkpoint's stage key (newest first), else the training's MLflow run (metrics and its
`eval/<key>/` artifacts), else none, and the card says so. Metric meanings: docs/evaluation.md §4.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from dllm_common.checkpoint import DIGESTS, CorruptCheckpointError, checkpoint_digest, read_meta, verify_checkpoint
from dllm_common.config import flatten
from dllm_common.store import MANIFEST, fsync_tree, sha256_file
from dllm_common.tracking import default_tracking_uri, quiet_environment
from strategies import strategy_class
from strategies.dflash_draft import DFlashDraftModel
from strategies.models import merge_lora, model_from_config_dir, resolve_model_path
from strategies.sampling import SamplerConfig
from tasks.checkpoints import checkpoint_options
from tasks.generate import default_temperature, resolve_checkpoint
from tasks.prepare_data import data_digest, load_tokenizer

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
META = "dllm.json"
GENERATION_CONFIG = "generation_config.json"
CARD = "README.md"
DLLM_SUBDIR = "model"  # where `resolve_checkpoint` finds a checkpoint inside a folder
MAX_SHARD_SIZE = "5GB"  # transformers' default shard size
WRAPPER_PREFIX = "lm."  # HybridLM / BlockDiffusionLM hold the backbone as `.lm`
# checkpoint files that are not the tokenizer's
NOT_TOKENIZER = {CONFIG, WEIGHTS, META, DIGESTS, "trainer_state.pt", DFlashDraftModel.CONFIG, GENERATION_CONFIG, CARD}
METRIC_PREFIXES = ("eval/", "dflash/")


def export_checkpoint(
    checkpoint: str,
    out: Path,
    workdir: Path,
    tracking_uri: str | None = None,
    *,
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> Path:
    """Write CHECKPOINT as a Hugging Face folder at `out` (see the module doc); returns `out`."""
    out = Path(out)
    _refuse_existing(out)
    remote = checkpoint.startswith(("models:/", "runs:/"))
    scratch = Path(tempfile.mkdtemp(prefix="dllm-export-")) if remote else None
    try:
        ckpt = resolve_checkpoint(checkpoint, Path(workdir), tracking_uri, scratch=scratch)
        try:
            verify_checkpoint(ckpt)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"refusing to export {checkpoint}: {exc}") from None
        source = Source.read(ckpt, checkpoint)
        found = find_provenance(source, Path(workdir), tracking_uri)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            write_export(staging, source, found, out.name, max_shard_size)
            fsync_tree(staging)
            _publish(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return out


def _refuse_existing(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise FileExistsError(
            f"export: {out} already exists and is not empty; nothing was written. Choose a new OUT, or remove it first"
        )


def _publish(staging: Path, out: Path) -> None:
    """Rename the finished folder into place (an empty `out` is replaced, a non-empty one refused)."""
    try:
        os.rename(staging, out)
    except OSError as exc:  # `out` appeared (non-empty) while the export ran
        raise FileExistsError(f"export: {out} appeared while exporting ({exc.strerror}); nothing was written") from None


# ------------------------------------------------------------------ the checkpoint


@dataclass
class Source:
    """The verified checkpoint: its record, config, tokenizer and weights (LoRA merged)."""

    path: Path
    ref: str
    meta: dict
    config: dict  # config.json, or dflash_draft.json for a draft
    tokenizer: Any
    tokenizer_files: list[str]
    tensors: dict[str, torch.Tensor]  # the dllm-flow module's state, tied weights once
    verbatim: bool  # tensors are exactly the checkpoint's model.safetensors
    lora_merged: bool
    digest: str  # checkpoint_digest: what an evaluation's repro card records

    @property
    def strategy(self) -> str:
        return self.meta["strategy"]

    @property
    def is_draft(self) -> bool:
        return (self.path / DFlashDraftModel.CONFIG).is_file()

    @property
    def wrapped(self) -> bool:
        return not self.is_draft and self.config.get("dllm_architecture") is not None

    @classmethod
    def read(cls, ckpt: Path, ref: str) -> Source:
        meta = read_meta(ckpt)
        strategy_class(meta["strategy"])  # an unknown strategy fails here, naming the available ones
        draft = (ckpt / DFlashDraftModel.CONFIG).is_file()
        config = json.loads((ckpt / (DFlashDraftModel.CONFIG if draft else CONFIG)).read_text())
        recorded = json.loads((ckpt / DIGESTS).read_text())
        tokenizer_files = sorted(n for n in recorded if n not in NOT_TOKENIZER)
        tensors, verbatim, merged = _checkpoint_tensors(ckpt, config)
        return cls(
            ckpt,
            ref,
            meta,
            config,
            load_tokenizer(str(ckpt)),
            tokenizer_files,
            tensors,
            verbatim,
            merged,
            checkpoint_digest(ckpt),
        )


def _checkpoint_tensors(ckpt: Path, config: dict) -> tuple[dict[str, torch.Tensor], bool, bool]:
    """(tensors, verbatim, lora merged): the file as stored, or, for a LoRA checkpoint that kept its
    adapters, the module with the adapters folded in, each tensor back in its stored dtype."""
    weights = ckpt / WEIGHTS
    if not config.get("dllm_lora"):
        return load_file(str(weights)), True, False
    model = model_from_config_dir(ckpt)
    load_model(model, str(weights), strict=True)  # digests verified by the caller
    merge_lora(model)
    with safe_open(str(weights), "pt") as f:
        dtypes = {k.replace(".base_layer", ""): f.get_slice(k).get_dtype() for k in f.keys()}
    stored = {name: getattr(torch, _TORCH_DTYPES.get(code, "float32")) for name, code in dtypes.items()}
    state = {k: v.detach().to(stored.get(k, v.dtype)) for k, v in model.state_dict().items()}
    return dedupe_tensors(state), False, True


_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64"}


def dedupe_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep one name per tensor that several names alias (tied embeddings): safetensors stores no aliases.
    The first name in sorted order stays, as `safetensors.torch.save_model` keeps it."""
    seen: set[tuple] = set()
    kept = {}
    for name in sorted(tensors):
        t = tensors[name]
        if t.numel():
            alias = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if alias in seen:
                continue
            seen.add(alias)
        kept[name] = t
    return kept


def backbone_tensors(source: Source) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the transformers backbone's tensors, names of the wrapper's own tensors left out of it)."""
    if not source.wrapped:
        return source.tensors, []
    n = len(WRAPPER_PREFIX)
    backbone = {k[n:]: v for k, v in source.tensors.items() if k.startswith(WRAPPER_PREFIX)}
    return backbone, sorted(k for k in source.tensors if not k.startswith(WRAPPER_PREFIX))


def write_weights(
    dest: Path, tensors: dict[str, torch.Tensor], max_shard_size: int | str = MAX_SHARD_SIZE
) -> list[str]:
    """`tensors` as `model.safetensors`, or, above `max_shard_size`, as transformers' shards
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`; returns the file names."""
    tensors = {k: v.contiguous() for k, v in dedupe_tensors(tensors).items()}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, str(dest / filename), metadata={"format": "pt"})
    files = list(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (dest / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files.append(WEIGHTS_INDEX)
    return files


def _is_sharded(tensors: dict[str, torch.Tensor], max_shard_size: int | str) -> bool:
    return split_torch_state_dict_into_shards(dedupe_tensors(tensors), max_shard_size=max_shard_size).is_sharded


def _token_ids(tokenizer) -> dict[str, int]:
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return {k: v for k, v in ids.items() if v is not None}


def dllm_config(source: Source) -> dict:
    """The checkpoint's config.json for dllm-flow: adapters merged, `architectures` named, and the
    special-token ids the tokenizer defines (a tiny model's config otherwise keeps Llama's defaults)."""
    config = {k: v for k, v in source.config.items() if not (source.lora_merged and k == "dllm_lora")}
    if not config.get("architectures") and config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    return {**config, **_token_ids(source.tokenizer)}


def hf_config(source: Source) -> dict:
    """config.json of the top level: the backbone alone (a wrapper's shape lives in `model/`)."""
    config = dllm_config(source)
    if source.wrapped:
        config = {k: v for k, v in config.items() if k not in ("dllm_architecture", "dllm_mask_token_id")}
    return config


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _copy_tokenizer(source: Source, dest: Path) -> None:
    for name in source.tokenizer_files:
        shutil.copyfile(source.path / name, dest / name)


def write_dllm_checkpoint(dest: Path, source: Source, meta: dict) -> None:
    """A checkpoint `load_for_generation` reads (the layout of dllm_common/checkpoint.py): config,
    one weights file, tokenizer, dllm.json, then digests.json over exactly those files (the card and
    generation_config.json stay editable)."""
    dest.mkdir(exist_ok=True)
    if source.is_draft:
        config_name = DFlashDraftModel.CONFIG
        shutil.copyfile(source.path / config_name, dest / config_name)
    else:
        config_name = CONFIG
        _write_json(dest / CONFIG, dllm_config(source))
    if source.verbatim:
        shutil.copyfile(source.path / WEIGHTS, dest / WEIGHTS)
    else:
        save_file({k: v.contiguous() for k, v in source.tensors.items()}, str(dest / WEIGHTS), {"format": "pt"})
    _copy_tokenizer(source, dest)
    _write_json(dest / META, meta)
    names = sorted([config_name, WEIGHTS, META, *source.tokenizer_files])
    _write_json(dest / DIGESTS, {n: sha256_file(dest / n) for n in names})


# ------------------------------------------------------------------ what the card reports


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


def find_provenance(source: Source, workdir: Path, tracking_uri: str | None) -> Provenance:
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
    if p.name == DLLM_SUBDIR and p.parent.parent.name == "train":
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
    from mlflow.tracking import MlflowClient  # after quiet_environment(): telemetry stays off

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
    if chosen is not None and "metrics.json" in files:
        metrics = {**metrics, **json.loads(files["metrics.json"])}
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


# ------------------------------------------------------------------ the folder


def write_export(dest: Path, source: Source, found: Provenance, name: str, max_shard_size: int | str) -> str:
    """Fill `dest`; returns the layout written ("shared", "separate" or "draft")."""
    backbone, extra = backbone_tensors(source)
    if source.is_draft:
        layout = "draft"
    elif source.wrapped or _is_sharded(backbone, max_shard_size):
        layout = "separate"
    else:
        layout = "shared"
    meta = {
        **source.meta,
        "export": {
            "source": source.ref,
            "source_checkpoint_digest": source.digest,
            "layout": layout,
            "lora_merged": source.lora_merged,
        },
    }
    if source.lora_merged and isinstance(meta.get("peft"), dict):
        meta["peft"] = {**meta["peft"], "merged": True}
    if layout == "separate":
        weight_files = write_weights(dest, backbone, max_shard_size)
        _write_json(dest / CONFIG, hf_config(source))
        _copy_tokenizer(source, dest)
        write_dllm_checkpoint(dest / DLLM_SUBDIR, source, meta)
    else:
        write_dllm_checkpoint(dest, source, meta)
        weight_files = [WEIGHTS]
    settings = generation_settings(source, found.evaluation)
    _write_json(dest / GENERATION_CONFIG, settings)
    card = model_card(source, found, name, layout, weight_files, extra, settings)
    (dest / CARD).write_text(card)
    return layout


def generation_settings(source: Source, evaluation: Evaluation | None) -> dict:
    """generation_config.json: the token ids transformers reads, and the strategy's sampler with the
    settings its evaluation sampled with (else the sampler defaults of strategies/sampling.py)."""
    cls = strategy_class(source.strategy)
    sampler = cls.samplers[0]  # what `dllm-flow generate --sampler auto` runs
    tok = source.tokenizer
    evaluated = (evaluation.repro_card or {}).get("sampler") if evaluation else None
    if evaluated:
        cfg, origin = evaluated, f"evaluation {evaluation.key}"
    else:
        cfg = {**SamplerConfig().__dict__, "temperature": default_temperature(sampler)}
        origin = "sampler defaults"
    temperature = float(cfg["temperature"])
    settings = {
        **_token_ids(tok),
        "mask_token_id": source.meta.get("mask_token_id"),
        "max_new_tokens": cfg["max_new_tokens"],
        "do_sample": temperature > 0,
        "dllm_strategy": source.strategy,
        "dllm_sampler": sampler,
        "dllm_sampler_name": cls.sampler_name,
        "dllm_steps": cfg["steps"],
        "dllm_block_size": cfg["block_size"],
        "dllm_temperature": temperature,
        "dllm_remasking": cfg.get("remasking"),
        "dllm_threshold": cfg.get("threshold"),
        "dllm_logit_shift": cls.logit_shift,
        "dllm_settings_from": origin,
    }
    if temperature > 0:
        settings["temperature"] = temperature
    return settings


def _md(value) -> str:
    """A table cell."""
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, sort_keys=True)
    else:
        text = "—" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows, header=("", "")) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {_md(k)} | {_md(v)} |" for k, v in rows]
    return "\n".join(lines)


def _fenced(text: str, lang: str = "") -> str:
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def base_model_license(train_config: dict | None) -> str | None:
    """The base model's license, where training started from a local pretrained model whose card names one."""
    config = flatten(train_config or {})  # a train manifest's slice, or MLflow's already flat params
    if config.get("model.kind") != "pretrained" or not config.get("model.path"):
        return None
    try:
        text = (Path(resolve_model_path(str(config["model.path"]))) / CARD).read_text()
    except OSError:  # a hub id, or no card
        return None
    front = re.match(r"---\n(.*?)\n---", text, flags=re.DOTALL)
    match = re.search(r"^license:\s*([\w.\-]+)\s*$", front.group(1), flags=re.MULTILINE) if front else None
    return match.group(1) if match else None


def _backbone_rows(source: Source, backbone: dict, extra: list[str]) -> list[tuple[str, Any]]:
    count = sum(t.numel() for t in dedupe_tensors(backbone).values())
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in source.tensors.values()})
    if source.is_draft:
        c = source.config
        rows = [("model", "DFlash draft (no embedding or LM head of its own)")]
        rows += [(k, c.get(k)) for k in ("hidden_size", "num_layers", "num_heads", "block_size", "target_layer_ids")]
        return [*rows, ("parameters", f"{count:,}"), ("dtype", ", ".join(dtypes))]
    c = source.config
    keys = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads")
    keys += ("num_key_value_heads", "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")
    rows = [(k, dllm_config(source).get(k) if k == "architectures" else c.get(k)) for k in keys]
    rows.append(("parameters (backbone)", f"{count:,}"))
    if extra:
        n_extra = sum(source.tensors[k].numel() for k in extra)
        rows.append(("parameters (strategy wrapper, dllm-flow only)", f"{n_extra:,} ({', '.join(extra)})"))
    return [*rows, ("dtype", ", ".join(dtypes))]


def model_card(
    source: Source,
    found: Provenance,
    name: str,
    layout: str,
    weight_files: list[str],
    extra: list[str],
    settings: dict,
) -> str:
    meta, strategy = source.meta, source.strategy
    cls = strategy_class(strategy)
    backbone, _ = backbone_tensors(source)
    license_id = base_model_license(found.train_config)
    front = ["---", "library_name: dllm-flow"]
    front += [f"license: {license_id}"] if license_id else []
    front += ["pipeline_tag: text-generation", "tags:", "- dllm-flow", "- diffusion-language-model", f"- {strategy}"]
    front += ["- safetensors", "---", ""]
    options = checkpoint_options(meta, cls.Options.model_fields)
    parts = ["\n".join(front), f"# {name}", ""]
    kind = "a DFlash draft for speculative decoding" if source.is_draft else "a diffusion language model"
    parts.append(
        f"`{strategy}` checkpoint exported by dllm-flow ({kind}); "
        f"trained {meta.get('step', '?')} steps on {meta.get('seq_len', '?')}-token rows."
    )
    if not license_id:
        parts.append("\nLicense: not recorded by dllm-flow; add a `license:` to the front matter before publishing.")

    parts += ["", "## Model", ""]
    rows = [
        ("strategy", strategy),
        ("sampler", f"{settings['dllm_sampler']} ({cls.sampler_name})"),
        ("mask token id", meta.get("mask_token_id")),
        ("chat template", "yes" if meta.get("chat") else "no"),
        ("final validation loss (nats/token)", meta.get("final_val_loss")),
    ]
    if meta.get("peft"):
        lora = meta["peft"]
        merged = "merged into the weights" + (" at export" if source.lora_merged else "")
        rows.append(("LoRA", f"r={lora.get('r')}, alpha={lora.get('alpha')}, {merged}"))
    parts += [_table(rows + _backbone_rows(source, backbone, extra), ("", "")), ""]
    parts += ["Strategy options (`dllm.json` → `options`):", "", _fenced(json.dumps(options, indent=2), "json"), ""]
    parts += _files_section(source, layout, weight_files, extra)
    parts += _loading_section(source, name, settings)
    parts += _lineage_section(source, found)
    parts += _evaluation_section(found)
    return "\n".join(parts).rstrip() + "\n"


def _files_section(source: Source, layout: str, weight_files: list[str], extra: list[str]) -> list[str]:
    weights = ", ".join(f"`{f}`" for f in weight_files)
    lines = ["## Files", ""]
    if layout == "shared":
        lines.append(
            f"`config.json` + {weights} are both the transformers backbone and the dllm-flow checkpoint "
            "(`dllm.json`, `digests.json`)."
        )
    elif layout == "separate":
        why = (
            f"the `{source.strategy}` model wraps the backbone (its checkpoint keys carry the wrapper's prefix"
            + (f" and the wrapper's own {', '.join(f'`{k}`' for k in extra)}" if extra else "")
            + ")"
            if source.wrapped
            else "the weights are sharded and dllm-flow reads one `model.safetensors`"
        )
        lines.append(
            f"`config.json` + {weights} are the plain transformers backbone. `{DLLM_SUBDIR}/` is the dllm-flow "
            f"checkpoint (the same weights in dllm-flow's layout), because {why}."
        )
    else:
        target = source.meta.get("target", {})
        lines.append(
            "This is **not a transformers model**: a DFlash draft has no embedding or LM head and reads the hidden "
            "states of a frozen causal target, so there is no `config.json` to load with `AutoModelForCausalLM`. "
            f"`dflash_draft.json` + {weights} are the dllm-flow checkpoint. It decodes with its target: "
            f"`{target.get('path')}` (weights digest `{target.get('weights_digest')}`), which must exist at that "
            "path where it is loaded."
        )
    lines += [
        "",
        "`generation_config.json` holds the token ids and the sampler settings (`dllm_*`); "
        "`digests.json` covers the checkpoint files, not this card or the generation settings.",
        "",
    ]
    return lines


def _loading_section(source: Source, name: str, settings: dict) -> list[str]:
    cmd = (
        f"dllm-flow generate --checkpoint {name} --prompt 'To be, or not to be' --steps {settings['dllm_steps']} "
        f"--block-size {settings['dllm_block_size']} --max-new-tokens {settings['max_new_tokens']}"
    )
    lines = ["## How to load", "", "With dllm-flow (the strategy's own sampler, rebuilt from `dllm.json`):", ""]
    lines += [_fenced(cmd, "bash"), ""]
    if source.is_draft:
        return lines
    mask = source.meta.get("mask_token_id")
    snippet = f"""import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{name}")
model = AutoModelForCausalLM.from_pretrained("{name}")
ids = tokenizer("To be, or not to be", return_tensors="pt").input_ids
ids = torch.cat([ids, torch.full((1, 8), {mask})], dim=1)  # 8 [MASK] tokens to denoise
visible = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool)  # every position sees every position
logits = model(input_ids=ids, attention_mask=visible).logits"""
    lines += ["With transformers (the backbone; one bidirectional denoising forward):", "", _fenced(snippet, "python")]
    note = (
        "The backbone was trained as a bidirectional denoiser: give it the all-visible 4-D mask above. "
        "`model.generate()` decodes left to right and is not the diffusion sampler"
    )
    if source.strategy == "hybrid":
        note += "; for a hybrid model it is the causal (AR) branch, which was trained too"
    return [*lines, "", note + ".", ""]


def _lineage_section(source: Source, found: Provenance) -> list[str]:
    meta = source.meta
    rows = [
        ("source checkpoint", source.ref),
        ("checkpoint digest (sha256 of digests.json)", source.digest),
        ("train stage key", meta.get("stage_key")),
        ("data key", meta.get("data_key")),
        ("data digest", found.data_digest or "not found"),
        ("data digest from", found.data_digest_source),
        ("MLflow run id", meta.get("mlflow_run_id")),
        ("MLflow tracking URI", found.tracking_uri),
        ("registered model", found.registered_model),
    ]
    if meta.get("target"):
        t = meta["target"]
        rows += [("DFlash target", t.get("path")), ("target weights digest", t.get("weights_digest"))]
    lines = ["## Training lineage", "", _table(rows, ("", "")), ""]
    if found.train_config:
        lines += [f"Training configuration (from {found.train_config_source}):", ""]
        lines += [_fenced(json.dumps(found.train_config, indent=2, sort_keys=True), "json"), ""]
    else:
        lines += ["Training configuration: not found (no train store entry or MLflow run reachable).", ""]
    return lines


def _evaluation_section(found: Provenance) -> list[str]:
    ev = found.evaluation
    lines = ["## Evaluation", ""]
    if ev is None:
        lines.append("No evaluation found for this checkpoint: this export carries no metrics.")
        lines += [f"- {n}" for n in found.notes] + [""]
        lines += ["## Reproducibility card", "", "None (no evaluation found).", ""]
        return lines
    lines += [f"From {ev.source}. Metric definitions: dllm-flow's docs/evaluation.md.", ""]
    lines += [_table(sorted(ev.metrics.items()), ("metric", "value")), ""]
    if ev.others:
        lines += [f"Other evaluations of this checkpoint: {', '.join(ev.others)}.", ""]
    lines += ["### Sample outputs", ""]
    lines += [_fenced(ev.samples, "text") if ev.samples else "No samples recorded.", ""]
    lines += ["## Reproducibility card", ""]
    if ev.repro_card:
        lines += [_table(sorted(flatten(ev.repro_card).items()), ("field", "value")), ""]
    else:
        lines += ["Not recorded with this evaluation.", ""]
    return lines
