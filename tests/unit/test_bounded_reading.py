"""Bounded reading (issue 52): a document or row longer than `data.max_document_chars` is refused in one line
naming its file and line (or row) before any tokenizer sees it, a jsonl line too long for any row within the bound
is refused before it is read whole; a FIFO, device or socket as `data.path` is refused when the config is loaded
(a stat, nothing opened); a config file too large to be one is refused from its size, before it is parsed
(docs/operations.md, "Bad input: refused as early as it can be seen")."""

import json
import os
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from dllm_common.config import ConfigError, validate_schema
from dllm_common.config import yaml_loading as loading
from dllm_common.config.sections import MAX_DOCUMENT_CHARS, special_file
from tasks.data.documents import JSON_BYTES_PER_CHAR, JSON_LINE_SLACK, DataError, iter_documents


def _data(path, **data):
    return validate_schema({"data": {"source": "jsonl", "path": str(path), **data}}).data


def _refused(cfg, message: str) -> None:
    with pytest.raises(DataError) as err:
        list(iter_documents(cfg))
    assert str(err.value) == message


def _within(seconds: float, call):
    """`call()`'s exception (or None), or a failure if it has not returned in `seconds` (a FIFO opened for reading
    waits for a writer: the test would hang instead of failing)."""
    result: list = []

    def run():
        try:
            call()
            result.append(None)
        except Exception as exc:  # handed to the test
            result.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    started = time.perf_counter()
    worker.start()
    worker.join(seconds)
    assert result, f"still running after {seconds} s: it waits on what it opened"
    return result[0], time.perf_counter() - started


# ---------------------------------------------------------------- 1. documents and rows: data.max_document_chars


def test_a_row_over_the_bound_is_refused_naming_file_and_line_and_one_at_it_is_read(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["a" * 50, "b" * 51, "c"]))
    _refused(
        _data(path, max_document_chars=50),
        f"{path}:2: 'text' is 51 characters, more than data.max_document_chars (50); split it into several "
        "documents (rows), or raise data.max_document_chars",
    )
    assert [len(d.text) for d in iter_documents(_data(path, max_document_chars=51))] == [50, 51, 1]


def test_the_default_bound_refuses_no_real_document():
    assert validate_schema({}).data.max_document_chars == MAX_DOCUMENT_CHARS
    assert MAX_DOCUMENT_CHARS >= 5_000_000  # the longest books are a few million characters


def test_a_conversation_over_the_bound_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "c.jsonl"
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]  # 4+2 + 9+5 = 20
    long = [{"role": "user", "content": "q" * 10}, {"role": "assistant", "content": "a" * 11}]  # 14 + 20 = 34
    path.write_text("\n".join(json.dumps({"messages": m}) for m in [short, short, long]))
    cfg = _data(path, shape="dialogue", max_document_chars=33)
    _refused(
        cfg,
        f"{path}:3: the conversation in 'messages' is 34 characters, more than data.max_document_chars (33); split "
        "it into several conversations (rows), or raise data.max_document_chars",
    )
    assert len(list(iter_documents(cfg.model_copy(update={"max_document_chars": 34})))) == 3


def test_rows_of_one_document_are_bounded_together(tmp_path):
    """Consecutive rows with the same data.document_field are one text, tokenized at once: their sum (with the
    blank line that joins them) is bounded, and the row that crosses the bound is named."""
    path = tmp_path / "b.jsonl"
    rows = [("x", "a" * 10), ("y", "b" * 10), ("y", "c" * 10), ("y", "d" * 10)]
    path.write_text("\n".join(json.dumps({"book": b, "text": t}) for b, t in rows))
    _refused(
        _data(path, document_field="book", max_document_chars=33),
        f"{path}:4: with this row, the document of the consecutive rows whose 'book' is 'y' (data.document_field) "
        "reaches 34 characters, more than data.max_document_chars (33); give its parts different 'book' values, "
        "or raise data.max_document_chars",
    )
    docs = list(iter_documents(_data(path, document_field="book", max_document_chars=34)))
    assert [len(d.text) for d in docs] == [10, 34]


def test_a_line_too_long_for_any_row_is_refused_before_it_is_read_whole_or_decoded(tmp_path):
    """8 MB on one line, not even UTF-8: refused for its length (never decoded, so not 'is not UTF-8') while
    holding far less than the line in memory."""
    limit = JSON_BYTES_PER_CHAR * 10 + JSON_LINE_SLACK
    path = tmp_path / "long.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"text": "ok"}\n')
        f.write(b"\xff" * 8_000_000)
    cfg = _data(path, max_document_chars=10)
    tracemalloc.start()
    try:
        _refused(
            cfg,
            f"{path}:2 is longer than {limit} bytes, more than a row within data.max_document_chars (10 characters, "
            f"at most {JSON_BYTES_PER_CHAR} bytes each in JSON) takes; split it into several lines (documents), or "
            "raise data.max_document_chars",
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak


def test_the_line_bound_refuses_no_row_within_the_character_bound(tmp_path):
    """The worst JSON for a row of max_document_chars characters (astral ones, escaped as 12 bytes each, plus an
    id) is read; one byte more than the line bound is refused."""
    path = tmp_path / "astral.jsonl"
    widest = json.dumps({"id": "x" * 1000, "text": "😀" * 10})  # ensure_ascii: \ud83d\ude00 per character
    limit = JSON_BYTES_PER_CHAR * 10 + JSON_LINE_SLACK
    path.write_text(widest + "\n" + json.dumps({"text": " " * (limit - 11)}) + "\n")
    cfg = _data(path, max_document_chars=10)
    with pytest.raises(DataError, match=rf"astral.jsonl:2 is longer than {limit} bytes"):
        list(iter_documents(cfg))
    path.write_text(widest + "\n" + json.dumps({"text": "ok"}) + "\n")
    assert [d.text for d in iter_documents(cfg)] == ["😀" * 10, "ok"]


def test_parquet_and_dataset_rows_are_refused_by_index(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["a" * 5, "b" * 50, "c" * 5]
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
    cfg = validate_schema(
        {"data": {"source": "parquet", "path": str(tmp_path / "d.parquet"), "max_document_chars": 49}}
    )
    _refused(
        cfg.data,
        f"{tmp_path / 'd.parquet'} row 1: 'text' is 50 characters, more than data.max_document_chars (49); split it "
        "into several documents (rows), or raise data.max_document_chars",
    )
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    cfg = validate_schema({"data": {"source": "hf", "path": str(tmp_path / "ds"), "max_document_chars": 49}})
    with pytest.raises(DataError, match=rf"^{tmp_path / 'ds'} row 1: 'text' is 50 characters, more than"):
        list(iter_documents(cfg.data))


@pytest.mark.parametrize("shape", ["pretrain", "dialogue"])
def test_prepare_data_refuses_it_before_any_tokenizer_and_publishes_nothing(tmp_path, monkeypatch, shape):
    from tasks import prepare_data as prep
    from tasks.data import tokenizing

    calls = []
    for module, name in [(prep, "train_tokenizer"), (prep, "load_tokenizer"), (tokenizing, "tokenize_documents")]:
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: calls.append(_n))
    if shape == "pretrain":
        rows = [{"text": f"row {i} " * 4} for i in range(4)] + [{"text": "z" * 500}]
    else:
        rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "z" * 500}]}] * 5
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    spec = validate_schema(
        {
            "data": {"source": "jsonl", "path": str(path), "shape": shape, "seq_len": 16, "max_document_chars": 100},
            "tokenizer": {"vocab_size": 300},
            "eval": {"sample_length": 8},
        }
    )
    line = 5 if shape == "pretrain" else 1
    with pytest.raises(DataError, match=rf"^{path}:{line}: .* characters, more than data.max_document_chars \(100\)"):
        prep.prepare_data(spec, str(tmp_path / "w"))
    assert calls == []
    assert not list((tmp_path / "w").rglob("manifest.json"))


# ---------------------------------------------------------------- 2. data.path: no FIFO, device or socket


def _make_fifo(tmp_path, name) -> Path:
    fifo = tmp_path / f"{name}.fifo"
    os.mkfifo(fifo)
    return fifo


@pytest.mark.parametrize("source", ["jsonl", "parquet", "hf"])
def test_a_fifo_or_dev_zero_as_data_path_is_refused_when_the_config_is_loaded(tmp_path, source):
    expected = {
        "jsonl": "a .jsonl file",
        "parquet": "a .parquet file or a directory of them",
        "hf": "a directory written by Dataset.save_to_disk (or a dataset name)",
    }[source]
    for path, kind in [(str(_make_fifo(tmp_path, source)), "a FIFO (named pipe)"), ("/dev/zero", "a character device")]:
        error, seconds = _within(5, lambda p=path: validate_schema({"data": {"source": source, "path": p}}))
        assert isinstance(error, ConfigError) and seconds < 2
        assert str(error).splitlines()[1] == (
            f"  data.path {path!r} is {kind}, not a file: prepare_data reads its data three times, which a pipe, "
            f"device or socket cannot give back; save the data as {expected} and point data.path there"
        )


def test_a_socket_is_refused_and_files_directories_and_missing_paths_are_left_to_the_source(tmp_path):
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s"))
        assert special_file(tmp_path / "s") == "a socket"
    finally:
        sock.close()
    (tmp_path / "f.jsonl").write_text("{}")
    assert [special_file(p) for p in (tmp_path / "f.jsonl", tmp_path, tmp_path / "none", "a\0b")] == [None] * 4
    validate_schema({"data": {"source": "parquet", "path": str(tmp_path)}})  # a directory of parquet files
    validate_schema({"data": {"source": "hf", "path": "some/dataset"}})  # a hub name: nothing here to stat


def test_a_fifo_that_appears_after_the_config_was_loaded_is_refused_where_it_is_read(tmp_path):
    """The config validated against a file that was then replaced by a FIFO (or a FIFO inside a parquet
    directory): the read refuses it instead of waiting for a writer."""
    path = tmp_path / "d.jsonl"
    path.write_text("{}")
    cfg = _data(path)
    path.unlink()
    os.mkfifo(path)
    error, _ = _within(5, lambda: list(iter_documents(cfg)))
    assert isinstance(error, DataError) and str(error) == (
        f"data.path {str(path)!r} is a FIFO (named pipe), not a file: prepare_data reads its data three times, "
        "which a pipe, device or socket cannot give back; save the data as a .jsonl file and point data.path there"
    )
    folder = tmp_path / "parts"
    folder.mkdir()
    os.mkfifo(folder / "a.parquet")
    cfg = validate_schema({"data": {"source": "parquet", "path": str(folder)}}).data
    error, _ = _within(5, lambda: list(iter_documents(cfg)))
    assert isinstance(error, DataError) and str(error).startswith(f"{folder / 'a.parquet'} is a FIFO (named pipe)")


# ---------------------------------------------------------------- 3. a config file too large to be one


def test_an_oversized_config_file_is_refused_from_its_size_without_parsing(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "CONFIG_MAX_BYTES", 100)
    parsed = []
    real = loading.load_yaml
    monkeypatch.setattr(loading, "load_yaml", lambda text: parsed.append(text) or real(text))
    config = tmp_path / "big.yaml"
    config.write_text("pipeline: {name: p}\neval:\n  prompts: [" + "y" * 200 + "]\n")
    size = config.stat().st_size
    with pytest.raises(ConfigError) as err:
        loading.read_yaml(config)
    assert str(err.value) == (
        f"config file {config} is {size} bytes, more than the 100 a config may hold (the shipped ones are a few "
        "KB); shorten its long values, e.g. eval.prompts entries (only the first eval.num_samples are sampled)"
    )
    assert parsed == []
    config.write_text("pipeline: {name: p}\r\neval: {prompts: [" + "y" * (100 - 42) + "]}\r\n")
    assert config.stat().st_size == 100  # at the bound, read (and CRLF line ends read as a file reads them)
    assert loading.read_yaml(config)["eval"]["prompts"] == ["y" * 58] and parsed


def test_the_config_bound_holds_every_shipped_config_and_a_few_long_prompts():
    from conftest import ROOT

    assert max(p.stat().st_size for p in (ROOT / "configs").rglob("*.yaml")) * 100 < loading.CONFIG_MAX_BYTES
    assert loading.CONFIG_MAX_BYTES >= 64 * 4096  # 64 prompts at a tiny model's default bound (128 positions × 32)


def test_a_fifo_or_a_device_as_the_config_file_is_refused_without_opening_it(tmp_path):
    fifo = _make_fifo(tmp_path, "config")
    for path, kind in [(fifo, "a FIFO (named pipe)"), (Path("/dev/zero"), "a character device")]:
        error, seconds = _within(5, lambda p=path: loading.read_yaml(p))
        assert isinstance(error, ConfigError) and seconds < 2
        assert str(error) == (
            f"config file {path} is {kind}, not a file (a config is read more than once in a run); write the config "
            "to a file and pass its path"
        )


def test_validate_refuses_a_fifo_data_path_in_one_line(tmp_path, capsys):
    from flows.cli import main

    config = tmp_path / "c.yaml"
    fifo = _make_fifo(tmp_path, "data")
    config.write_text(f"pipeline: {{name: p}}\ndata: {{source: jsonl, path: {fifo}}}\n")
    capsys.readouterr()
    started = time.perf_counter()
    assert main(["validate", str(config)]) == 2
    assert time.perf_counter() - started < 10
    err = capsys.readouterr().err
    assert f"data.path '{fifo}' is a FIFO (named pipe), not a file" in err, err
