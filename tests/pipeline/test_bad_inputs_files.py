"""Bad model files and disks get one clear line naming what to change, before anything is trained or written
(docs/operations.md, "Bad input: refused as early as it can be seen" and "Faults"): a DFlash draft or a folder
whose weights do not cover its model given as `model.path`, an empty folder or a truncated weights file, a
full disk under torch's zip writer, a read-only workdir or store; and `resume with:` only where a resume helps."""

import contextlib
import errno
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file, save_file

from dllm_common.config import ConfigError, TrainingDiverged
from dllm_common.store import DiskFullError, is_disk_full
from strategies.models import build_model, load_pretrained, tiny_model_config
from strategies.options import validate_config


def _spec(path, strategies=("mdlm",)):
    return {
        "pipeline": {"strategies": list(strategies)},
        "data": {"seq_len": 64},
        "model": {"kind": "pretrained", "path": str(path)},
    }


def _refused(call, *parts: str) -> str:
    with pytest.raises(ConfigError) as err:
        call()
    msg = str(err.value)
    assert all(p in msg for p in parts) and "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama") / "model"
    build_model(tiny_model_config("llama", 64, 64, 32, 2, 2, None, None, False), 0).save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- 1. a DFlash draft, weights that do not cover


def test_a_dflash_draft_as_a_backbone_is_refused_at_validate_and_before_training(tmp_path):
    from strategies.dflash.config import DFlashDraftConfig
    from strategies.dflash.draft import DFlashDraftModel

    cfg = DFlashDraftConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        intermediate_size=40, block_size=4, target_layer_ids=[0, 1], mask_token_id=63, num_target_layers=2,
        vocab_size=64, rope_theta=1e4, attention_bias=False, max_position_embeddings=64,
    )  # fmt: skip
    draft = tmp_path / "draft"
    DFlashDraftModel(cfg).save(draft)
    expected = (
        f"model.path ({draft}) is a DFlash draft (architectures: DFlashDraftModel), not a causal LM: a draft has no "
        "embeddings or LM head of its own"
    )
    msg = _refused(lambda: validate_config(_spec(draft)), expected)
    assert _refused(lambda: load_pretrained(str(draft)), expected) == msg
    validate_config(_spec(draft, ["dflash"]))  # the dflash strategy's model.path is a draft by design


def test_weights_that_do_not_cover_the_model_are_refused_naming_a_few(tiny_llama, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_bytes((tiny_llama / "config.json").read_bytes())
    state = load_file(str(tiny_llama / "model.safetensors"))
    kept = {k: v for k, v in state.items() if not k.startswith("model.layers.1.")}
    save_file(kept, str(partial / "model.safetensors"), metadata={"format": "pt"})
    validate_config(_spec(partial))  # whole and readable: only loading shows what is missing
    _refused(
        lambda: load_pretrained(str(partial)),
        f"model.path ({partial}): its weights do not cover the model its config.json describes (",
        "missing: model.layers.1.",
        "they would start from random values. Point model.path at the complete checkpoint",
    )
    assert load_pretrained(str(tiny_llama)) is not None  # the complete folder loads


# ---------------------------------------------------------------- 2. empty folder, no weights, truncated weights


def test_an_empty_folder_no_weights_or_a_truncated_weights_file_names_model_path(tiny_llama, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    msg = _refused(lambda: validate_config(_spec(empty)), f"model.path ({empty}) is empty: not a model folder")
    assert _refused(lambda: load_pretrained(str(empty))) == msg

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((tiny_llama / "config.json").read_bytes())
    validate_config(_spec(bare))  # config.json alone is what `dllm-flow plan` reads (configs/models/llama-3-8b)
    _refused(lambda: load_pretrained(str(bare)), f"model.path ({bare}) has config.json but no weights")

    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_bytes((tiny_llama / "config.json").read_bytes())
    whole = (tiny_llama / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    msg = _refused(
        lambda: validate_config(_spec(cut)),
        f"model.path ({cut}): model.safetensors is damaged: {len(whole) // 2} bytes, but its header declares "
        f"{len(whole)} (truncated?); copy or download the model again",
    )
    assert _refused(lambda: load_pretrained(str(cut))) == msg
    (cut / "model.safetensors").write_bytes(whole[:5])
    _refused(lambda: validate_config(_spec(cut)), "model.safetensors is damaged: 5 bytes, shorter than a safetensors")


def test_cli_validate_prints_the_model_path_line(tmp_path, capsys):
    from flows.cli import main

    (tmp_path / "empty").mkdir()
    sets = ["--set", "model.kind=pretrained", "--set", f"model.path={tmp_path / 'empty'}"]
    assert main(["validate", str(ROOT / "configs/smoke.yaml"), *sets]) == 2
    err = capsys.readouterr().err
    assert err == f"dllm-flow: error: model.path ({tmp_path / 'empty'}) is empty: not a model folder " + (
        "(config.json and its weights, as save_pretrained or `dllm-flow export` writes them); point model.path at one\n"
    )


# ---------------------------------------------------------------- 3. a full disk under torch's zip writer


class _FullDisk(io.RawIOBase):
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, inner, room: int):
        self.inner, self.room = inner, room

    def write(self, b):
        n = len(memoryview(b))
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.inner.write(b)

    def writable(self):
        return True

    def tell(self):
        return self.inner.tell()

    def seek(self, *args):
        return self.inner.seek(*args)

    def fileno(self):
        return self.inner.fileno()

    def flush(self):
        self.inner.flush()


@pytest.mark.parametrize("room", [900, 100])  # in a tensor's record ("unexpected pos 704 vs 598"), at its start
def test_a_full_disk_under_torchs_zip_writer_is_the_disk_full_line(tmp_path, monkeypatch, room):
    from torch.distributed.checkpoint import filesystem

    from tasks.training.distributed import DistInfo
    from tasks.training.resume import Checkpointer

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with Path(path).open(mode) as stream:
            yield _FullDisk(stream, room) if "w" in mode else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    where = tmp_path / "checkpoint"
    with pytest.raises(DiskFullError) as err:
        Checkpointer(where, DistInfo(), sharded=False).save(model, opt, sched, None, {"step": 4})
    assert str(err.value).startswith(f"no space left on the device while writing the step-4 checkpoint in {where} ")
    assert list(tmp_path.iterdir()) == []  # the partial write is removed


def test_a_wrapped_enospc_reaching_the_command_exits_2_with_the_disk_full_line(monkeypatch, capsys):
    """What the zip writer raises over a failed write (its OSError as context, or only its text once it crossed
    a process) is the documented disk-full line and exit 2, without `resume with:`."""
    import flows.cli as cli

    def zip_writer_over_enospc(args):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            error.run_id = "20261201-000000-aaaaaa"
            raise error  # noqa: B904 (the OSError is its context, as in torch.save)

    monkeypatch.setattr(cli, "cmd_validate", zip_writer_over_enospc)
    assert cli.main(["validate", "configs/smoke.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm-flow: error: no space left on the device (RuntimeError: [enforce fail at ")
    assert "free space (or point --workdir at a larger disk) and rerun" in err
    assert "resume with" not in err and len(err.strip().splitlines()) == 1
    assert is_disk_full(RuntimeError("train[mdlm]: unexpected pos 704 vs 598"))  # from another process: text only
    assert is_disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert not is_disk_full(RuntimeError("CUDA out of memory"))


# ---------------------------------------------------------------- 4. a read-only workdir or store


@pytest.fixture
def read_only(tmp_path):
    """A folder on a read-only tmpfs mounted for the test (root only: chmod does not stop root from writing)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root (a chmod'ed folder is writable by root, not by others)")
    mounted = []

    def make(where: Path, fill=lambda p: None) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(where)
        fill(where)
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        return where

    yield make
    for where in reversed(mounted):
        subprocess.run(["umount", str(where)], check=False)


def test_generate_on_a_read_only_workdir_says_so_in_seconds(tmp_path, read_only):
    workdir = read_only(tmp_path / "ro", lambda p: (p / "mlflow.db").write_bytes(b""))
    started = time.monotonic()
    cmd = [sys.executable, "-m", "flows.cli", "generate", "--checkpoint", "models:/t-mdlm@latest", "--prompt", "Hi"]
    cmd += ["--workdir", str(workdir)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and time.monotonic() - started < 60, done.stderr[-2000:]
    assert done.stderr == (
        f"dllm-flow: error: --workdir {workdir} is read-only (Read-only file system): its MLflow registry "
        f"(mlflow.db) cannot be opened there: pass the checkpoint folder instead (dllm-flow generate {workdir}/store/"
        f"train/<key>/model ...; `dllm-flow runs --workdir {workdir}` lists the runs), or copy the workdir somewhere "
        "writable (cp -a) and pass --workdir with the copy\n"
    )


def test_run_on_a_read_only_store_names_it_in_one_line(tmp_path, read_only, capsys):
    from flows.cli import main

    store = read_only(tmp_path / "w" / "store")
    assert main(["run", str(ROOT / "configs/smoke.yaml"), "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"dllm-flow: error: {store} is not writable (Read-only file system): every stage publishes and every run "
        "records there; make it writable (remount it read-write) or pass --workdir DIR with a writable path\n"
    )


def test_run_with_one_read_only_stage_folder_is_refused_before_any_stage(tmp_path, read_only, capsys):
    """A read-only mount at one stage's folder (store/train) is found by the workdir check, before prepare_data
    runs, not by the train stage's lock after it."""
    from flows.cli import main

    workdir = tmp_path / "w"
    train = read_only(workdir / "store" / "train")
    assert main(["run", str(ROOT / "configs/smoke.yaml"), "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"dllm-flow: error: {train} is on a read-only mount: stage train publishes there; remount it read-write or "
        "pass --workdir DIR with a writable path\n"
    )
    assert not (workdir / "store" / "prepare_data").exists()  # no stage ran


def test_a_stage_lock_in_a_read_only_folder_is_one_line(tmp_path, read_only):
    """The store made read-only after the workdir check (mid-run): the stage's lock names the folder, no raw
    OSError about a .lock file."""
    from dllm_common.store import Store

    store = Store(tmp_path / "store")
    train = read_only(tmp_path / "store" / "train")
    with pytest.raises(PermissionError) as caught:
        with store.lock("train", "abc"):
            pass
    assert str(caught.value) == (
        f"{train} is not writable (Read-only file system): stage train publishes there; make it writable "
        "(remount it read-write) or pass --workdir DIR with a writable path"
    )


# ---------------------------------------------------------------- 5. `resume with:` only where resuming helps


def test_resume_is_suggested_only_for_errors_a_resume_can_fix():
    from types import SimpleNamespace

    from flows.cli import _resume_hint
    from flows.pipeline import StrategiesFailed

    def hint(exc):
        exc.run_id = "20261201-000000-bbbbbb"
        return _resume_hint(exc, SimpleNamespace(workdir="work"))

    resume = "\n  resume with: dllm-flow resume 20261201-000000-bbbbbb --workdir work"
    assert hint(RuntimeError("train[mdlm] failed in its process (exit -9)")) == resume
    assert hint(TrainingDiverged("train[mdlm]: the loss is nan at step 4")) == resume
    for fixed_first in (
        ConfigError("model.path (x) is empty: not a model folder"),
        FileNotFoundError("data.path x does not exist"),
        PermissionError("/w/store is not writable (Read-only file system): …"),
        DiskFullError(errno.ENOSPC, "no space left on the device while writing …"),
        OSError(errno.EROFS, "Read-only file system"),
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
        RuntimeError("API request to endpoint /api/2.0/mlflow/runs/create failed with error code 401 != 200"),
    ):
        assert hint(fixed_first) == "", fixed_first
    both = StrategiesFailed("2 strategies failed")
    both.errors = {"mdlm": ConfigError("x"), "idlm": RuntimeError("killed")}
    assert hint(both) == resume
    both.errors = {"mdlm": ConfigError("x"), "idlm": FileNotFoundError("y")}
    assert hint(both) == ""
