"""`dllm-flow plan --step-cost FILE`: each strategy's FLOPs-based time times its measured step cost ÷ FLOPs from
the file `benchmarks/step_cost.py --json` writes (issue 45 item 4, docs/planning.md "Measured step costs"); the
header says which ratios were applied, from where, and which strategies were assumed at their counted FLOPs."""

import importlib.util
import json
import os

import pytest
import yaml
from conftest import ROOT

from dllm_common.config import ConfigError
from flows import cli
from strategies.options import validate_config
from tasks.commands import plan


def _writer():
    """benchmarks/step_cost_json.py, the writer `step_cost.py --json` calls (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("step_cost_json", ROOT / "benchmarks" / "step_cost_json.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RAW = {
    "pipeline": {"name": "p", "strategies": ["mdlm", "idlm"]},
    "data": {"seq_len": 64},
    "tokenizer": {"vocab_size": 512},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2},
    "train": {"global_batch_size": 4, "micro_batch_size": 2, "device": "cpu"},
    "dllm": {"mask_token_id": 3},
}


def _doc(device="cuda", dtype="bfloat16", **strategies) -> dict:
    """A step-cost file as one would write it by hand: `strategies` name → measured ÷ FLOPs."""
    return {
        "format": "dllm-flow step-cost",
        "version": 1,
        "date": "2026-12-06T07:30:00Z",
        "device": device,
        "device_name": "NVIDIA H100 80GB HBM3" if device == "cuda" else "x86_64",
        "dtype": dtype,
        "torch": "2.9.0",
        "model": {"hidden": 2048, "layers": 16, "seq": 2048, "batch": 4},
        "strategies": {name: {"measured_over_flops": value} for name, value in strategies.items()},
    }


def _file(tmp_path, doc, name="cost.json") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


@pytest.fixture(scope="module")
def spec():
    return validate_config(RAW)


@pytest.fixture(scope="module")
def assumed(spec):
    """Both strategies planned without a file: each step at its counted FLOPs."""
    return {n: plan.plan_strategy(spec, n, plan.Cluster(1), variants=False, sizing=False) for n in ("mdlm", "idlm")}


def test_each_strategys_time_scales_by_exactly_its_ratio_in_the_file(spec, assumed, tmp_path):
    path = _file(tmp_path, _doc(mdlm=1.25))  # idlm is not in the file
    cluster = plan.cluster_for(spec, 1, "80GB", None, None, path)
    assert cluster.step_cost.ratios == {"mdlm": 1.25} and cluster.step_cost.path == path
    measured = {n: plan.plan_strategy(spec, n, cluster, variants=False, sizing=False) for n in ("mdlm", "idlm")}
    # by hand: the FLOPs-based time is FLOPs ÷ (989 TFLOP/s × 0.4) (fp32: 67 TFLOP/s), × the file's ratio
    flops = assumed["mdlm"].flops_per_token * 64 * 2 * 2  # seq × rows × micro-batches
    assert assumed["mdlm"].step_seconds == pytest.approx(flops / (67e12 * 0.4), rel=1e-12)
    assert measured["mdlm"].step_seconds == pytest.approx(1.25 * flops / (67e12 * 0.4), rel=1e-12)
    assert measured["mdlm"].step_seconds == pytest.approx(1.25 * assumed["mdlm"].step_seconds, rel=1e-12)
    assert measured["mdlm"].tokens_per_second == pytest.approx(assumed["mdlm"].tokens_per_second / 1.25, rel=1e-12)
    assert (measured["mdlm"].step_cost, measured["idlm"].step_cost) == (1.25, 1.0)
    # a strategy the file lacks keeps its FLOPs-based time, and its memory is untouched by either
    assert measured["idlm"].step_seconds == assumed["idlm"].step_seconds
    assert measured["idlm"].tokens_per_second == assumed["idlm"].tokens_per_second
    assert measured["mdlm"].flops_per_token == assumed["mdlm"].flops_per_token
    assert measured["mdlm"].peak == assumed["mdlm"].peak


def test_the_header_says_what_the_time_assumes(spec, assumed, tmp_path):
    plans = list(assumed.values())
    without = plan.render(spec, plan.Cluster(1), plans, "p.yaml").splitlines()
    assert without[3] == (
        "the time assumes each step costs exactly its counted FLOPs (no overhead beyond them): `python "
        "benchmarks/step_cost.py --device cuda --json FILE` measures each strategy's on your GPU, "
        "`--step-cost FILE` applies it"
    )
    assert "| strategy | FLOPs per token | per GPU per step | step | tokens/s |" in without

    path = _file(tmp_path, _doc(mdlm=1.25, hybrid=2.0))  # hybrid: not a strategy of this config
    cluster = plan.cluster_for(spec, 1, "80GB", None, None, path)
    plans = [plan.plan_strategy(spec, n, cluster, variants=False, sizing=False) for n in ("mdlm", "idlm")]
    lines = plan.render(spec, cluster, plans, "p.yaml").splitlines()
    assert lines[3] == (
        "time × each strategy's measured step cost ÷ its counted FLOPs (a causal-LM step at that utilization being "
        f"1), from {path} (cuda NVIDIA H100 80GB HBM3, bfloat16, torch 2.9.0, hidden 2048, 16 layers, 4 × 2048 "
        "tokens, 2026-12-06T07:30:00Z): mdlm × 1.25"
    )
    assert lines[4] == f"× 1 assumed (each step at its counted FLOPs) for those not in {path}: idlm"
    assert lines[5] == "measured in bfloat16, while this config trains in float32: the ratios may differ"
    assert lines[6] == ""
    assert "| strategy | FLOPs per token | per GPU per step | step cost ÷ FLOPs | step | tokens/s |" in lines
    rows = [line for line in lines if line.startswith("| mdlm |") or line.startswith("| idlm |")][-2:]
    assert rows[0].split(" | ")[3:5] == ["1.25", f"{plans[0].step_seconds:.3g} s"]
    assert rows[1].split(" | ")[3:5] == ["1 (assumed)", f"{plans[1].step_seconds:.3g} s"]

    # mdlm measured at the training precision, idlm failed in that run: the lines say so, and no dtype line
    doc = _doc(dtype="float32", mdlm=0.9)
    doc["failed"] = {"idlm": "RuntimeError: out of memory"}
    cluster = plan.cluster_for(spec, 1, "80GB", None, None, _file(tmp_path, doc, "failed.json"))
    lines = plan.render(spec, cluster, plans, "p.yaml").splitlines()
    assert lines[3].endswith("mdlm × 0.9")
    assert lines[4].endswith(": idlm (its measurement failed there)") and lines[5] == ""


@pytest.mark.parametrize(
    "content, why",
    [
        (None, "no such file"),
        ("{not json", "is not JSON"),
        ([1, 2], 'is not a step-cost file (no "format": "dllm-flow step-cost")'),
        ({**_doc(mdlm=1.0), "version": 2}, "is version 2 of the format; this dllm-flow reads 1"),
        ({**_doc(mdlm=1.0), "device": "tpu"}, "its 'device' is 'tpu', not one of cpu, cuda"),
        ({**_doc(), "strategies": []}, "it has no 'strategies' object"),
        (_doc(mdlm=0), "strategy 'mdlm' has no positive 'measured_over_flops' (it has 0)"),
        (_doc(mdlm="1.1"), "strategy 'mdlm' has no positive 'measured_over_flops' (it has '1.1')"),
        (_doc(mdlm=float("nan")), "strategy 'mdlm' has no positive 'measured_over_flops' (it has nan)"),
        ({**_doc(mdlm=1.0), "strategies": {"mdlm": {"measured": 1.2}}}, "(it has None)"),
        ({**_doc(mdlm=1.0), "dtype": None}, "its 'dtype' is None, not a text"),
    ],
)
def test_a_missing_or_malformed_file_is_one_clear_error(tmp_path, content, why):
    path = str(tmp_path / "cost.json") if content is None else _file(tmp_path, content)
    with pytest.raises(ConfigError) as err:
        plan.read_step_cost(path)
    message = str(err.value)
    assert message.startswith(f"--step-cost {path}: ") and why in message
    assert "write it with `python benchmarks/step_cost.py --device cuda --json" in message
    assert "or leave out --step-cost" in message


def test_an_unreadable_file_is_one_clear_error(tmp_path):
    folder = tmp_path / "cost.json"
    folder.mkdir()  # reading a folder fails for root too
    with pytest.raises(ConfigError, match=r"--step-cost .*cost\.json: cannot be read \(IsADirectoryError"):
        plan.read_step_cost(folder)


def test_a_file_measured_on_another_kind_of_device_is_refused(tmp_path):
    cpu = _file(tmp_path, _doc(device="cpu", dtype="float32", mdlm=1.1))
    with pytest.raises(ConfigError) as err:
        plan.step_cost_for(cpu, "cuda")
    assert str(err.value) == (
        f"--step-cost {cpu} was measured on cpu (x86_64) and this plan is for CUDA ranks: measure on the device you "
        "plan for (`python benchmarks/step_cost.py --device cuda --json FILE`), or leave out --step-cost"
    )
    assert plan.step_cost_for(cpu, "cpu").ratios == {"mdlm": 1.1}  # a CPU plan (the validation's) takes it
    with pytest.raises(ConfigError, match="was measured on cuda .* this plan is for cpu ranks"):
        plan.step_cost_for(_file(tmp_path, _doc(mdlm=1.1), "gpu.json"), "cpu")
    assert plan.step_cost_for(None, "cuda") is None


def test_the_command_line_applies_the_file_and_refuses_a_bad_one(tmp_path, capsys):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({**RAW, "train": {**RAW["train"], "global_batch_size": 2}}))
    path = _file(tmp_path, _doc(idlm=1.5))
    assert cli.main(["plan", str(cfg), "--step-cost", path]) == 0
    out = capsys.readouterr().out
    assert f"from {path} (cuda NVIDIA H100 80GB HBM3, " in out and "2026-12-06T07:30:00Z): idlm × 1.5\n" in out
    assert f"× 1 assumed (each step at its counted FLOPs) for those not in {path}: mdlm\n" in out
    cpu = _file(tmp_path, _doc(device="cpu", mdlm=1.0), "cpu.json")
    for bad, why in ((cpu, "was measured on cpu"), (str(tmp_path / "none.json"), "no such file")):
        assert cli.main(["plan", str(cfg), "--step-cost", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"dllm-flow: error: --step-cost {bad}") and why in err[0]


def test_what_the_writer_writes_the_plan_reads(tmp_path):
    """step_cost's writer, called on a small result as `step_cost.py --json` passes it: the file reads back with
    measured ÷ FLOPs per strategy, and replaces an older one whole, leaving no temporary file."""
    writer = _writer()
    results = {
        "mdlm": {"ratio": 0.9, "flops": 300.0, "causal_flops": 400.0, "strategy": 9.0, "causal": 10.0},
        "hybrid": {"ratio": 2.5, "flops": 800.0, "causal_flops": 400.0, "strategy": 25.0, "causal": 10.0},
    }
    meta = {
        "device": "cuda",
        "device_name": "NVIDIA H200",
        "dtype": "bfloat16",
        "model": {"hidden": 2048, "layers": 16, "seq": 2048, "batch": 4},
    }
    target = tmp_path / "cost.json"
    target.write_text("an older file")
    assert writer.write_json(target, results, {"idlm": "RuntimeError: boom"}, **meta) == target
    assert sorted(os.listdir(tmp_path)) == ["cost.json"]
    doc = json.loads(target.read_text())
    assert doc["strategies"]["mdlm"] == {
        "measured": 0.9,
        "flops_ratio": 0.75,
        "measured_over_flops": pytest.approx(1.2),
        "step_ms": 9.0,
        "causal_ms": 10.0,
    }
    assert doc["strategies"]["hybrid"]["flops_ratio"] == 2.0 and doc["strategies"]["hybrid"]["measured_over_flops"]
    cost = plan.step_cost_for(target, "cuda")
    assert cost.ratios == {"mdlm": pytest.approx(1.2), "hybrid": pytest.approx(1.25)}
    assert cost.failed == {"idlm": "RuntimeError: boom"} and cost.device_name == "NVIDIA H200"
    assert cost.dtype == "bfloat16" and cost.torch and cost.date.endswith("Z") and cost.model["layers"] == 16

    # a write that fails leaves the file as it was and no temporary file
    with pytest.raises(TypeError):
        writer.write_json(target, results, **{**meta, "model": {"shape": object()}})
    assert json.loads(target.read_text()) == doc and sorted(os.listdir(tmp_path)) == ["cost.json"]
    # a run without the FLOPs count (--no-flops) has no measured ÷ FLOPs to write
    with pytest.raises(ValueError, match="no FLOPs count"):
        writer.document({"mdlm": {"ratio": 1.0}}, device="cuda", dtype="bfloat16")
