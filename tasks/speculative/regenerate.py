"""Stage `regenerate` (DFlash, optional): training rows rewritten by the frozen target.

A draft proposes what the *target* would say, so it learns best from the target's own text (DFlash
paper §5.1; docs/strategies.md §10.7). With `dflash.regenerate` set, every training row keeps its first
`prompt_len` tokens and the target samples the rest at `temperature` (seeded: the same key
regenerates the same rows); only the sampled continuation is supervised. With `chat: true` the prompt goes to the
target as a chat user turn, as a served draft's prompts do, and the row is the rendered turn plus the reply. The
validation split and the tokenizer are carried over unchanged, so evaluation still measures real text. The entry has
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
from strategies.dflash.decoding import sample_continuations
from strategies.dflash.served_checks import chat_prompt, tokenizer_record
from tasks.common import StageRef, prefect_task, stage_code_version, store_for
from tasks.data.tokenizer import load_tokenizer
from tasks.devices import stage_device
from tasks.prepare_data import data_ref
from tasks.rows import load_split, write_split
from tasks.speculative.setup import load_spec_target
from tasks.stages import Stage

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
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    if cfg.chat:
        new_ids, new_loss, new_attn, seconds = _sample_chat(spec, target, tokenizer, ids, rows)
    else:
        new_ids, seconds = _sample(spec, target, ids[:, : cfg.prompt_len], rows, ids.shape[1])
        new_loss = torch.ones(new_ids.shape, dtype=torch.uint8)
        new_loss[:, : cfg.prompt_len] = 0
        new_attn = torch.ones_like(new_ids, dtype=torch.uint8)
    info = {
        **{k: v for k, v in data.info.items() if k != "digest"},
        "train_rows": len(new_ids),
        "train_supervised_tokens": int(new_loss.sum()),
        "regenerated_from": data.key,
        "target": target.key,
        "regenerate_seconds": seconds,
        # what the prompts were rendered with: checked against the target's own before training and at evaluation
        # (docs/strategies.md §10.13)
        "tokenizer": tokenizer_record(tokenizer),
        "chat": spec.chat_rows,
    }
    shutil.copytree(Path(data.path) / "tokenizer", tmp / "tokenizer")
    for name in Path(data.path).glob("val.*"):  # the held-out rows stay the data entry's
        if not name.name.startswith("val.doc_starts."):  # regenerated training rows have no documents: nor does val
            shutil.copy2(name, tmp / name.name)
    write_split(tmp, "train", new_ids, new_loss, new_attn)
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


def _sample(
    spec: PipelineSpec,
    target: StageRef,
    prompts: torch.Tensor,
    rows: torch.Tensor,
    seq_len: int,
    model=None,
    gen: torch.Generator | None = None,
) -> tuple[torch.Tensor, float]:
    """The target's seeded continuations of `prompts[rows]` (equal lengths) to `seq_len` tokens, batch by batch;
    (new rows, sampling seconds). `model` and `gen`: the target and the generator of a caller that samples several
    groups of prompts (one stream of `regenerate.seed` across them)."""
    cfg = spec.dflash.regenerate
    device = stage_device(spec)
    model = model or load_spec_target(spec, target.info["model_path"], device)
    gen = gen or torch.Generator().manual_seed(cfg.seed)
    t0, parts = time.perf_counter(), []
    new = seq_len - prompts.shape[1]
    for start in tqdm(range(0, len(rows), cfg.batch_size), desc="regenerate", unit="batch", dynamic_ncols=True):
        batch = prompts[rows[start : start + cfg.batch_size]].to(device)
        parts.append(sample_continuations(model, batch, new, cfg.temperature, gen).cpu())
    new_ids = torch.cat(parts)
    return new_ids, round(time.perf_counter() - t0, 2)


def _sample_chat(spec: PipelineSpec, target: StageRef, tokenizer, ids: torch.Tensor, rows: torch.Tensor):
    """Chat regeneration: each row's first `prompt_len` tokens, as text, become one user turn through the chat
    template (as the served evaluation renders its prompts, `chat_prompt`); the target replies, prompts of one
    rendered length in one batch. Supervised: the reply up to and including the end of turn (EOS); after it the row
    is padding. (ids, loss mask, attention mask, sampling seconds)."""
    cfg, seq_len = spec.dflash.regenerate, ids.shape[1]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "dflash.regenerate.chat: the data's tokenizer has no chat template to render prompts with; set "
            "tokenizer.kind: pretrained with tokenizer.path the target's folder, or dflash.regenerate.chat: false"
        )
    texts = [tokenizer.decode(ids[r, : cfg.prompt_len].tolist(), skip_special_tokens=True) for r in rows.tolist()]
    rendered = [chat_prompt(tokenizer, text, cfg.enable_thinking) for text in texts]
    longest = max(len(p) for p in rendered)
    if longest >= seq_len - 1:
        raise ValueError(
            f"dflash.regenerate.chat: a {cfg.prompt_len}-token prompt renders to {longest} tokens through the chat "
            f"template, leaving no room for a reply in data.seq_len ({seq_len}); raise data.seq_len or lower "
            "dflash.regenerate.prompt_len"
        )
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    new_ids = torch.full((len(rendered), seq_len), pad, dtype=ids.dtype)
    loss = torch.zeros(new_ids.shape, dtype=torch.uint8)
    attn = torch.zeros(new_ids.shape, dtype=torch.uint8)
    model, seconds = load_spec_target(spec, target.info["model_path"], stage_device(spec)), 0.0
    gen = torch.Generator().manual_seed(cfg.seed)  # one stream over the groups: no group repeats another's draws
    for length in sorted({len(p) for p in rendered}):
        idx = torch.tensor([i for i, p in enumerate(rendered) if len(p) == length])
        prompts = torch.tensor([rendered[i] for i in idx.tolist()], dtype=ids.dtype)
        out, took = _sample(spec, target, prompts, torch.arange(len(idx)), seq_len, model, gen)
        seconds += took
        for row, i in zip(out, idx.tolist()):
            ends = (row[length:] == eos).nonzero().flatten() if eos is not None else torch.tensor([])
            stop = length + int(ends[0]) + 1 if len(ends) else seq_len  # the reply through its end of turn
            new_ids[i, :stop], loss[i, length:stop], attn[i, :stop] = row[:stop], 1, 1
    return new_ids, loss, attn, round(seconds, 2)


regenerate_task = prefect_task(regenerate, name="regenerate", stage_of=stage_of)
# run when a strategy trains on the target's own text (`training_data(spec) == "regenerated"`)
DECLARATION = Stage(
    name=STAGE,
    task=regenerate_task,
    produces="regenerated",
    consumes={"target": "target", "data": "data"},
    on_demand=True,
)
