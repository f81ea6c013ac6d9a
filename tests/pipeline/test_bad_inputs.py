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
    if "dflash" in strategies:  # a 1-layer draft: the default 4 layers need a target of 7, deeper than the default 6
        sections.setdefault("model", {"num_layers": 1})
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
    from strategies.assembly import assemble_strategy

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


# ---------------------------------------------------------------- 4. values the config alone shows are wrong (issue 28)


def _validate(capsys, *sets: str, config: str = "configs/smoke.yaml"):
    """`dllm-flow validate CONFIG --set ...` in this process: (exit status, stderr)."""
    from conftest import ROOT

    from flows.cli import main

    capsys.readouterr()
    args = [arg for item in sets for arg in ("--set", item)]
    code = main(["validate", str(ROOT / config), *args])
    return code, capsys.readouterr().err


def test_a_key_written_twice_is_refused_naming_it_and_both_lines(tmp_path, capsys):
    from dllm_common.config import apply_overrides, read_yaml

    twice = tmp_path / "twice.yaml"
    twice.write_text(
        "pipeline:\n  name: t\ntrain:\n  global_batch_size: 16\neval:\n  sample_length: 8\n"
        "train:\n  global_batch_size: 32\n"
    )
    expected = (
        f"config file {twice}: train appears twice (on line 3 and on line 7); YAML would silently keep only the "
        "second, so merge the two or delete one"
    )
    with pytest.raises(ConfigError) as err:
        read_yaml(twice)
    assert str(err.value) == expected
    code, err = _validate(capsys, config=str(twice))
    assert code == 2 and err == f"dllm-flow: error: {expected}\n"
    inside = tmp_path / "inside.yaml"
    inside.write_text(
        "train:\n  steps: 30\n  lr: 0.01\n  steps: 40\neval:\n  overrides: {scdd: {top_k: 1, top_k: 2}}\n"
    )
    with pytest.raises(ConfigError, match=r"inside.yaml: train\.steps appears twice \(on line 2 and on line 4\)"):
        read_yaml(inside)
    with pytest.raises(
        ConfigError, match=r"^override 'train=\{steps: 3, steps: 4\}': steps appears twice \(on line 1\)"
    ):
        apply_overrides({}, ["train={steps: 3, steps: 4}"])
    # the same key in two sections, anchors and merge keys (`<<:` overrides on purpose) stay as YAML has them
    fine = tmp_path / "fine.yaml"
    fine.write_text("a: &base {k: 1, j: 2}\nb:\n  <<: *base\n  k: 3\nc: {k: 4}\nd: *base\n")
    assert read_yaml(fine) == {"a": {"k": 1, "j": 2}, "b": {"k": 3, "j": 2}, "c": {"k": 4}, "d": {"k": 1, "j": 2}}


def test_a_warmup_longer_than_the_training_is_refused_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        validate_config(_spec(["mdlm"], train={"steps": 10, "warmup_steps": 11}))
    assert str(err.value).splitlines()[1:] == [
        "  train.warmup_steps (11) is larger than train.steps (10): the learning rate would still be ramping up when "
        "training ends and never reach train.lr; set train.warmup_steps to at most 10"
    ]
    with pytest.raises(
        ConfigError, match=r"dflash\.pretrain\.warmup_steps \(30\) is larger than dflash\.pretrain\.steps"
    ):
        validate_config(_spec(["dflash"], dflash={"pretrain": {"steps": 20}}))
    # equal is allowed: the last step trains at train.lr (the schedule reaches 1 there; nothing is left to decay)
    from dllm_common.config import TrainConfig
    from tasks.training.runtime import OptimSettings, lr_lambda

    assert validate_config(_spec(["mdlm"], train={"steps": 10, "warmup_steps": 10})).train.warmup_steps == 10
    assert lr_lambda(9, OptimSettings.of(TrainConfig(steps=10, warmup_steps=10))) == 1.0


def test_samples_longer_than_a_tiny_models_context_are_refused_at_load(capsys):
    code, err = _validate(capsys, "eval.sample_length=64")
    assert code == 2, err
    assert err.splitlines()[1] == (
        "  the shortest eval.prompts entry (1 token) + eval.sample_length (64) = 65 positions, more than the model's "
        "context (data.seq_len, a tiny model's max_position_embeddings) of 64; lower eval.sample_length to at most 63"
    )
    assert _validate(capsys, "eval.sample_length=63")[0] == 0  # the tokenized prompts are checked before training
    pretrained = {"kind": "pretrained", "path": "some/model"}  # its context is in its config: read before training
    validate_config(_spec(["mdlm"], model=pretrained, eval={"sample_length": 500}))
    validate_config(_spec(["dflash"], dflash={"target_model_id": "some/model"}, eval={"sample_length": 500}))


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.betas=[1.5, 0.9]"], "train.betas must be two numbers in [0, 1) (AdamW's decay rates of its gradient"),
        (["train.betas=[0.9, 1.0]"], "got [0.9, 1.0]"),
        (["train.betas=[-0.1, 0.9]"], "train.betas must be two numbers in [0, 1)"),
        (["train.betas=[0.9, .nan]"], "train.betas.1: Input should be a finite number (got nan)"),
        (["train.lr=.inf"], "train.lr: Input should be a finite number (got inf)"),  # every config value is finite
        (["train.grad_clip=.nan"], "train.grad_clip: Input should be a finite number (got nan)"),
        (["train.weight_decay=-0.1"], "train.weight_decay: Input should be greater than or equal to 0"),
        (
            ["model.num_kv_heads=3"],
            "model.num_kv_heads (3) must divide model.num_heads (4): each key/value head serves the same number of "
            "query heads; use one of [1, 2, 4]",
        ),
        (["model.num_kv_heads=0"], "model.num_kv_heads: Input should be greater than or equal to 1 (got 0)"),
        (["model.intermediate_size=-5"], "model.intermediate_size: Input should be greater than or equal to 1"),
        (["model.intermediate_size=0"], "model.intermediate_size: Input should be greater than or equal to 1"),
        (["model.hidden_size=66"], "model.hidden_size (66) must be divisible by model.num_heads (4)"),
        (
            ["model.hidden_size=96", "model.num_heads=32"],
            "model.hidden_size (96) ÷ model.num_heads (32) = 3 dimensions per head, which must be even (rotary "
            "position embeddings rotate pairs of dimensions); change model.hidden_size or model.num_heads",
        ),
        (["dflash.pretrain.intermediate_size=0"], "dflash.pretrain.intermediate_size: Input should be greater than"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_optimizer_and_model_shape_values_torch_would_fail_on_are_refused_by_validate(capsys, sets, message):
    code, err = _validate(capsys, *sets)
    assert code == 2 and err.startswith("dllm-flow: error: invalid config ") and message in err, err
    assert "(got {" not in err  # a rule that names its keys is not followed by the whole section


def test_optimizer_and_model_shapes_that_fit_are_kept(capsys):
    for sets in (["train.betas=[0.0, 0.999]"], ["model.num_kv_heads=2"], ["model.num_kv_heads=4"]):
        assert _validate(capsys, *sets)[0] == 0, sets
    assert _validate(capsys, "model.hidden_size=72", "model.num_heads=4")[0] == 0  # 18 per head


# ---------------------------------------------------------------- 5. a tracking server nobody answers at


def test_an_unreachable_tracking_server_is_refused_in_seconds_before_anything_starts(tmp_path, capsys):
    import time

    from conftest import ROOT, free_port

    from flows.cli import main

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    capsys.readouterr()
    code = main(
        ["run", str(ROOT / "configs/smoke.yaml"), "--set", f"tracking.uri={uri}", "--workdir", str(tmp_path / "w")]
    )
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 10, err
    assert err == (
        f"dllm-flow: error: tracking.uri {uri}: no MLflow tracking server answers there (Connection refused); start "
        "it (`make server` serves one at http://127.0.0.1:5000) or remove tracking.uri to track into the workdir's "
        "own store (WORKDIR/mlflow.db)\n"
    )
    assert not (tmp_path / "w").exists()  # refused before the workdir, the Prefect API or any stage
    code = main(["report", "some-run", "--workdir", str(tmp_path / "w"), "--tracking-uri", uri])
    err = capsys.readouterr().err
    assert code == 2 and f"error: --tracking-uri {uri}: no MLflow tracking server answers there" in err, err
    assert "drop --tracking-uri to read the workdir's own store" in err and not (tmp_path / "w").exists()


def test_a_recorded_run_resumes_only_where_its_tracking_server_answers(tmp_path, capsys):
    from conftest import free_port

    from dllm_common.runs import RunRecord
    from flows.cli import main

    uri = f"http://127.0.0.1:{free_port()}"
    record = RunRecord(
        run_id="20261201-000000-bbbbbb",
        pipeline="p",
        config_path="c.yaml",
        overrides=[],
        config={"tracking": {"uri": uri}},
        config_sha256="0" * 64,
        pid=None,
    )
    record.status = "FAILED"
    record.save(tmp_path)
    capsys.readouterr()
    assert main(["resume", record.run_id, "--workdir", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert f"error: tracking.uri {uri}: no MLflow tracking server answers there" in out.err and not out.out


def test_a_tracking_server_that_answers_anything_or_nothing_in_time(tmp_path):
    import http.server
    import socket
    import threading

    from dllm_common.tracking import UnreachableTrackingServer, check_tracking_server

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # a proxy or a path prefix without MLflow's /health: something is there
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check_tracking_server(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    with socket.socket() as silent:  # accepts connections (the backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(
            UnreachableTrackingServer, match=r"no MLflow tracking server answers there \(no answer in 0.5 s\)"
        ):
            check_tracking_server(uri, seconds=0.5)
    for not_a_server in (None, "sqlite:///x.db", "file:///tmp/mlruns", "databricks"):
        check_tracking_server(not_a_server)


# ---------------------------------------------------------------- 6. lm-eval task names, before any training


def test_lm_eval_task_names_are_checked_before_training(capsys):
    from conftest import ROOT

    local = f"include_path: {ROOT / 'tests/data/lm_eval'}"
    assert _validate(capsys, f"eval.lm_eval={{tasks: [shakespeare_mc, hellaswag], {local}}}")[0] == 0
    code, err = _validate(capsys, "eval.lm_eval={tasks: [hellaswg, AraDiCE_ArabicMMLU_high_stem_physics_egy]}")
    assert code == 2 and err == (
        "dllm-flow: error: eval.lm_eval.tasks: unknown lm-eval task 'hellaswg' (did you mean hellaswag, hellaswag_vi, "
        "hellaswag_uk?); `lm-eval ls tasks` lists the harness's tasks, and eval.lm_eval.include_path adds a folder of "
        "your own\n"
    ), err  # the second name is one only the harness's own index knows (it comes from an included YAML)
    code, err = _validate(capsys, "eval.lm_eval={tasks: [shakespeare_mc], include_path: no/such/folder}")
    assert code == 2 and "eval.lm_eval.include_path 'no/such/folder' is not a directory" in err, err


# ---------------------------------------------------------------- 7. report --out that is a file


def test_report_out_that_is_a_file_is_named_and_left_alone(tmp_path, capsys):
    from flows.cli import main

    blocker = tmp_path / "report.md"
    blocker.write_text("mine")
    for out, where in ((blocker, "is a file"), (blocker / "sub", f"is inside {blocker}, which is a file")):
        capsys.readouterr()
        assert main(["report", "some-run", "--workdir", str(tmp_path / "w"), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"dllm-flow: error: report --out {out} {where}, not a directory; nothing was written. Give --out a "
            "directory (new or existing) for report.md, report.json and the plots\n"
        ), err
    assert blocker.read_text() == "mine" and not (tmp_path / "w").exists()  # refused before MLflow is opened
