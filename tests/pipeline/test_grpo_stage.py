"""The GRPO stage end to end (docs/post-training.md, "The GRPO stage"): a tiny chat SFT on a generated task, then
`grpo[mdlm]` and `evaluate_grpo[mdlm]` through the pipeline — per-step metrics in the stage's own MLflow run, the
tuned model published and changed, the report's accuracy columns, everything reused on a rerun; a stage killed after
its checkpoint resumes to the very weights of an uninterrupted one; bad input refused before any rollout."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT
from grpokit import TINY_GRPO as TINY
from safetensors.torch import load_file

from dllm_common.config import ConfigError
from dllm_common.tracking import Tracking
from strategies.options import validate_config
from tasks.common import StageRef, store_for
from tasks.posttrain.grpo import check_prompts_fit, check_rewards, grpo, stage_of
from tasks.posttrain.rewards import RewardError

RUN_TWICE = """
import json, sys
from flows.cli import main
print(json.dumps([main(["run", sys.argv[1], "--workdir", sys.argv[2]]) for _ in range(2)]))
"""


@pytest.fixture(scope="module")
def piped(tmp_path_factory, prefect_api):
    """The tiny SFT → GRPO pipeline run twice: (workdir, the two run records)."""
    from runkit import run_twice

    root = tmp_path_factory.mktemp("grpo")
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    workdir = root / "w"
    records = run_twice(RUN_TWICE, [str(config), str(workdir)], workdir, prefect_api)
    return workdir, records


@pytest.mark.slow
def test_grpo_runs_after_training_tracks_each_step_and_is_reused(piped):
    workdir, (first, second) = piped
    statuses = [{s["name"]: s["status"] for s in r["stages"]} for r in (first, second)]
    assert statuses[0]["grpo[mdlm]"] == statuses[0]["evaluate_grpo[mdlm]"] == "COMPLETED"
    assert set(statuses[1].values()) == {"REUSED"}
    stages = {s["name"]: s for s in first["stages"]}
    # its own MLflow run, a child of the pipeline's, with every step's numbers
    client = Tracking(workdir, None, "grpo-tiny").client
    run = client.get_run(stages["grpo[mdlm]"]["mlflow_run_id"])
    assert run.data.tags["dllm.stage"] == "grpo" and run.data.tags["mlflow.parentRunId"]
    assert run.data.tags["dllm.registered_model"] == "grpo-tiny-mdlm-grpo/1"  # its own registered model
    for name in ("reward_mean", "reward_std", "accuracy", "kl", "clip_fraction", "completion_length", "eos_rate"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, f"grpo/{name}")]
        assert steps == [1, 2, 3, 4], name
    kl = [m.value for m in client.get_metric_history(run.info.run_id, "grpo/kl")]
    assert kl[0] > 0  # the second inner update of step 1 already moved away from the reference
    # the tuned model: published in the checkpoint format, recording where it came from, and changed
    tuned = Path(next((workdir / "store" / "grpo").glob("*/manifest.json")).parent)
    sft = Path(next((workdir / "store" / "train").glob("*/manifest.json")).parent)
    meta = json.loads((tuned / "model" / "dllm.json").read_text())
    assert meta["grpo"]["from"] == sft.name and meta["strategy"] == "mdlm"
    a, b = load_file(str(sft / "model" / "model.safetensors")), load_file(str(tuned / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    rollouts = [json.loads(line) for line in (tuned / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rollouts] == [0, 1, 2, 3] and all(len(r["completions"]) == 4 for r in rollouts)
    # the paired comparison, on both runs, and in the report
    train_run = client.get_run(stages["train[mdlm]"]["mlflow_run_id"]).data.metrics
    for key in (
        "grpo/heldout_sft",
        "grpo/heldout_accuracy",
        "grpo/heldout_gain",
        "grpo/heldout_gain_lo",
        "grpo/heldout_gain_hi",
    ):
        assert key in train_run and key in client.get_run(run.info.run_id).data.metrics
    assert train_run["grpo/heldout_gain_lo"] <= train_run["grpo/heldout_gain"] <= train_run["grpo/heldout_gain_hi"]
    assert train_run["grpo/heldout_gain"] == pytest.approx(
        train_run["grpo/heldout_accuracy"] - train_run["grpo/heldout_sft"]
    )
    report = (workdir / "report.md").read_text()
    assert "accuracy (GRPO)" in report and "GRPO gain" in report


def _refs(workdir: Path):
    store = store_for(workdir)
    entry = next(p for p in (workdir / "store" / "train").iterdir() if p.is_dir())
    return StageRef.of(store.lookup("train", entry.name), True, "train[mdlm]")


@pytest.mark.slow
def test_a_killed_stage_resumes_to_the_weights_of_an_uninterrupted_one(piped, tmp_path, monkeypatch, capsys):
    workdir, _ = piped
    trained = _refs(workdir)
    raw = {**TINY, "grpo": {**TINY["grpo"], "rewards": ["tests.pipeline.grpo_rewards:flaky"], "reward_weights": None}}
    spec = validate_config(raw)
    whole = grpo(spec, "mdlm", trained, str(tmp_path / "whole"))
    # rewards are called once per group, 2 groups a step: call 6 is the third step's second group, after the
    # checkpoint of step 2
    importlib.import_module("tests.pipeline.grpo_rewards").flaky.calls = 0
    monkeypatch.setenv("DLLM_TEST_FAIL_AT", "6")
    with pytest.raises(Exception, match="killed"):
        grpo(spec, "mdlm", trained, str(tmp_path / "cut"))
    assert not store_for(tmp_path / "cut").lookup("grpo", whole.key)  # nothing published
    checkpoint = store_for(tmp_path / "cut").work_dir("grpo", whole.key) / "checkpoint"
    assert json.loads((checkpoint / "dllm.json").read_text())["step"] == 2
    monkeypatch.delenv("DLLM_TEST_FAIL_AT")
    capsys.readouterr()
    resumed = grpo(spec, "mdlm", trained, str(tmp_path / "cut"))
    assert "resuming from the step-2 checkpoint" in capsys.readouterr().out
    a = load_file(str(Path(whole.path) / "model" / "model.safetensors"))
    b = load_file(str(Path(resumed.path) / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line)["step"] for line in (Path(resumed.path) / "rollouts.jsonl").read_text().splitlines()]
    assert rows == [0, 1, 2, 3]  # the resumed run repeated steps 2-3, and kept each once


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_processes_under_torchrun_tune_to_the_one_process_weights(piped, tmp_path, capsys, parallel):
    """`train.nproc_per_node: 2` runs the stage under torchrun (gloo): each rank rolls out half of every step's
    problems and the gradients are summed over both (by an all-reduce, or by FSDP2's reduce-scatter of sharded
    weights, gathered for the rollouts), so the tuned weights, the logged metrics and the rollouts kept are the
    one-process run's; the step-2 checkpoint is written by both ranks (DCP) on the way."""
    workdir, _ = piped
    trained = _refs(workdir)
    tiny = {**TINY, "grpo": {**TINY["grpo"], "steps": 3, "checkpoint_every": 2}}
    alone = grpo(validate_config(tiny), "mdlm", trained, str(tmp_path / "one"))
    spread = {**tiny, "train": {**TINY["train"], "nproc_per_node": 2, "micro_batch_size": 8, "parallel": parallel}}
    shared = grpo(validate_config(spread), "mdlm", trained, str(tmp_path / "two"))
    assert "grpo[mdlm]: launching torchrun with 2 processes" in capsys.readouterr().out
    a = load_file(str(Path(alone.path) / "model" / "model.safetensors"))
    b = load_file(str(Path(shared.path) / "model" / "model.safetensors"))
    sft = load_file(str(Path(trained.path) / "model" / "model.safetensors"))
    assert any(not torch.equal(a[k], sft[k]) for k in a)  # the stage moved the weights
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    clients = [Tracking(tmp_path / w, None, "grpo-tiny").client for w in ("one", "two")]
    for name in ("grpo/reward_mean", "grpo/kl", "grpo/loss", "grpo/eos_rate"):
        one, two = (
            [m.value for m in c.get_metric_history(r.mlflow_run_id, name)] for c, r in zip(clients, (alone, shared))
        )
        assert len(one) == 3 and two == pytest.approx(one, abs=1e-5), name
    kept = [(Path(ref.path) / "rollouts.jsonl").read_text() for ref in (alone, shared)]
    assert kept[0] == kept[1]


@pytest.mark.slow
def test_under_lora_the_adapters_are_tuned_and_the_reference_is_the_trained_model(piped, tmp_path):
    """`grpo.peft`: fresh LoRA adapters on the trained model are all that moves; the reference is the same module
    with them switched off, which computes exactly what the trained checkpoint computes (no second copy); `merge`
    publishes plain weights that compute what the adapter model computes."""
    from strategies.models import adapters_off
    from tasks.evaluation.trained_model import load_for_generation

    workdir, _ = piped
    trained = _refs(workdir)
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    raw = {**TINY, "grpo": {**TINY["grpo"], "steps": 2, "beta": 0.1, "peft": lora, "checkpoint_every": 10}}
    tuned = grpo(validate_config(raw), "mdlm", trained, str(tmp_path / "w"))
    sft = load_file(str(Path(trained.path) / "model" / "model.safetensors"))
    out = load_file(str(Path(tuned.path) / "model" / "model.safetensors"))
    adapters = {k: v for k, v in out.items() if "lora_" in k}
    assert adapters and any(v.abs().sum() > 0 for k, v in adapters.items() if "lora_B" in k)  # B starts at 0
    base = {k.replace(".base_layer", ""): v for k, v in out.items() if "lora_" not in k}
    assert base.keys() == sft.keys() and all(torch.equal(base[k], sft[k]) for k in sft)
    assert (Path(tuned.path) / "adapter" / "adapter_model.safetensors").is_file()

    policy = load_for_generation(Path(tuned.path) / "model", "cpu")
    reference = load_for_generation(Path(trained.path) / "model", "cpu")
    x = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)
    with torch.no_grad():
        tuned_logits = policy.strategy.denoiser(policy.model)(x, mask)
        with adapters_off(policy.model) as base_model:
            off = policy.strategy.denoiser(base_model)(x, mask)
        want = reference.strategy.denoiser(reference.model)(x, mask)
    torch.testing.assert_close(off, want, rtol=0, atol=1e-5)
    assert not torch.allclose(tuned_logits, want, atol=1e-4)

    merged = {**raw, "grpo": {**raw["grpo"], "peft": {**lora, "merge": True}}}
    plain = grpo(validate_config(merged), "mdlm", trained, str(tmp_path / "m"))
    assert not any("lora_" in k for k in load_file(str(Path(plain.path) / "model" / "model.safetensors")))
    with torch.no_grad():
        folded = load_for_generation(Path(plain.path) / "model", "cpu")
        torch.testing.assert_close(folded.strategy.denoiser(folded.model)(x, mask), tuned_logits, rtol=0, atol=1e-4)


def test_bad_input_is_refused_before_any_rollout(piped):
    workdir, _ = piped
    bad = {**TINY, "grpo": {**TINY["grpo"], "rewards": ["tests.pipeline.grpo_rewards:raises"], "reward_weights": None}}
    with pytest.raises(RewardError, match="'tests.pipeline.grpo_rewards:raises' raised ValueError"):
        check_rewards(validate_config(bad))
    data_dir = next(p for p in (workdir / "store" / "prepare_data").iterdir() if p.is_dir())
    data = StageRef.of(store_for(workdir).lookup("prepare_data", data_dir.name), True)
    long = {**TINY, "grpo": {**TINY["grpo"], "completion_length": 18}}
    with pytest.raises(ConfigError, match="grpo.completion_length.*grpo's rollouts"):
        check_prompts_fit(validate_config(long), data)
    check_prompts_fit(validate_config(TINY), data)  # the tiny settings fit


@pytest.mark.slow
def test_prompts_from_a_file_reach_the_rewards_with_their_fields(piped, tmp_path):
    """`grpo.prompts`: the rollouts' prompts are the file's rows, each row's other fields reach the rewards (a
    reward that reads `target` runs), the key follows the file's content, and the file is checked before any
    rollout."""
    workdir, _ = piped
    trained = _refs(workdir)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "target": 2} for a, b in ((1, 2), (3, 4), (5, 6))]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {
        **TINY["grpo"],
        "steps": 2,
        "prompts": str(prompts),
        "rewards": ["math_answer", "tests.pipeline.grpo_rewards:length_target"],
        "reward_weights": None,
        "checkpoint_every": 10,
    }
    spec = validate_config({**TINY, "grpo": settings})
    check_rewards(spec)
    tuned = grpo(spec, "mdlm", trained, str(tmp_path / "w"))
    shown = [json.loads(line) for line in (Path(tuned.path) / "rollouts.jsonl").read_text().splitlines()]
    assert {r["prompt"] for r in shown} <= {r["prompt"] for r in rows}
    assert all(r["answer"] == str(eval(r["prompt"][:-1])) for r in shown)
    metrics = Tracking(tmp_path / "w", None, "grpo-tiny").client.get_run(tuned.mlflow_run_id).data.metrics
    assert "grpo/reward_tests.pipeline.grpo_rewards:length_target" in metrics
    assert grpo(spec, "mdlm", trained, str(tmp_path / "w")).reused  # the same content: the same stage
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    assert stage_of(validate_config({**TINY, "grpo": settings}), "mdlm", trained, "")[1] != tuned.key
    prompts.write_text('{"prompt": "1+1="}\n{"answer": "3"}\n')
    with pytest.raises(ConfigError, match=r"prompts.jsonl line 2 has no \"prompt\" string \(keys: \['answer'\]\)"):
        check_rewards(validate_config({**TINY, "grpo": settings}))


@pytest.mark.slow
@pytest.mark.parametrize(
    "estimator, reward, gain",
    [
        ("one_step", "shorter", 0.5),  # −characters: the completions are at least half a character shorter
        ("elbo_eubo", "digits", 0.2),  # a fifth more of the characters are digits
    ],
)
def test_grpo_learns_what_its_reward_asks_for(piped, tmp_path, estimator, reward, gain):
    """d1's clipped ratio learns a reward for shorter completions, SPG's bounds one for digits: within a few steps
    the reward of the sampled completions rises (the rollouts are the policy's own samples, so this is the update
    acting on the sampler, end to end). SPG weighs each completion by its length (a sequence-level gradient), so a
    reward that is the length itself makes its update mostly negative; docs/post-training.md measures that."""
    workdir, _ = piped
    trained = _refs(workdir)
    grpo_settings = {
        **TINY["grpo"],
        "steps": 12,
        "prompts_per_step": 4,
        "group_size": 8,
        "completion_length": 8,
        "sample_steps": 8,
        "lr": 3e-3,
        "beta": 0.0,
        "estimator": estimator,
        "rewards": [f"tests.pipeline.grpo_rewards:{reward}"],
        "reward_weights": None,
    }
    spec = validate_config({**TINY, "grpo": grpo_settings})
    tuned = grpo(spec, "mdlm", trained, str(tmp_path / "w"))
    client = Tracking(tmp_path / "w", None, "grpo-tiny").client
    history = [m.value for m in client.get_metric_history(tuned.mlflow_run_id, "grpo/reward_mean")]
    assert len(history) == 12
    first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert last > first + gain, history


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["hybrid", "idlm"])
def test_exact_ar_tunes_the_strategies_with_a_causal_path(strategy, tmp_path, prefect_api):
    """hybrid's causal branch and I-DLM's clean half score the completions exactly: the stage runs on each and
    moves the weights."""
    from runkit import environ

    raw = {
        **TINY,
        "pipeline": {"name": f"grpo-{strategy}", "strategies": [strategy]},
        "grpo": {**TINY["grpo"], "steps": 2, "estimator": "exact_ar", "checkpoint_every": 10},
    }
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    workdir = tmp_path / "w"
    cmd = [sys.executable, "-m", "flows.cli", "run", str(config), "--workdir", str(workdir)]
    out = subprocess.run(cmd, cwd=ROOT, env=environ(prefect_api), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"evaluate_grpo[{strategy}]: ran" in out.stdout + out.stderr
    tuned = next((workdir / "store" / "grpo").glob("*/model/model.safetensors"))
    sft = next((workdir / "store" / "train").glob("*/model/model.safetensors"))
    a, b = load_file(str(sft)), load_file(str(tuned))
    assert any(not torch.equal(a[k], b[k]) for k in a)
