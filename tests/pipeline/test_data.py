"""prepare_data: embedded corpus parsing, document split, both row shapes, user data, bad data."""

import json
from pathlib import Path

import pytest
import torch

from dllm_common.config import validate_schema
from tasks.data.documents import DataError, Document, parse_play, split_documents
from tasks.data.tokenizer import train_tokenizer
from tasks.data.tokenizing import dialogue_row
from tasks.prepare_data import prepare_data
from tasks.rows import load_split

PLAY = """# A Play

## ACT I

### SCENE I. A room.

_Enter two_

**ALPHA**  
Good morrow, friend.  
How fare you?

**BETA**  
Well, I thank you.

### SCENE II. Another room.

**ALPHA**  
Farewell.
"""


def test_parse_play_turns_and_scenes():
    scenes = parse_play(PLAY)
    assert scenes == [
        [("ALPHA", "Good morrow, friend. How fare you?"), ("BETA", "Well, I thank you.")],
        [("ALPHA", "Farewell.")],
    ]


def test_split_is_by_document_deterministic_and_disjoint():
    docs = [Document(f"d{i}", text="x") for i in range(20)]
    train, val = split_documents(docs, 0.2, seed=0)
    assert len(val) == 4 and not {d.doc_id for d in train} & {d.doc_id for d in val}
    assert [d.doc_id for d in split_documents(docs, 0.2, seed=0)[1]] == [d.doc_id for d in val]


def test_pretrain_rows_all_supervised_and_split_by_play(prepared):
    ref, _ = prepared
    ids, loss, attn = load_split(ref.path, "train")
    assert ids.shape[1] == 32 and loss.min() == 1 and attn.min() == 1
    assert ref.info["val_documents"] >= 1 and ref.info["train_documents"] >= 1


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(
        ["Good morrow, friend. How fare you? Well, I thank you."] * 20,
        validate_schema({}).tokenizer.model_copy(update={"vocab_size": 300}),
    )


def test_tokenizer_has_specials_and_chat_template(tokenizer):
    assert None not in (tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert len({tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id}) == 3
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|assistant|>")


def test_dialogue_row_supervises_only_the_response(tokenizer):
    msgs = [{"role": "user", "content": "ALPHA: How fare you?"}, {"role": "assistant", "content": "BETA: Well."}]
    ids, mask = dialogue_row(msgs, tokenizer, 64)
    supervised = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    unsupervised = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert supervised == "BETA: Well.<|eos|>"
    assert "How fare you?" in unsupervised and "Well" not in unsupervised


def _spec(tmp_path, **data):
    return validate_schema(
        {
            "data": {"seq_len": 16, "val_fraction": 0.5, **data},
            "tokenizer": {"vocab_size": 300},
            "eval": {"sample_length": 8},
        }
    )


def test_jsonl_text_and_chat_messages(tmp_path):
    text = tmp_path / "t.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"line {i} " * 20}) for i in range(6)))
    ref = prepare_data(_spec(tmp_path, source="jsonl", path=str(text)), str(tmp_path / "w1"))
    assert ref.info["train_rows"] > 0 and ref.info["val_rows"] > 0
    chat = tmp_path / "c.jsonl"
    chat.write_text(
        "\n".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}
            )
            for i in range(6)
        )
    )
    ref = prepare_data(_spec(tmp_path, source="jsonl", path=str(chat), shape="dialogue"), str(tmp_path / "w2"))
    ids, loss, attn = load_split(ref.path, "train")
    assert 0 < loss.sum() < attn.sum()  # the prompt is not supervised
    assert ref.info["train_documents"] + ref.info["val_documents"] == 6
    from tasks.training.runtime import Split

    assert Split.open(ref.path, "train").doc_starts is None  # a dialogue row is one conversation: no packing


def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 30 for i in range(4)]}), path)
    ref = prepare_data(_spec(tmp_path, source="parquet", path=str(path)), str(tmp_path / "w"))
    assert ref.info["train_rows"] > 0


def test_dataset_with_nothing_supervised_is_rejected(tmp_path):
    chat = tmp_path / "c.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(4)))
    with pytest.raises(DataError, match="no supervised tokens"):
        prepare_data(_spec(tmp_path, source="jsonl", path=str(chat), shape="dialogue"), str(tmp_path / "w"))
    assert not list((tmp_path / "w").rglob("manifest.json"))  # nothing half-published


def test_missing_data_file_and_missing_field(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare_data(_spec(tmp_path, source="jsonl", path=str(tmp_path / "none.jsonl")), str(tmp_path / "w"))
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"body": "x"}) + "\n" + json.dumps({"body": "y"}))
    with pytest.raises(DataError, match="no 'text' field"):
        prepare_data(_spec(tmp_path, source="jsonl", path=str(bad)), str(tmp_path / "w"))


@pytest.mark.parametrize(
    "lines, shape, message",
    [
        ([b'{"text": "ok"}', b'{"text": null}'], "pretrain", r"b.jsonl:2: 'text' is None, not a string"),
        ([b'{"text": "ok"}', b'{"text": "caf\xe9"}'], "pretrain", r"b.jsonl:2 is not UTF-8 \(byte 0xe9 at column 14\)"),
        ([b'{"text": "ok"}', b"", b'{"text": "ok",}'], "pretrain", r"b.jsonl:3 is not valid JSON"),
        ([b'["text"]'], "pretrain", r"b.jsonl:1 is a list, not an object with a 'text' field"),
        ([b'{"messages": "hi"}'], "dialogue", r"b.jsonl:1: 'messages' must be a non-empty list"),
        (
            [b'{"messages": [{"content": "hi"}]}'],
            "dialogue",
            r"b.jsonl:1: message 0 of 'messages' needs a string 'role'",
        ),
    ],
)
def test_bad_rows_are_one_error_naming_file_and_line(tmp_path, lines, shape, message):
    """Data errors name the file and the line (issue: one clear error for every bad input); a null text is no
    longer trained on as the string "None"; nothing is published."""
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(b"\n".join(lines))
    with pytest.raises(DataError, match=message):
        prepare_data(_spec(tmp_path, source="jsonl", path=str(bad), shape=shape), str(tmp_path / "w"))
    assert not list((tmp_path / "w").rglob("manifest.json"))


def test_a_directory_or_an_unknown_dataset_as_data_path(tmp_path):
    with pytest.raises(DataError, match="is not a file \\(expected a .jsonl file\\)"):
        prepare_data(_spec(tmp_path, source="jsonl", path=str(tmp_path)), str(tmp_path / "w"))
    missing = tmp_path / "no-such-dataset"
    with pytest.raises(DataError, match="no Hugging Face dataset could be loaded .*save_to_disk"):
        prepare_data(_spec(tmp_path, source="hf", path=str(missing)), str(tmp_path / "w"))


def test_hf_dataset_from_local_path(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": [f"doc {i} " * 30 for i in range(4)]}).save_to_disk(str(tmp_path / "ds"))
    spec = _spec(tmp_path, source="hf", path=str(tmp_path / "ds"))
    ref = prepare_data(spec, str(tmp_path / "w"))
    assert ref.info["train_rows"] > 0 and torch.is_tensor(load_split(ref.path, "val")[0])


def _reference_rows(docs, tokenizer, seq_len):
    """What packing means, written the plain way: every `doc + eos` stream concatenated, cut into full rows."""
    stream, starts = [], []
    for d in docs:
        ids = tokenizer(d.text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        stream += ids
        starts += [1] + [0] * (len(ids) - 1)
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len), torch.tensor(starts[: n * seq_len]).view(n, seq_len)


def test_streamed_rows_are_packed_documents_in_parallel_or_not_and_read_memory_mapped(tmp_path):
    """300 documents (enough to tokenize in 2 processes): the rows equal the plain packing of the training
    documents, byte for byte whatever the number of processes; training reads them memory-mapped."""
    import numpy as np

    from tasks.data.documents import iter_documents
    from tasks.data.tokenizer import load_tokenizer
    from tasks.data.tokenizing import PARALLEL_FROM
    from tasks.rows import open_split
    from tasks.training.runtime import Split

    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"doc {i}: " + "word " * (i % 17 + 3)}) for i in range(300)))
    assert 300 >= PARALLEL_FROM
    refs = []
    for procs in (1, 2):
        spec = _spec(tmp_path, source="jsonl", path=str(path), val_fraction=0.1, max_val_rows=None, num_proc=procs)
        refs.append(prepare_data(spec, str(tmp_path / f"w{procs}")))
    assert refs[0].key == refs[1].key  # data.num_proc is not part of the key
    one, two = (Path(r.path) for r in refs)
    for f in ("train.input_ids.npy", "train.doc_starts.npy", "val.input_ids.npy"):
        assert (one / f).read_bytes() == (two / f).read_bytes()
    tokenizer = load_tokenizer(str(one / "tokenizer"))
    val = set(refs[0].info["val_document_ids"])
    train_docs = [d for d in iter_documents(spec.data) if d.doc_id not in val]
    ids, starts = _reference_rows(train_docs, tokenizer, 16)
    mapped_ids, loss, attn = open_split(one, "train")
    assert torch.equal(mapped_ids.long(), ids) and bool(loss.all()) and bool(attn.all())
    assert torch.equal(torch.from_numpy(np.load(one / "train.doc_starts.npy")).long(), starts)
    assert torch.equal(Split.open(one, "train").doc_starts.long(), starts)  # what training reads (DFlash's mask)
    assert isinstance(np.load(one / "train.input_ids.npy", mmap_mode="c"), np.memmap)
    assert refs[0].info["train_documents"] == len(train_docs) and len(val) == 30


def test_a_preparation_failing_mid_stream_leaves_no_open_row_file(tmp_path, monkeypatch):
    """A failure while rows are being written (here: the 3rd document) closes and removes the raw row files;
    nothing is published and no file handle outlives the stage."""
    import contextlib
    import os

    from tasks import prepare_data as prep

    text = tmp_path / "t.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"line {i} " * 20}) for i in range(6)))
    calls, add = [], prep.SplitRows.add

    def failing(self, units):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        add(self, units)

    monkeypatch.setattr(prep.SplitRows, "add", failing)
    with pytest.raises(Exception, match="No space left") as failure:  # held, as a run's failed state holds it
        prepare_data(_spec(tmp_path, source="jsonl", path=str(text)), str(tmp_path / "w"))
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used is gone
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
    assert not [f for f in fds if str(tmp_path) in f], (fds, failure.value)
    assert not list((tmp_path / "w").rglob("*.raw")) and not list((tmp_path / "w").rglob("*.npy"))


def test_a_generated_task_is_one_supervised_conversation_per_problem_with_the_eos_fill(tmp_path):
    """`data.source: task` (docs/post-training.md): every row is a problem and its answer, EOS-filled and supervised
    to the end of the row; the validation documents are the problems the evaluation holds out."""
    from tasks.evaluation.chat import held_out_problems

    task = {"family": "arithmetic", "problems": 60, "max_operand": 9}
    spec = _spec(tmp_path, source="task", shape="dialogue", task=task, val_fraction=0.25)
    ref = prepare_data(spec, str(tmp_path / "w"))
    ids, loss, attn = load_split(ref.path, "train")
    assert ref.info["train_documents"] + ref.info["val_documents"] == 60 and ids.shape[0] == 45
    assert (attn == 1).all() and (loss[:, -1] == 1).all()  # filled to the end of every row
    assert (ids[:, -1] == ref.info["eos_token_id"]).all()
    assert 0 < loss.sum() < attn.sum()  # the problem itself is not supervised
    assert len(held_out_problems(spec, 100)) == ref.info["val_documents"] == 15
    with pytest.raises(ValueError, match="data.source task needs a data.task section"):
        _spec(tmp_path, source="task", shape="dialogue")
    with pytest.raises(ValueError, match="set data.shape: dialogue"):
        _spec(tmp_path, source="task", task=task)
    with pytest.raises(ValueError, match="data.task is read only with data.source task"):
        _spec(tmp_path, task=task)
    with pytest.raises(DataError, match=r"data.task: task family 'arithmetic' gave only 155 distinct problems"):
        prepare_data(
            _spec(tmp_path, source="task", shape="dialogue", task={**task, "problems": 500}), str(tmp_path / "x")
        )
