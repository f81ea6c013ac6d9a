"""Bad inputs get one clear error that names what to change, before any stage runs: a block longer than a
training row, a [MASK] id outside the vocabulary, a damaged MLflow sqlite store."""

import hashlib
import random
import sqlite3
from types import SimpleNamespace

import pytest
from conftest import denoiser_strategies

from dllm_common.config import ConfigError
from dllm_common.tracking import DamagedStoreError, Tracking, check_local_store, default_tracking_uri
from strategies.options import validate_config


def _spec(strategies, dllm=None, **sections):
    return {"pipeline": {"strategies": strategies}, "data": {"seq_len": 64}, "dllm": dllm or {}, **sections}


# ---------------------------------------------------------------- 1. block sizes longer than a row


@pytest.mark.parametrize(
    "raw, key, value",
    [
        (_spec(["hybrid"], {"block_size": 128}), "dllm.block_size", 128),
        (_spec(["block_diffusion"], {"block_size": 128}), "dllm.block_size", 128),
        (
            _spec(["mdlm", "block_diffusion"], {"overrides": {"block_diffusion": {"block_size": 65}}}),
            "dllm.overrides.block_diffusion.block_size",
            65,
        ),
        (_spec(["idlm"], {"block_length": 100}), "dllm.block_length", 100),
        (_spec(["dflash"], dflash={"block_size": 128}), "dflash.block_size", 128),
    ],
    ids=["hybrid", "block_diffusion", "override", "idlm", "dflash"],
)
def test_block_longer_than_a_row_is_refused_at_load(raw, key, value):
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    msg = str(err.value)
    assert f"{key} ({value}) is larger than data.seq_len (64)" in msg, msg
    assert f"Set {key} to at most" in msg and "\n" not in msg, msg


def test_cli_validate_refuses_a_block_longer_than_a_row(capsys):
    from conftest import ROOT

    from flows.cli import main

    assert main(["validate", str(ROOT / "configs/hybrid.yaml"), "--set", "dllm.block_size=128"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm-flow: error: dllm.block_size (128) is larger than data.seq_len (64); "), err


def test_block_sizes_that_fit_or_mean_auto_are_kept():
    validate_config(_spec(["hybrid"], {"block_size": 64}))
    validate_config(_spec(["hybrid"]))  # None: one noise level per row
    validate_config(_spec(["block_diffusion"], {"block_size": 64}))
    validate_config(_spec(["block_diffusion"]))  # the default (256) is one block per row, not a choice made here
    validate_config(_spec(["idlm"], {"block_length": 64}))
    validate_config(_spec(["dflash"], dflash={"block_size": 0}))  # 0: the draft checkpoint's
    validate_config(_spec(["dflash"], dflash={"block_size": 32}))


def test_dflash_block_that_no_row_can_hold_twice_is_refused():
    """DFlash keeps an anchor block only in rows with ≥ 2 × block_size supervised tokens."""
    with pytest.raises(ConfigError) as err:
        validate_config(_spec(["dflash"], dflash={"block_size": 33}))
    msg = str(err.value)
    assert "dflash.block_size (33) is too large for the training rows" in msg, msg
    assert "2 × 33 = 66 supervised tokens" in msg and "data.seq_len (64) tokens" in msg and "at most 32" in msg
    regenerated = {"block_size": 25, "regenerate": {"prompt_len": 16}}
    with pytest.raises(ConfigError) as err:
        validate_config(_spec(["dflash"], dflash=regenerated))
    assert "dflash.regenerate.prompt_len (16) = 48" in str(err.value) and "at most 24" in str(err.value)
    validate_config(_spec(["dflash"], dflash={**regenerated, "block_size": 24}))


# ---------------------------------------------------------------- 2. [MASK] id outside the vocabulary


def test_mask_id_outside_a_vocabulary_known_at_load_is_refused():
    with pytest.raises(ConfigError) as err:
        validate_config(_spec(["mdlm"], {"mask_token_id": 5000}, tokenizer={"vocab_size": 2048}))
    msg = str(err.value)
    assert "dllm.mask_token_id (5000) is outside the vocabulary of 2048 tokens (tokenizer.vocab_size" in msg, msg
    assert "valid ids are 0..2047" in msg
    validate_config(_spec(["mdlm"], {"mask_token_id": 2047}, tokenizer={"vocab_size": 2048}))
    # the strategy's own vocab_size bounds it too, and the message names where the id was set
    raw = _spec(["scdd"], {"overrides": {"scdd": {"mask_token_id": 60, "vocab_size": 50}}})
    with pytest.raises(
        ConfigError,
        match=r"dllm\.overrides\.scdd\.mask_token_id \(60\) is outside the vocabulary of "
        r"50 tokens \(dllm\.overrides\.scdd\.vocab_size\); valid ids are 0\.\.49",
    ):
        validate_config(raw)


def test_mask_id_against_a_pretrained_vocabulary_waits_for_run_time():
    pretrained = {
        "tokenizer": {"kind": "pretrained", "path": "some/model"},
        "model": {"kind": "pretrained", "path": "some/model"},
    }
    validate_config(_spec(["mdlm"], {"mask_token_id": 999_999}, **pretrained))
    validate_config(_spec(["dflash"], {"mask_token_id": 999_999}, dflash={"target_model_id": "some/model"}))


@pytest.mark.parametrize("strategy", denoiser_strategies())
def test_mask_id_outside_the_model_vocabulary_is_refused_where_it_is_resolved(strategy):
    from strategies.registry import assemble_strategy

    model = SimpleNamespace(config=SimpleNamespace(vocab_size=100))
    with pytest.raises(ConfigError) as err:
        assemble_strategy(strategy, {"mask_token_id": 100}, model, None)
    assert isinstance(err.value, ValueError)
    assert str(err.value).startswith(
        "dllm.mask_token_id (100) is outside the model's vocabulary of 100 tokens; valid ids are 0..99"
    ), str(err.value)


# ---------------------------------------------------------------- 3. a damaged MLflow sqlite store


def _store(workdir):
    """A healthy multi-page sqlite file where the workdir's MLflow store lives."""
    db = workdir / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY, artifact_location TEXT)")
        con.execute("CREATE TABLE metrics (k TEXT, v REAL)")
        con.executemany("INSERT INTO metrics VALUES (?, ?)", [(f"m{i}" * 20, i) for i in range(2000)])
    con.close()
    return db


def _damage(db, how):
    data, noise = db.read_bytes(), random.Random(0).randbytes
    if how == "truncated":
        db.write_bytes(data[:5000])
    elif how == "random":
        db.write_bytes(noise(len(data)))
    else:  # a page in the middle overwritten
        page = 4096
        db.write_bytes(data[: 3 * page] + noise(page) + data[4 * page :])


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _expected(db, workdir):
    return (
        f"MLflow store {db} is damaged (",
        f"); move it aside (mv {db} {db}.damaged) to start a fresh tracking store — the stage store under "
        f"{workdir.resolve() / 'store'} is untouched",
    )


@pytest.mark.parametrize("how", ["truncated", "random", "overwritten page"])
def test_damaged_store_gives_one_message_and_is_left_as_it_is(tmp_path, how):
    db = _store(tmp_path).resolve()
    _damage(db, how)
    before = _digest(db)
    head, tail = _expected(db, tmp_path)
    for open_store in (
        lambda: default_tracking_uri(tmp_path),
        lambda: Tracking(tmp_path, None, "x"),
        lambda: Tracking(tmp_path, f"sqlite:///{db}", "x"),
    ):
        with pytest.raises(DamagedStoreError) as err:
            open_store()
        msg = str(err.value)
        assert msg.startswith(head) and msg.endswith(tail) and "\n" not in msg, msg
        assert isinstance(err.value, ValueError)
    assert _digest(db) == before and sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


def test_cli_report_on_a_damaged_store_prints_the_one_message(tmp_path, capsys):
    from flows.cli import main

    db = _store(tmp_path).resolve()
    _damage(db, "truncated")
    before = _digest(db)
    assert main(["report", "some-run", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    head, tail = _expected(db, tmp_path)
    assert err.startswith(f"dllm-flow: error: {head}database disk image is malformed{tail}"), err
    assert "Traceback" not in err and "sqlalchemy" not in err.lower()
    assert _digest(db) == before


def test_healthy_empty_or_missing_store_passes(tmp_path):
    check_local_store(tmp_path / "mlflow.db")  # missing: MLflow creates it
    (tmp_path / "mlflow.db").write_bytes(b"")
    check_local_store(tmp_path / "mlflow.db")  # empty: a new sqlite database
    (tmp_path / "mlflow.db").unlink()
    db = _store(tmp_path)
    before = _digest(db)
    check_local_store(db, tmp_path)
    assert default_tracking_uri(tmp_path).endswith("mlflow.db") and _digest(db) == before


def test_debug_raises_the_error_that_is_otherwise_one_line(tmp_path, capsys, monkeypatch):
    import contextlib

    monkeypatch.setenv("DLLM_FLOW_DEBUG", "")  # main sets it to 1: recorded here so that it is undone after the test

    from conftest import ROOT

    from flows.cli import main

    missing = str(tmp_path / "nope.yaml")
    with contextlib.chdir(ROOT):
        assert main(["validate", missing]) == 2
        line = capsys.readouterr().err
        assert line.startswith("dllm-flow: error: ") and line.count("\n") == 1 and "nope.yaml" in line
        with pytest.raises((ConfigError, FileNotFoundError)):
            main(["--debug", "validate", missing])


def test_a_config_path_that_is_a_directory_or_not_text_is_named(tmp_path):
    from dllm_common.config import read_yaml

    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory; pass the path of a YAML file"):
        read_yaml(tmp_path)
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\x00\xff")
    with pytest.raises(ConfigError, match=rf"config file {binary} is not UTF-8 text \(byte 0xff at offset 1\)"):
        read_yaml(binary)
