"""Atomic, content-addressed stage store and digest-verified checkpoints."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from rankkit import run_ranks

from dllm_common.checkpoint import (
    CorruptCheckpointError,
    load_trainer_state,
    load_weights_into,
    verify_checkpoint,
    write_checkpoint,
)
from dllm_common.store import Store, stage_key
from strategies.models import build_model, tiny_model_config


def test_key_depends_on_slice_upstream_and_code():
    base = stage_key("s", {"a": 1}, {"up": "k"}, "v1")
    assert base == stage_key("s", {"a": 1}, {"up": "k"}, "v1")
    assert (
        len(
            {
                base,
                stage_key("s", {"a": 2}, {"up": "k"}, "v1"),
                stage_key("s", {"a": 1}, {"up": "j"}, "v1"),
                stage_key("s", {"a": 1}, {"up": "k"}, "v2"),
            }
        )
        == 4
    )


def test_publish_is_all_or_nothing(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(RuntimeError):
        with store.publish("s", "k1", {}) as d:
            (d / "half.txt").write_text("partial")
            raise RuntimeError("crash mid-stage")
    assert store.lookup("s", "k1") is None and list((tmp_path / "s").iterdir()) == []
    with store.publish("s", "k1", {"x": 1}) as d:
        (d / "out.txt").write_text("done")
    entry = store.lookup("s", "k1")
    assert entry.manifest["files"]["out.txt"]["bytes"] == 4 and store.verify(entry) == []
    (entry.path / "out.txt").write_text("tampered")
    assert store.verify(entry) == ["out.txt has 8 bytes, the manifest says 4"]


def _published(store, key="k", text="abcd"):
    calls = []

    def build(out):
        calls.append(1)
        (out / "sub").mkdir()
        (out / "sub" / "w.bin").write_text(text)
        return {"info": {"n": len(calls)}}

    return build, calls


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda e: (e.path / "manifest.json").write_text('{"files": {'), "manifest.json is unreadable"),
        (lambda e: (e.path / "manifest.json").write_text("[]"), "manifest.json is unreadable"),
        (lambda e: (e.path / "manifest.json").unlink(), "manifest.json is missing"),
        (lambda e: (e.path / "sub" / "w.bin").write_text("ab"), "sub/w.bin has 2 bytes, the manifest says 4"),
        (lambda e: shutil.rmtree(e.path / "sub"), "sub/w.bin is missing"),
    ],
)
def test_damaged_entry_is_set_aside_and_rebuilt(tmp_path, caplog, damage, problem):
    """Reuse is verified (docs/architecture.md, "The stage protocol"): a damaged entry is reported in one
    line, moved aside (never deleted) and rebuilt; the intact rebuild is then reused."""
    store = Store(tmp_path)
    build, calls = _published(store)
    entry, reused = store.reuse_or_build("s", "k", build)
    assert not reused and store.reuse_or_build("s", "k", build)[1] and len(calls) == 1
    damage(entry)
    with caplog.at_level("WARNING", logger="dllm_flow.store"):
        again, reused = store.reuse_or_build("s", "k", build)
    assert not reused and len(calls) == 2 and again.manifest["info"] == {"n": 2} and store.verify(again) == []
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and problem in warnings[0] and "moved aside" in warnings[0]
    aside = [p for p in (tmp_path / "s").iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1 and aside[0].name.startswith("k.damaged-") and str(aside[0]) in warnings[0]
    assert store.reuse_or_build("s", "k", build)[1] and len(calls) == 2


def test_same_size_corruption_is_caught_by_full_verification_only(tmp_path, monkeypatch):
    """The check on every reuse compares sizes (cheap); `DLLM_FLOW_VERIFY=full` (`dllm-flow run --verify`)
    re-hashes every file and catches a same-size change too."""
    store = Store(tmp_path)
    build, calls = _published(store)
    entry, _ = store.reuse_or_build("s", "k", build)
    (entry.path / "sub" / "w.bin").write_text("abcX")
    assert store.lookup("s", "k") is not None and len(calls) == 1
    monkeypatch.setenv("DLLM_FLOW_VERIFY", "full")
    assert store.lookup("s", "k") is None and not (tmp_path / "s" / "k").exists()
    assert store.reuse_or_build("s", "k", build)[1] is False and len(calls) == 2


def _model():
    return build_model(tiny_model_config("llama", 32, 8, 16, 1, 2, None, None, True), seed=0)


def test_checkpoint_round_trip(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    opt.step()
    write_checkpoint(tmp_path / "ck", model, meta={"step": 3}, trainer_state={"optimizer": opt.state_dict()})
    other = build_model(tiny_model_config("llama", 32, 8, 16, 1, 2, None, None, True), seed=1)
    load_weights_into(other, tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    state = load_trainer_state(tmp_path / "ck")
    assert state["optimizer"]["state"][0]["step"] == 1
    assert json.loads((tmp_path / "ck" / "dllm.json").read_text()) == {"step": 3}


def test_corrupt_checkpoint_is_detected_and_never_loaded(tmp_path, monkeypatch):
    write_checkpoint(tmp_path / "ck", _model())
    weights = tmp_path / "ck" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "load_model", lambda *a, **k: pytest.fail("corrupt file was loaded"))
    with pytest.raises(CorruptCheckpointError, match="model.safetensors is corrupt .*sha256"):
        load_weights_into(_model(), tmp_path / "ck")


def test_incomplete_checkpoint_dir_is_rejected(tmp_path):
    (tmp_path / "ck").mkdir()
    with pytest.raises(CorruptCheckpointError, match="not a dllm-flow checkpoint"):
        verify_checkpoint(tmp_path / "ck")


def test_rewrite_replaces_atomically(tmp_path):
    write_checkpoint(tmp_path / "ck", _model(), meta={"step": 1})
    write_checkpoint(tmp_path / "ck", _model(), meta={"step": 2})
    assert json.loads((tmp_path / "ck" / "dllm.json").read_text())["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_a_large_checkpoint_is_a_standard_sharded_hugging_face_folder(tmp_path):
    """Above the shard size the weights are transformers' shards + index: verified, loaded back exactly,
    read by `from_pretrained` (tied embeddings included) and exported like a single-file checkpoint."""
    from transformers import AutoModelForCausalLM

    model = _model()
    write_checkpoint(tmp_path / "ck", model, meta={"step": 1}, max_shard_size="2KB")
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "ck" / "model.safetensors").exists()
    digests = verify_checkpoint(tmp_path / "ck")
    assert set(shards) | {"model.safetensors.index.json"} <= set(digests)
    other = build_model(tiny_model_config("llama", 32, 8, 16, 1, 2, None, None, True), seed=1)
    load_weights_into(other, tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), hf.state_dict().values()))
    shard = tmp_path / "ck" / shards[0]
    shard.write_bytes(shard.read_bytes()[:-8] + bytes(8))
    with pytest.raises(CorruptCheckpointError, match=f"{shards[0]} is corrupt"):
        load_weights_into(other, tmp_path / "ck")


def _finalize_failing_on_rank0(rank: int, world: int, out_dir: str):
    """Rank `rank` of a 2-process gloo group saving a checkpoint whose final swap fails on rank 0 only."""
    import errno

    import tasks.training.resume as checkpointing
    from tasks.training.distributed import DistInfo

    if rank == 0:

        def full_disk(tmp, directory):
            raise OSError(errno.ENOSPC, "No space left on device")

        checkpointing.swap_into = full_disk
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    ckpt = checkpointing.Checkpointer(Path(out_dir) / "checkpoint", DistInfo(rank, world, rank), sharded=False)
    try:
        ckpt.save(model, opt, sched, None, {"step": 3})
        outcome = "saved"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    (Path(out_dir) / f"rank{rank}.txt").write_text(outcome)


def test_a_checkpoint_that_fails_on_rank_0_fails_on_every_rank(tmp_path):
    """Rank 0 alone writes the metadata and swaps the folder in; when that fails (a full disk) the other ranks
    learn it and raise too, instead of waiting at a barrier for ever, and no checkpoint or temp folder is left."""
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_finalize_failing_on_rank0, str(out), tmp_path=tmp_path, deadline_s=120)
    assert (
        (out / "rank0.txt")
        .read_text()
        .startswith("DiskFullError: no space left on the device while writing the step-3 checkpoint")
    )
    assert (out / "rank1.txt").read_text() == (
        "RuntimeError: rank 0 could not finish the checkpoint of step 3 (its error is above)"
    )
    assert not (out / "checkpoint").exists() and not list(out.glob(".tmp-*"))
