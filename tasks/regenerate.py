"""Stage `regenerate` (DFlash, optional): training rows rewritten by the frozen target.

A draft proposes what the *target* would say, so it learns best from the target's own text (DFlash
paper §5.1; docs/strategies.md §10.7). With `dflash.regenerate` set, every training row keeps its first
`prompt_len` tokens and the target samples the rest at `temperature` (seeded: the same key
regenerates the same rows); only the sampled continuation is supervised. The validation split and
the tokenizer are carried over unchanged, so evaluation still measures real text. The entry has
the layout of a `prepare_data` entry, and `cache_target` and `train[dflash]` read it in its place.

key = (regenerate settings, target weights digest, data key, code).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dllm_common.config import PipelineSpec, RegenerateConfig
from dllm_common.store import stage_key
from strategies.dflash.draft import sample_continuations
from strategies.dflash.served_checks import tokenizer_record
from tasks.common import StageRef, prefect_task, stage_code_version, store_for
from tasks.data.tokenizer import load_tokenizer
from tasks.prepare_data import data_ref
from tasks.rows import load_split, write_split
from tasks.training.dflash_setup import load_spec_target
from tasks.training.runtime import stage_device

STAGE = "regenerate"


def stage_of(spec: PipelineSpec, target: StageRef, data: StageRef, workdir: str, **_) -> tuple[str, str]:
    config = spec.dflash.regenerate.model_dump(mode="json") if spec.dflash.regenerate else None
    upstream = {"target_weights": target.info["weights_digest"], "data": data.key}
    return STAGE, stage_key(STAGE, config, upstream, stage_code_version(__name__))


def regenerate(spec: PipelineSpec, target: StageRef, data: StageRef, workdir: str) -> StageRef:
    """Publish (or reuse) the regenerated training split."""
    cfg = spec.dflash.regenerate
    if cfg is None:
        raise ValueError("the regenerate stage needs dflash.regenerate (prompt_len, temperature, ...) in the config")
    stage, key = stage_of(spec, target, data, workdir)
    entry, reused = store_for(workdir).reuse_or_build(stage, key, lambda tmp: _build(spec, target, data, tmp))
    if not reused:
        info = entry.manifest["info"]
        print(
            f"[dllm-flow] regenerate: {info['train_rows']} rows continued by the target from {cfg.prompt_len}-token "
            f"prompts at T={cfg.temperature} in {info['regenerate_seconds']:.1f}s",
            flush=True,
        )
    return data_ref(entry, reused)


def _build(spec: PipelineSpec, target: StageRef, data: StageRef, tmp: Path) -> dict:
    """The regenerated train split plus the data entry's tokenizer and val split into `tmp`; the manifest fields."""
    cfg = spec.dflash.regenerate
    ids, loss, attn = load_split(data.path, "train")
    rows = _prompt_rows(cfg, ids, attn)
    new_ids, seconds = _sample(spec, target, ids, rows)
    new_loss = torch.ones(new_ids.shape, dtype=loss.dtype)
    new_loss[:, : cfg.prompt_len] = 0
    info = {
        **{k: v for k, v in data.info.items() if k != "digest"},
        "train_rows": len(new_ids),
        "train_supervised_tokens": int(new_loss.sum()),
        "regenerated_from": data.key,
        "target": target.key,
        "regenerate_seconds": seconds,
        # what the prompts were rendered with: checked against the target's own before training and at evaluation
        # (docs/strategies.md §10.13)
        "tokenizer": tokenizer_record(load_tokenizer(str(Path(data.path) / "tokenizer"))),
    }
    shutil.copytree(Path(data.path) / "tokenizer", tmp / "tokenizer")
    for name in Path(data.path).glob("val.*"):  # the held-out rows stay the data entry's
        if not name.name.startswith("val.doc_starts."):  # regenerated training rows have no documents: nor does val
            shutil.copy2(name, tmp / name.name)
    write_split(tmp, "train", new_ids, new_loss.to(torch.uint8), torch.ones_like(new_ids, dtype=torch.uint8))
    return {"upstream": {"data": data.key, "target": target.key}, "info": info}


def _prompt_rows(cfg: RegenerateConfig, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Indices of the (at most `max_rows`) training rows whose first `prompt_len` tokens are real text."""
    seq_len = ids.shape[1]
    if cfg.prompt_len >= seq_len:
        raise ValueError(
            f"dflash.regenerate.prompt_len ({cfg.prompt_len}) must be shorter than data.seq_len ({seq_len})"
        )
    full = attn.sum(dim=1) >= cfg.prompt_len  # rows whose prompt is real text, not padding
    rows = torch.nonzero(full).flatten()[: cfg.max_rows]
    if len(rows) == 0:
        raise ValueError(
            f"no training row has {cfg.prompt_len} tokens to prompt the target with; lower dflash.regenerate.prompt_len"
        )
    return rows


def _sample(spec: PipelineSpec, target: StageRef, ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The target's seeded continuations of the rows' prompts, batch by batch; (new rows, sampling seconds)."""
    cfg = spec.dflash.regenerate
    seq_len = ids.shape[1]
    device = stage_device(spec)
    model = load_spec_target(spec, target.info["model_path"], device)
    gen = torch.Generator().manual_seed(cfg.seed)
    t0, parts = time.perf_counter(), []
    for start in tqdm(range(0, len(rows), cfg.batch_size), desc="regenerate", unit="batch", dynamic_ncols=True):
        prompts = ids[rows[start : start + cfg.batch_size], : cfg.prompt_len].to(device)
        parts.append(sample_continuations(model, prompts, seq_len - cfg.prompt_len, cfg.temperature, gen).cpu())
    new_ids = torch.cat(parts)
    return new_ids, round(time.perf_counter() - t0, 2)


regenerate_task = prefect_task(regenerate, name="regenerate", stage_of=stage_of)
