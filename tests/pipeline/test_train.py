"""Training stage: the loss falls, a crashed stage resumes exactly, denominators are step-level."""

import json

import pytest
import torch
from conftest import ROOT
from runkit import metric_history
from stagekit import through_the_stages

import tasks.train as train_mod
import tasks.training.loop as loop_mod
from dllm_common.checkpoint import verify_checkpoint
from strategies.registry import REGISTRY
from tasks.train import train
from tasks.training.runtime import DataOrder, OptimSettings, lr_lambda


def test_data_order_covers_each_epoch_once():
    order = DataOrder(10, seed=0)
    first_epoch = torch.cat([order.rows(s, 5) for s in range(2)])
    assert sorted(first_epoch.tolist()) == list(range(10))
    assert torch.equal(DataOrder(10, seed=0).rows(3, 5), order.rows(3, 5))


def test_lr_schedule_warms_up_then_decays(tiny_spec):
    cfg = OptimSettings.of(tiny_spec.train)
    values = [lr_lambda(s, cfg) for s in range(cfg.steps)]
    assert values[0] < values[1] == 1.0 and values[-1] == pytest.approx(cfg.min_lr_ratio, abs=0.05)


def test_training_loss_falls(prepared, tiny_spec, tmp_path):
    data, _ = prepared
    spec = tiny_spec.model_copy(update={"train": tiny_spec.train.model_copy(update={"steps": 40, "val_every": 5})})
    ref = train(spec, "mdlm", data, str(tmp_path))
    assert len(metric_history(tmp_path, ref.mlflow_run_id, "train/loss")) == 40
    val = [v for _, v in metric_history(tmp_path, ref.mlflow_run_id, "val/loss")]  # fixed noise: comparable
    assert len(val) == 8 and val[-1] < 0.9 * val[0] and min(val[4:]) < min(val[:2])
    verify_checkpoint(train_mod.model_dir(ref))


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_killed_stage_resumes_from_checkpoint_exactly(prepared, tiny_spec, tmp_path, monkeypatch, asynchronous):
    """Also with `train.checkpoint_async`: the step-4 checkpoint is written in the background and swapped in
    while steps 5 and 6 run; the resumed weights equal the uninterrupted run's bit for bit."""
    data, _ = prepared
    full = train(tiny_spec, "mdlm", data, str(tmp_path / "full"))
    if asynchronous:  # not part of the key: the same stage, checkpointed another way
        tiny_spec = tiny_spec.model_copy(
            update={"train": tiny_spec.train.model_copy(update={"checkpoint_async": True})}
        )

    real_step = loop_mod.run_step
    calls = {"n": 0}

    def crashing_step(*args, **kwargs):
        if args[3]:  # is_train
            calls["n"] += 1
            if calls["n"] == 7:  # after the checkpoint at step 4, mid-way to the next
                raise Crash("killed")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop_mod, "run_step", crashing_step)
    with pytest.raises(Crash):
        train(tiny_spec, "mdlm", data, str(tmp_path / "resumed"))
    work = next((tmp_path / "resumed" / "store" / "train").glob("*.work"))
    assert json.loads((work / "checkpoint" / "dllm.json").read_text())["step"] == 4
    monkeypatch.setattr(loop_mod, "run_step", real_step)
    resumed = train(tiny_spec, "mdlm", data, str(tmp_path / "resumed"))

    from safetensors.torch import load_file

    wa = load_file(str(train_mod.model_dir(full) / "model.safetensors"))
    wb = load_file(str(train_mod.model_dir(resumed) / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # MLflow continued the same child run: every step once, no gaps, same values
    hist_full = metric_history(tmp_path / "full", full.mlflow_run_id, "train/loss")
    hist_res = metric_history(tmp_path / "resumed", resumed.mlflow_run_id, "train/loss")
    assert [s for s, _ in hist_res] == list(range(tiny_spec.train.steps))
    assert [v for _, v in hist_res] == [v for _, v in hist_full]
    assert not work.exists()


def test_rerun_reuses_the_published_stage(prepared, tiny_spec, tmp_path):
    data, _ = prepared
    first = train(tiny_spec, "mdlm", data, str(tmp_path))
    second = train(tiny_spec, "mdlm", data, str(tmp_path))
    assert not first.reused and second.reused and first.key == second.key


def test_pretrained_model_and_tokenizer_from_local_paths(prepared, tiny_spec, tmp_path):
    """`model.kind: pretrained` / `tokenizer.kind: pretrained` load from a local dir (no hub)."""
    from dllm_common.config import validate_schema
    from strategies.models import build_model, tiny_model_config
    from tasks.prepare_data import load_tokenizer, prepare_data

    data, _ = prepared
    tok_dir = f"{data.path}/tokenizer"
    model_dir = tmp_path / "my-model"
    build_model(
        tiny_model_config("qwen3", len(load_tokenizer(tok_dir)), 32, 32, 1, 2, None, None, False), 0
    ).save_pretrained(model_dir)
    raw = tiny_spec.model_dump(mode="json")
    raw["tokenizer"] = {"kind": "pretrained", "path": tok_dir}
    raw["model"] = {"kind": "pretrained", "path": str(model_dir)}
    raw["train"].update(steps=3, val_every=3, checkpoint_every=10)
    spec = validate_schema(raw)
    own = prepare_data(spec, str(tmp_path / "w"))
    ref = train(spec, "mdlm", own, str(tmp_path / "w"))
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(train_mod.model_dir(ref)).model_type == "qwen3"
    assert ref.info["mask_token_id"] == load_tokenizer(tok_dir).mask_token_id


def _stage_spec(tiny_spec):
    return tiny_spec.model_copy(update={"train": tiny_spec.train.model_copy(update={"steps": 30, "val_every": 5})})


@pytest.mark.parametrize("strategy", sorted(REGISTRY))
def test_each_strategy_trains_evaluates_and_reports_through_the_stages(prepared, tiny_spec, tmp_path, strategy):
    """Every registered strategy: fixed-noise val loss falls in a short CPU run; evaluation reports exactly the
    likelihoods it declares (each with bits per byte) and its samples' cost, the same again from a fresh store;
    the report shows what it has and names the settings its sampler reads; `dllm-flow generate` decodes with every
    sampler it declares (tests/stagekit.py). A strategy that trains against upstream stages of its own (a target,
    its features) goes through the same stages in its own stage test, which builds them first."""
    from strategies import strategy_class

    spec = _stage_spec(tiny_spec)
    upstream = strategy_class(strategy).upstream_stages(spec)
    if upstream:
        own = ROOT / "tests" / "pipeline" / f"test_{strategy}_stages.py"
        assert own.is_file() and "through_the_stages(" in own.read_text(), f"{strategy} needs {list(upstream)}"
        return
    data, _ = prepared
    through_the_stages(spec, strategy, data, tmp_path)
