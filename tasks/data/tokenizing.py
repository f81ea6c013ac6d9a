"""Documents → token ids: pretrain documents as one stream each, dialogues as (ids, loss mask) per
conversation; tokenized in work units of `DOCS_PER_UNIT` documents, by a pool of `data.num_proc` processes
for large inputs, in document order."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm
from transformers import AutoTokenizer

from dllm_common.config import DataConfig
from tasks.data.documents import DataError, Document, iter_documents

DOCS_PER_UNIT = 64  # documents per tokenizing work unit
PARALLEL_FROM = 4 * DOCS_PER_UNIT  # fewer documents than this are tokenized in this process


# Reasoning tags a hybrid-reasoning template writes empty into an assistant turn (Qwen3's `<think>\n\n</think>`):
# the span is the template's, not the answer's, so it is not supervised (docs/post-training.md, "Chat SFT")
EMPTY_REASONING = re.compile(r"<(think|thinking|reasoning)>\s*</\1>\s*")


def assistant_spans(messages: list[dict], tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (each with its end), less any
    empty reasoning span inside them."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=True))
            end = len(tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False))
            cuts = [(a.start(), a.end()) for a in EMPTY_REASONING.finditer(text, start, end)]
            for a, b in cuts:
                spans.append((start, a))
                start = b
            spans.append((start, end))
    return text, [(s, e) for s, e in spans if e > s]


def dialogue_row(messages: list[dict], tokenizer, seq_len: int) -> tuple[list[int], list[int]]:
    """Render with the chat template; supervise the characters of each assistant turn (+ its end)."""
    text, spans = assistant_spans(messages, tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:seq_len]
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"][:seq_len]]
    return ids, mask


PROBE = ({"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."})


def check_chat_template(tokenizer, name: str) -> None:
    """Refuse (one `DataError` line naming the template) a chat template whose rendering of a two-turn probe
    supervises nothing or everything, or whose prompt with the generation prompt is no prefix of the whole
    conversation (the assistant turn could not be located): either would silently train on the wrong tokens."""
    try:
        full = tokenizer.apply_chat_template(list(PROBE), tokenize=False)
        prompt = tokenizer.apply_chat_template(list(PROBE[:1]), tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # a template that cannot render a user/assistant pair
        raise DataError(f"the chat template of {name} cannot render a user and an assistant turn: {exc}") from None
    if not full.startswith(prompt):
        raise DataError(
            f"the chat template of {name} renders the prompt with its generation prompt as no prefix of the "
            "conversation, so the assistant turns cannot be located; use a template that appends each turn"
        )
    _, mask = dialogue_row(list(PROBE), tokenizer, 1 << 16)
    if not any(mask) or all(mask):
        what = "no token" if not any(mask) else "every token"
        raise DataError(
            f"the chat template of {name} marks {what} of a user/assistant probe as the assistant's, so SFT would "
            "supervise the wrong tokens; use a template that renders the assistant turns apart from the prompt"
        )


def tokenize_documents(docs: list[Document], tokenizer, seq_len: int, shape: str) -> list:
    """One work unit: pretrain documents → one int32 token array each (eos appended); dialogue documents →
    (ids, mask) per conversation. Runs in the tokenizing processes."""
    if shape == "pretrain":
        eos = tokenizer.eos_token_id
        encoded = tokenizer([d.text or "" for d in docs], add_special_tokens=False)["input_ids"]
        return [np.array([*ids, eos], dtype=np.int32) for ids in encoded]
    return [dialogue_row(list(dlg), tokenizer, seq_len) for d in docs for dlg in d.dialogues]


def tokenized_documents(
    cfg: DataConfig, tokenizer, tokenizer_dir: Path, n_docs: int, trust_remote_code: bool = False
) -> Iterator[tuple[int, Document, list]]:
    """(index, document, its tokenized units) in document order, with a progress bar. Large inputs are
    tokenized by `data.num_proc` processes (default: every core, at most 8), a bounded window at a time."""
    bar = tqdm(
        total=n_docs,
        desc="prepare_data",
        unit="doc",
        dynamic_ncols=True,
        mininterval=1.0,
        disable=n_docs < PARALLEL_FROM,
    )
    procs = cfg.num_proc or min(8, os.cpu_count() or 1)
    units = _units(iter_documents(cfg))
    if procs == 1 or n_docs < PARALLEL_FROM:
        results = ((unit, tokenize_documents(unit, tokenizer, cfg.seq_len, cfg.shape)) for unit in units)
    else:
        results = _parallel(units, procs, tokenizer_dir, cfg, trust_remote_code)
    i = 0
    for unit, tokenized in results:
        per_doc = _per_document(unit, tokenized, cfg.shape)
        for doc, doc_units in zip(unit, per_doc):
            yield i, doc, doc_units
            i += 1
        bar.update(len(unit))
    bar.close()


def _units(docs: Iterator[Document]) -> Iterator[list[Document]]:
    while unit := list(itertools.islice(docs, DOCS_PER_UNIT)):
        yield unit


def _per_document(unit: list[Document], tokenized: list, shape: str) -> list[list]:
    """Split a unit's output back per document (one stream each; dialogue: one row per conversation)."""
    if shape == "pretrain":
        return [[t] for t in tokenized]
    out, k = [], 0
    for d in unit:
        out.append(tokenized[k : k + len(d.dialogues)])
        k += len(d.dialogues)
    return out


_worker_tokenizer = None


def _init_worker(tokenizer_dir: str, trust_remote_code: bool) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        _worker_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:  # raised by the first unit instead (a failing initializer makes the pool respawn forever)
        _worker_tokenizer = exc


def _work(args) -> list:
    unit, seq_len, shape = args
    if isinstance(_worker_tokenizer, Exception):
        raise DataError(f"a tokenizing process could not load the tokenizer: {_worker_tokenizer}")
    return tokenize_documents(unit, _worker_tokenizer, seq_len, shape)


def _parallel(units: Iterator[list[Document]], procs: int, tokenizer_dir: Path, cfg: DataConfig, trust: bool):
    """Units tokenized by a pool of fresh processes, in order, at most `4 × procs` units in flight."""
    context = multiprocessing.get_context("spawn")  # no fork of a process that runs threads (Prefect, MLflow)
    with context.Pool(procs, initializer=_init_worker, initargs=(str(tokenizer_dir), trust)) as pool:
        while window := list(itertools.islice(units, 4 * procs)):
            yield from zip(window, pool.imap(_work, [(u, cfg.seq_len, cfg.shape) for u in window]))
