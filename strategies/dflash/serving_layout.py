"""The files a serving engine reads of a DFlash draft (docs/strategies.md §10.10): config.json in the z-lab or the
speculators layout and model.safetensors under the engines' names. `dllm-flow export` writes them with the
tokenizer and the dllm-flow record beside them (`tasks.speculative.export`); the evaluation writes them alone,
to load the draft in z-lab's own classes (`tasks.speculative.served`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from dllm_common.checkpoint import WEIGHTS
from strategies.dflash.config import CONFIG, ZLAB, DFlashDraftConfig, draft_keys, write_json


def tensor_dtype(tensors: dict[str, torch.Tensor]) -> str:
    """The one dtype of a draft's weights, as config.json names it."""
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()})
    if len(dtypes) != 1:
        raise ValueError(f"a DFlash draft's weights share one dtype; these have {dtypes}")
    return dtypes[0]


def serving_config(cfg: DFlashDraftConfig, fmt: str, dtype: str, target: dict) -> dict:
    """config.json of layout `fmt` (`target`: the checkpoint record's target, the speculators verifier)."""
    if fmt == ZLAB:
        return cfg.to_zlab(dtype)
    return cfg.to_speculators(verifier_name(target.get("path")), verifier_architectures(target.get("path")), dtype)


def write_serving_layout(dest: Path, cfg: DFlashDraftConfig, tensors: dict, fmt: str, target: dict) -> list[str]:
    """config.json and model.safetensors of layout `fmt` into `dest` (what the engines read); returns their names.
    The weights must be exactly the draft's (`draft_keys`)."""
    if sorted(tensors) != draft_keys(cfg):
        raise ValueError(
            f"the draft's weights are not the engines' layout: {sorted(set(tensors) ^ set(draft_keys(cfg)))}"
        )
    write_json(dest / CONFIG, serving_config(cfg, fmt, tensor_dtype(tensors), target))
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, str(dest / WEIGHTS), metadata={"format": "pt"})
    return [CONFIG, WEIGHTS]


_HUB_CACHE = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")


def verifier_name(path: str | None) -> str:
    """The target as a speculators verifier: its hub id where it was loaded from the Hugging Face cache (a
    portable name), else its local path."""
    if not path:
        raise ValueError("the draft's checkpoint records no target path (dllm.json target.path)")
    found = _HUB_CACHE.search(Path(path).as_posix())
    return f"{found['org']}/{found['name']}" if found else str(path)


def verifier_architectures(path: str | None) -> list[str]:
    """The target's `architectures` (from its config.json; [] when it is not where the record says)."""
    try:
        return list(json.loads((Path(path) / CONFIG).read_text()).get("architectures") or [])
    except (OSError, TypeError, ValueError):
        return []
