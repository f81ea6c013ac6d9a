"""Where a DFlash draft's context comes from: the frozen target's hidden states at the draft's layers (and, on
request, its top-k next-token distributions), computed every step (`OnlineFeatures`) or read from a cache
(`CachedFeatures`) that `write_feature_cache` fills.

The cache: the frozen target run once over every row of a split, the selected layers' hidden states
(`[L, n·H]` per row, bf16/fp16/fp32) and, on request, its top-k next-token distribution per position, stored
as safetensors shards plus an `index.json` (layer ids, dtype, rows per shard, bytes, seconds).

Pure of Prefect/MLflow: the `cache_target` stage adds the content key and the cross-process lock.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm import tqdm

from strategies.base import Microbatch
from strategies.dflash.draft import target_features
from strategies.dflash.loss import SoftLabels, top_k_labels

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@torch.no_grad()
def write_feature_cache(
    target: nn.Module,
    splits: dict[str, Tensor],
    layer_ids: list[int],
    dest: str | Path,
    *,
    dtype: str = "bf16",
    top_k: int = 0,
    batch_size: int = 16,
    shard_rows: int = 1024,
    progress: bool = False,
) -> dict:
    """Features of `splits` ({name: ids [R, L]}) into `dest`; returns the index it wrote. With `top_k` > 0 each
    shard also holds the target's `top_k` most probable next tokens at every position (`top_ids`, int32) and
    their probabilities (`top_probs`, fp32): the soft labels of `dflash.distill_top_k`."""
    if dtype not in DTYPES:
        raise ValueError(f"dflash.cache_dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    device = next(target.parameters()).device
    t0 = time.perf_counter()
    index: dict = {"layer_ids": list(layer_ids), "dtype": dtype, "top_k": int(top_k), "splits": {}, "bytes": 0}
    bar = tqdm(
        total=sum(len(ids) for ids in splits.values()),
        desc="cache_target",
        unit="row",
        dynamic_ncols=True,
        disable=not progress,
    )
    for name, ids in splits.items():
        shards = []
        for start in range(0, len(ids), shard_rows):
            rows = ids[start : start + shard_rows]
            parts: dict[str, list[Tensor]] = {"features": [], "top_ids": [], "top_probs": []}
            for b in range(0, len(rows), batch_size):
                feats, logits, _ = target_features(target, rows[b : b + batch_size].to(device), layer_ids)
                parts["features"].append(feats.to(DTYPES[dtype]).cpu())
                if top_k:
                    top = top_k_labels(logits, top_k)
                    parts["top_ids"].append(top.ids.cpu())
                    parts["top_probs"].append(top.probs.cpu())
                bar.update(len(feats))
            file = f"{name}-{len(shards):05d}.safetensors"
            save_file({k: torch.cat(v).contiguous() for k, v in parts.items() if v}, str(dest / file))
            index["bytes"] += (dest / file).stat().st_size
            shards.append({"file": file, "start": start, "rows": len(rows)})
        index["splits"][name] = shards
    bar.close()
    index["seconds"] = round(time.perf_counter() - t0, 3)
    (dest / "index.json").write_text(json.dumps(index, indent=2))
    return index


class TargetOutputs(NamedTuple):
    """What a feature source gives for a micro-batch: the features `[B, L, n·H]` and, when the strategy asks for
    labels (`dflash.distill_top_k` > 0), the target's top-k next-token distribution at every position
    (`SoftLabels` of `[B, L, k]`)."""

    features: Tensor
    top: SoftLabels | None = None


class OnlineFeatures:
    """Target forward over the micro-batch's rows every step."""

    def __init__(self, target: nn.Module, layer_ids: list[int], top_k: int = 0):
        self.target, self.layer_ids, self.top_k = target, list(layer_ids), int(top_k)

    @torch.no_grad()
    def __call__(self, mb: Microbatch, labels: bool = False) -> TargetOutputs:
        feats, logits, _ = target_features(self.target, mb.input_ids, self.layer_ids)
        return TargetOutputs(feats, top_k_labels(logits, self.top_k) if labels and self.top_k else None)


class CachedFeatures:
    """Per-row features `[L, n·H]` (and, when the cache holds them, the target's top-k next-token
    distributions `[L, k]`) from safetensors shards, opened lazily (memory-mapped)."""

    INDEX = "index.json"

    def __init__(self, root: str | Path):
        self.root = Path(root)
        index = self.root / self.INDEX
        if not index.is_file():
            raise FileNotFoundError(
                f"{self.root} holds no target-feature cache ({self.INDEX} missing); rerun cache_target"
            )
        self.index = json.loads(index.read_text())
        self.layer_ids = self.index["layer_ids"]
        self.top_k = int(self.index.get("top_k", 0))
        self._handles: dict[str, Any] = {}

    def _rows(self, split: str):
        if split not in self.index["splits"]:
            raise KeyError(f"the target-feature cache has no {split!r} split")
        return self.index["splits"][split]

    def __call__(self, mb: Microbatch, labels: bool = False) -> TargetOutputs:
        """The rows' features, and their top-k labels when `labels` is asked for (and the cache holds them)."""
        if mb.row_ids is None:
            raise ValueError("cached DFlash features need each micro-batch's row ids (Microbatch.row_ids)")
        shards = self._rows(mb.split)
        with_labels = labels and self.top_k > 0
        names = ("features", "top_ids", "top_probs") if with_labels else ("features",)
        out: dict[str, list[Tensor]] = {name: [] for name in names}
        for row in mb.row_ids.tolist():
            shard = next(s for s in shards if s["start"] <= row < s["start"] + s["rows"])
            handle = self._handles.get(shard["file"])
            if handle is None:
                handle = self._handles[shard["file"]] = safe_open(str(self.root / shard["file"]), framework="pt")
            for name in names:
                out[name].append(handle.get_slice(name)[row - shard["start"]])
        device = mb.input_ids.device
        stacked = {name: torch.stack(rows).to(device) for name, rows in out.items()}
        top = SoftLabels(stacked["top_ids"], stacked["top_probs"]) if with_labels else None
        return TargetOutputs(stacked["features"], top)
