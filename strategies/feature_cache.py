"""Write a DFlash target-feature cache: the frozen target run once over every row of a split, the
selected layers' hidden states (`[L, n·H]` per row, bf16/fp16/fp32) and, on request, its top-k next-token
distribution per position, stored as safetensors shards
plus an `index.json` (layer ids, dtype, rows per shard, bytes, seconds). `CachedFeatures` reads it.

Pure of Prefect/MLflow: the `cache_target` stage adds the content key and the cross-process lock.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm import tqdm

from strategies.dflash import top_k_labels
from strategies.dflash_draft import target_features

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
