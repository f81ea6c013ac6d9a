"""Checkpoint IO: self-describing directories whose files are verified by sha256 before loading.

Layout of a checkpoint dir:
    model.safetensors        weights (safetensors only; never pickle)
    config.json              the HF model config (so `from_pretrained` can rebuild the module)
    tokenizer*.json ...      the tokenizer, saved with `save_pretrained`
    dllm.json                strategy, mask id, step and anything a sampler needs
    trainer_state.pt         optional: optimizer + scheduler state (loaded with weights_only=True)
    digests.json             sha256 of every file above, written last

A file whose digest does not match is never deserialized: `CorruptCheckpointError` names it. Nor is a weights file
whose header declares a tensor the model cannot take (`check_weights_fit`: another kind of dtype, another shape),
whoever wrote it: `WeightsMismatchError` names the file, the tensor and the flag or key that pointed there.
Checkpoints are written to a temp dir and renamed into place, so a crash never leaves a torn one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any

from dllm_common import faults
from dllm_common.store import fsync_tree, sha256_file

DIGESTS = "digests.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # with shards model-0000i-of-0000n.safetensors (transformers' layout)
MAX_SHARD_SIZE = "5GB"  # transformers' default: one file below it, shards and an index above


class CorruptCheckpointError(RuntimeError):
    pass


class WeightsMismatchError(CorruptCheckpointError):
    """A weights file whose header declares a tensor the model it is loaded into cannot take."""


def write_checkpoint(
    dest: Path,
    model,
    tokenizer=None,
    meta: dict | None = None,
    trainer_state: dict | None = None,
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> Path:
    """Atomically (re)write checkpoint `dest` from a model (+ tokenizer, metadata, optimizer state)."""
    # lazy: dllm_common stays torch-free at import (flows imports this module with torch blocked)
    import torch

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-{dest.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_weights(tmp, model.state_dict(), max_shard_size)
        faults.reached("checkpoint.written")
        model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "dllm.json").write_text(json.dumps(meta or {}, indent=2, sort_keys=True))
        if trainer_state is not None:
            torch.save(trainer_state, tmp / "trainer_state.pt")
        digests = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / DIGESTS).write_text(json.dumps(digests, indent=2, sort_keys=True))
        fsync_tree(tmp)
        swap_into(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


# inside a workdir's store, `run --verify` re-hashes every entry and rebuilds a damaged one (set aside, not deleted)
_REBUILD = (
    "rerun the pipeline with `dllm-flow run --verify` to set the damaged stage aside and rebuild it, or replace {path}"
)


def verify_checkpoint(path: Path) -> dict[str, str]:
    """Check every recorded digest; raise `CorruptCheckpointError` naming the first bad file."""
    path = Path(path)
    problem, digests = checkpoint_problem(path)
    if problem is not None and not (path / DIGESTS).is_file():
        raise CorruptCheckpointError(problem)
    if problem is not None:
        raise CorruptCheckpointError(f"{problem}; {_REBUILD.format(path=path)}")
    return digests


def checkpoint_problem(path: Path) -> tuple[str | None, dict[str, str] | None]:
    """(what is wrong with checkpoint `path`, or None; its digest table where it could be read)."""
    path = Path(path)
    digest_file = path / DIGESTS
    if not digest_file.is_file():
        return f"{path} is not a dllm-flow checkpoint (no {DIGESTS}); it may be incomplete", None
    try:
        digests = json.loads(digest_file.read_text())
    except json.JSONDecodeError:
        return f"{digest_file} is unreadable", None
    for name, expected in digests.items():
        f = path / name
        if not f.is_file():
            return f"checkpoint file {f} is missing", digests
        if sha256_file(f) != expected:
            return f"checkpoint file {f} is corrupt (sha256 mismatch, not loaded)", digests
    return None, digests


def swap_into(tmp: Path, dest: Path) -> None:
    """Put the complete folder `tmp` at `dest`, replacing what is there: the old folder is renamed aside, the new
    one renamed in, the old one removed. A crash between the renames is undone by `recover_checkpoint`."""
    old = None
    if dest.exists():
        old = dest.parent / f".old-{dest.name}-{uuid.uuid4().hex[:8]}"
        os.rename(dest, old)
        faults.reached("checkpoint.swap")
    os.rename(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover_checkpoint(dest: Path) -> bool:
    """Undo what a writer killed mid-way left (`write_checkpoint` is a swap of two renames): with `dest`
    missing, the previous checkpoint it had moved aside is renamed back; leftover temp and old copies are
    removed. Call before a training stage looks for its checkpoint; returns whether one was restored."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        return False
    olds = sorted(dest.parent.glob(f".old-{dest.name}-*"), key=lambda p: p.stat().st_mtime)
    restored = False
    if not dest.exists() and olds:
        os.rename(olds.pop(), dest)
        restored = True
    for leftover in [*olds, *dest.parent.glob(f".tmp-{dest.name}-*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    return restored


def dedupe_tensors(tensors: dict) -> dict:
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


def write_weights(dest: Path, tensors: dict, max_shard_size: int | str = MAX_SHARD_SIZE) -> list[str]:
    """`tensors` as `model.safetensors`, or, above `max_shard_size`, as transformers' shards
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`; returns the file names."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in dedupe_tensors(tensors).items()}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, str(Path(dest) / filename), metadata={"format": "pt"})
    files = list(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (Path(dest) / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files.append(WEIGHTS_INDEX)
    return files


def weight_files(path: Path) -> list[str]:
    """The safetensors files of a checkpoint: `model.safetensors`, or the shards its index names."""
    index = Path(path) / WEIGHTS_INDEX
    if not index.is_file():
        return [WEIGHTS]
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def read_weights(path: Path) -> dict:
    """Every stored tensor of a checkpoint (one file or its shards), by name."""
    from safetensors.torch import load_file

    out = {}
    for name in weight_files(path):
        out.update(load_file(str(Path(path) / name)))
    return out


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / "dllm.json").read_text())


def tied_groups(model) -> list[list[str]]:
    """The names under which one parameter is registered more than once (tied embeddings: the input
    embedding and the LM head), one list per shared parameter."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def load_weights_into(model, path: Path, where: str | None = None) -> None:
    """Verify `path`, check its tensors' headers against `model` (`check_weights_fit`; `where`: the flag or key
    that named the checkpoint, for the message), then load its safetensors weights into `model` (strict)."""
    # lazy: dllm_common stays torch-free at import (flows imports this module with torch blocked);
    # resolved per call, so a test can stand in for load_model
    from safetensors.torch import load_model

    verify_checkpoint(path)
    check_weights_fit(model, [Path(path) / name for name in weight_files(path)], where)
    if not (Path(path) / WEIGHTS_INDEX).is_file():
        load_model(model, str(Path(path) / WEIGHTS), strict=True)
        return
    state = read_weights(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a name left out of the files because it aliases a stored one (tied embeddings) is loaded through it
    aliased = {n for names in tied_groups(model) if any(m in state for m in names) for n in names}
    missing = [n for n in missing if n not in aliased]
    if missing or unexpected:
        raise CorruptCheckpointError(
            f"{path}: its weights do not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )


# ------------------------------------------------------------------ weights checked against the model before loading

HEADER_BYTES = 8  # a safetensors file starts with its JSON header's length, a little-endian u64


MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own bound on its JSON header


def safetensors_header(file: Path) -> dict[str, dict]:
    """Every tensor a safetensors file declares (name → {"dtype", "shape", "data_offsets"}), read from its header
    alone: no tensor is read. `ValueError` saying why for a file that has no readable header."""
    file = Path(file)
    with open(file, "rb") as f:
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            raise ValueError(f"{file} is damaged: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if HEADER_BYTES + length > file.stat().st_size:
            raise ValueError(f"{file} is damaged: its header declares more bytes than the file holds")
        if length > MAX_HEADER_BYTES:  # a damaged length inside a large file: never read gigabytes as JSON
            raise ValueError(
                f"{file} is damaged: its header declares {length} bytes, more than a safetensors header may hold "
                f"({MAX_HEADER_BYTES})"
            )
        try:
            header = json.loads(f.read(length))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{file} is damaged: its {length}-byte header is not a safetensors JSON header")
    return {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def is_float_code(dtype: str) -> bool:
    """Whether a safetensors dtype code is a floating-point one (F64, F32, F16, BF16, F8_E4M3, ...)."""
    return dtype == "BF16" or dtype.startswith("F")


def _model_name(name: str, expected: dict, prefix: str) -> str | None:
    """The model's name for stored tensor `name`: itself, or with the base model's prefix added or dropped (as
    transformers' `from_pretrained` loads a base model's weights into a causal LM and back); None: not the model's
    (a name the loader renames or a quantizer reads: left to it)."""
    for candidate in (
        name,
        f"{prefix}.{name}" if prefix else None,
        name.removeprefix(f"{prefix}.") if prefix else None,
    ):
        if candidate in expected:
            return candidate
    return None


def weights_misfit(model, files: list[Path], prefix: str = "") -> str | None:
    """The first tensor the safetensors `files` declare that `model` cannot take, or None: a floating-point tensor
    of the model's stored as integers or booleans (or the reverse; loading would cast the bits into garbage), or
    another shape. Another float dtype (bf16 for an fp32 model) fits: loading casts it. Only headers are read."""
    expected = {name: t for name, t in model.state_dict().items()}
    for file in files:
        for name, entry in sorted(safetensors_header(file).items()):
            key = _model_name(name, expected, prefix)
            if key is None:
                continue
            tensor, code, shape = expected[key], str(entry.get("dtype")), list(entry.get("shape") or [])
            floating = tensor.is_floating_point()
            if is_float_code(code) != floating or shape != list(tensor.shape):
                kind = "a floating-point tensor" if floating else f"a {str(tensor.dtype).removeprefix('torch.')} tensor"
                return (
                    f"{file} stores {name} as {code} {shape}, but the model expects {kind} {list(tensor.shape)} there"
                )
    return None


def check_weights_fit(model, files: list[Path], where: str | None = None, prefix: str = "") -> None:
    """Refuse, before any weights are loaded, safetensors `files` whose headers declare a tensor `model` cannot take
    (`weights_misfit`), in one line naming `where` (the flag or config key that pointed at the files: `model.path`,
    `--checkpoint`, ...; None: a checkpoint the pipeline itself wrote), the file, the tensor, what it declares and
    what the model has. A file whose digests were recomputed after its header was rewritten (another tool's
    export, a download) passes `verify_checkpoint` but not this (docs/operations.md, "Bad input: refused as early
    as it can be seen"). `prefix`: the base model's prefix (`_model_name`)."""
    label = where or "checkpoint"
    try:  # a missing file is the loader's to report, as before
        problem = weights_misfit(model, [Path(f) for f in files if Path(f).is_file()], prefix)
    except ValueError as exc:
        raise WeightsMismatchError(f"{label}: {exc}; replace it with the file as it was saved") from None
    if problem is not None:
        fix = f"point {where} at ones that were" if where else "put back the files that were"
        raise WeightsMismatchError(f"{label}: {problem}: these weights were not saved from this model; {fix}")


def stored_weight_files(source: str | Path) -> list[Path]:
    """The safetensors files `from_pretrained` reads from `source`: a local folder's index shards
    (model.safetensors.index.json) or its model.safetensors; a hub id's, fetched into the Hugging Face cache as
    `from_pretrained` would fetch them. [] where there are none (pytorch_model.bin, GGUF) or the hub cannot give
    them: `from_pretrained` then says why."""
    local = Path(source)
    if local.is_dir():
        if (local / WEIGHTS_INDEX).is_file():
            return [local / name for name in weight_files(local)]
        return [local / WEIGHTS] if (local / WEIGHTS).is_file() else []
    from huggingface_hub import hf_hub_download  # lazy: only a hub id reaches here

    def fetch(name: str) -> Path | None:
        try:
            return Path(hf_hub_download(str(source), name))
        except Exception:  # noqa: BLE001 - offline, unknown repo, no such file: from_pretrained says which
            return None

    index = fetch(WEIGHTS_INDEX)
    if index is None:
        single = fetch(WEIGHTS)
        return [single] if single is not None else []
    shards = [fetch(name) for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [] if None in shards else shards


def load_trainer_state(path: Path) -> dict[str, Any] | None:
    import torch  # lazy: dllm_common stays torch-free at import (flows imports this module)

    f = Path(path) / "trainer_state.pt"
    if not f.is_file():
        return None
    return torch.load(f, weights_only=True, map_location="cpu")


# what says which run wrote a checkpoint and how it was laid out, not what it holds (docs/architecture.md)
RUN_FIELDS = ("mlflow_run_id", "layout")


def checkpoint_digest(path: Path) -> str:
    """One sha256 for a checkpoint's content: every file's digest but dllm.json's, and dllm.json without the
    fields that only say which run wrote it (`RUN_FIELDS`). Lineage is about content: a bit-identical rebuild
    (a damaged entry set aside and trained again, which opens a new MLflow run) keeps the digest that its
    evaluations and exports refer to."""
    path = Path(path)
    files = {k: v for k, v in json.loads((path / DIGESTS).read_text()).items() if k != "dllm.json"}
    meta = {k: v for k, v in read_meta(path).items() if k not in RUN_FIELDS}
    content = json.dumps({"files": files, "meta": meta}, sort_keys=True, default=str)
    return hashlib.sha256(content.encode()).hexdigest()
