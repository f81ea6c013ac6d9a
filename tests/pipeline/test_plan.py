"""`dllm-flow plan` (docs/planning.md): the predicted step memory against a real CPU step's allocator, the counted
FLOPs against the model's own count and a closed form, the depth extension against a full-depth trace, the sizing,
the command, and `dllm-flow run`'s warning."""

import importlib.util
import math
import time

import pytest
import torch
import yaml
from conftest import ROOT

from dllm_common.config import ConfigError
from flows import cli
from strategies.options import load_config, validate_config
from tasks.commands import plan
from tasks.commands.plan import estimate as plan_estimate
from tasks.commands.plan import step as plan_step
from tasks.commands.plan import trace as plan_trace


def _benchmark():
    """benchmarks/plan_memory.py: the real step and its allocator measurement the suite checks the plan against."""
    spec = importlib.util.spec_from_file_location("plan_memory", ROOT / "benchmarks" / "plan_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _benchmark()
CPU = plan.Cluster(1, None, device="cpu")


@pytest.fixture
def xs(tmp_path):
    """The benchmark's smallest size (5 layers: the planner traces 3 and extends), ready in a scratch folder."""
    BENCH.prepare(tmp_path, "xs")
    return tmp_path


# one memory setting per strategy, together every setting
CASES = [
    ("mdlm", True, False),
    ("scdd", False, False),
    ("hybrid", True, True),
    ("idlm", False, True),
    ("block_diffusion", True, False),  # transformers' DiffusionGemma (its default), a routed expert per layer
    ("block_diffusion:stack", False, False),
    ("dflash", True, False),
]


@pytest.mark.parametrize(("name", "fused", "ckpt"), CASES)
def test_the_plan_is_what_a_real_cpu_step_allocates_and_counts(xs, name, fused, ckpt):
    """The predicted peak against the CPU allocator's events of a real step; the counted FLOPs against PyTorch's
    own counter over the real step's operations."""
    name, _, architecture = name.partition(":")
    spec = BENCH.spec_for(name, "xs", fused, ckpt, xs, architecture)
    inputs = BENCH.dflash_inputs(spec, "xs", xs) if name == "dflash" else {}
    predicted = plan.plan_strategy(spec, name, CPU, variants=False, sizing=False)
    held, step, counted = BENCH.measure(spec, name, xs, inputs)
    r = predicted.resident
    # what is held is counted from the same tensors' sizes (AdamW's step counters, 4 bytes each, are not planned)
    assert r.weights + r.optimizer + r.frozen == pytest.approx(held, rel=1e-3)
    assert predicted.peak == pytest.approx(held + step, rel=0.05)
    assert predicted.peak - (r.weights + r.optimizer + r.frozen) == pytest.approx(step, rel=0.05)
    tokens = spec.data.seq_len * spec.train.micro_batch_size
    assert predicted.flops_per_token * tokens == pytest.approx(counted, rel=1e-6)


def _parameters(model) -> list:
    return [(name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()]


@pytest.mark.parametrize(
    ("name", "checkpointing", "lora"),
    [
        ("mdlm", True, True),
        ("scdd", False, False),
        ("block_diffusion", False, False),
        ("block_diffusion:stack", False, False),
        ("dflash", False, False),
    ],
)
def test_the_planner_builds_what_training_builds(xs, name, checkpointing, lora):
    """The plan's fake module is the train stage's (`tasks.training.trainee`'s builders, called by both): the same
    parameters by name, shape, dtype and trainability (LoRA's adapters and a DFlash draft's frozen target
    included), the same resolved mask id and fused head."""
    from tasks.common import StageRef
    from tasks.training.trainee import build_trainee

    name, _, architecture = name.partition(":")
    spec = BENCH.spec_for(name, "xs", True, checkpointing, xs, architecture)
    if lora:
        raw = spec.model_dump(mode="json")
        raw["train"]["peft"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
        spec = validate_config(raw)
    inputs = BENCH.dflash_inputs(spec, "xs", xs) if name == "dflash" else {}
    real = build_trainee(spec, name, StageRef("prepare_data", "plan", str(xs / "data")), "cpu", inputs)
    planner = plan_step.Planner(spec, name)
    fake = planner.builder.build(spec.train.fused_head, checkpointing)
    assert _parameters(fake.model) == _parameters(real.model)
    assert (fake.mask_token_id, fake.fused_head) == (real.mask_token_id, real.fused_head)
    if name == "dflash":
        target = real.strategy.target
        assert _parameters(planner.builder.frozen) == _parameters(target)


def test_an_experts_grouped_matmul_counts_as_the_matmul_it_replaces():
    """One expert's grouped matmul is an ordinary matmul: forward and backward (input and weight gradients) count
    the same FLOPs as `x @ w` under PyTorch's own counter (which has no formula for the grouped one)."""
    from torch.utils.flop_counter import FlopCounterMode

    x, w = torch.randn(12, 8, requires_grad=True), torch.randn(1, 8, 4, requires_grad=True)
    offsets = torch.tensor([12], dtype=torch.int32)

    def counted(fn) -> int:
        counter = FlopCounterMode(display=False, custom_mapping=plan.CPU_ATTENTION_FLOPS)
        with counter:
            fn().backward(torch.ones(12, 4))  # a contiguous gradient (the kernel refuses stride 0)
        return counter.get_total_flops()

    grouped = counted(lambda: torch._grouped_mm(x, w, offs=offsets))
    assert grouped == counted(lambda: x @ w[0]) == 3 * 2 * 12 * 8 * 4
    torch.testing.assert_close(torch._grouped_mm(x, w, offs=offsets), x @ w[0])


def test_mdlm_flops_follow_the_closed_form(xs):
    """Full logits, no recomputation: every linear layer 3 × 2·m·n·k (forward, input and weight gradients; the
    embedding needs gradients, so even the first layer's input gradient is formed), attention 4·B·L²·H forward and
    10·B·L²·H backward per layer (five L × L matmuls: the scores are recomputed, then the gradients of the scores, V,
    Q and K; PyTorch's formulas count the whole L × L square)."""
    spec = BENCH.spec_for("mdlm", "xs", False, False, xs)
    hidden, layers, _, vocab, seq, rows, _, _ = BENCH.SIZES["xs"]
    inner = 3 * hidden  # the tiny model's intermediate size
    tokens = rows * seq
    linear = 2 * tokens * (layers * (4 * hidden * hidden + 3 * hidden * inner) + hidden * vocab)
    attention = layers * 14 * rows * seq * seq * hidden
    predicted = plan.plan_strategy(spec, "mdlm", CPU, variants=False, sizing=False)
    assert predicted.flops_per_token * tokens == 3 * linear + attention


def _tiny(name: str, layers: int = 7, **train):
    raw = {
        "pipeline": {"strategies": [name]},
        "data": {"seq_len": 64},
        "tokenizer": {"vocab_size": 512},
        "model": {"hidden_size": 32, "num_layers": layers, "num_heads": 2},
        "train": {"global_batch_size": 2, "micro_batch_size": 2, **train},
    }
    return validate_config(raw)


@pytest.mark.parametrize(
    ("name", "fused", "ckpt", "keep"),
    [
        ("mdlm", True, True, True),
        ("hybrid", False, False, False),
        ("idlm", True, True, False),
        ("scdd", True, False, True),
    ],
)
def test_three_traced_layers_extend_to_the_full_depth(monkeypatch, name, fused, ckpt, keep):
    planner = plan_step.Planner(_tiny(name), name)
    shape = plan.Shape(fused, ckpt, 2)
    extended = planner.trace(shape, keep_grads=keep)
    monkeypatch.setattr(plan_step, "TRACED_LAYERS", 99)  # trace all 7 layers
    assert planner.trace(shape, keep_grads=keep) == extended


def test_more_micro_batches_do_not_add_activations():
    """Under bf16 autocast each micro-batch's weight casts are freed when it ends: four micro-batches peak where one
    does (a 3-layer trace extended to 7 layers predicted 19 % more, the casts of 4 layers left over per micro-batch)."""
    planner = plan_step.Planner(_tiny("idlm", global_batch_size=8, precision="bf16"), "idlm")
    shape = plan.Shape(True, True, 2)
    one, four = planner.trace(shape).peak, planner.trace(shape, micro_batches=4).peak
    assert one <= four <= 1.01 * one


def test_the_largest_micro_batch_is_the_last_that_fits():
    spec = _tiny("mdlm", layers=2)
    at_two = plan.plan_strategy(spec, "mdlm", CPU, variants=False)
    # memory for 3.5 rows' worth: 3 rows fit, 4 do not
    memory = (at_two.peak + 1.5 * at_two.per_row) / (1 - plan.FRAGMENTATION)
    cluster = plan.Cluster(1, memory, device="cpu")
    assert plan.plan_strategy(spec, "mdlm", cluster, variants=False).max_rows == 3
    for rows, fits in ((3, True), (4, False)):
        changed = _tiny("mdlm", layers=2, global_batch_size=rows, micro_batch_size=rows)
        assert (
            plan.plan_strategy(changed, "mdlm", cluster, variants=False, sizing=False).peak <= cluster.usable()
        ) == fits


def test_parallelism_divides_and_adds_what_it_should():
    """Weights, gradients and moments by hand from the tiny Llama's shape; FSDP2 shards them by 4 and adds its
    working set (the root's weights and gradients, two layers' weights, one layer's gradients); DDP keeps a second
    copy of the gradients (its buckets)."""
    spec = _tiny("mdlm", layers=4)
    model, _ = plan_step.Planner(spec, "mdlm").full_model()
    h, inner, vocab, layers = 32, 96, 512, 4
    layer = 4 * h * h + 3 * h * inner + 2 * h  # attention, MLP, two norms
    root = vocab * h + h  # the (tied) embedding and the final norm
    total = 4 * (root + layers * layer)
    rotary = 2 * 4 * (h // 2 // 2)  # two tables of head_dim / 2 floats, on every rank
    fsdp = plan.Resident.of(model, None, plan.Layout(4, "fsdp2", 2, 1), "cuda")
    assert (fsdp.weights, fsdp.gradients, fsdp.optimizer) == (total // 4 + rotary, total // 4, total // 2)
    assert fsdp.working == 4 * (root + root + 2 * layer + layer)
    ddp = plan.Resident.of(model, None, plan.Layout(4, "ddp", 2, 1), "cuda")
    assert (ddp.weights, ddp.gradients, ddp.optimizer, ddp.working) == (total + rotary, total, 2 * total, total)


def test_a_pretrained_config_is_read_without_its_weights():
    spec = load_config(ROOT / "configs" / "plan-8b.yaml")
    model, _ = plan_step.Planner(spec, "hybrid").full_model()
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama 3 8B
    assert not (ROOT / "configs" / "models" / "llama-3-8b" / "model.safetensors").exists()
    r = plan.Resident.of(model, None, plan.layout(spec, 8), "cuda")
    rotary = 2 * 4 * (4096 // 32 // 2)  # inv_freq and its original copy: fp32 buffers, whole on every rank
    assert r.weights == math.ceil(8_030_261_248 * 4 / 8) + rotary


def test_a_diffusion_gemma_checkpoint_is_planned_from_its_config(tmp_path):
    """block_diffusion's default model from a checkpoint folder holding config.json alone: the plan's module has the
    real module's parameters, and under FSDP2 its working set is all of them (one root unit: `shard_fsdp2`). A
    causal LM's folder is one error naming the shape that takes it."""
    from strategies.block_diffusion.gemma import DiffusionGemmaCanvas
    from strategies.models import tiny_diffusion_gemma_config

    config = tiny_diffusion_gemma_config(
        512, 128, 32, 3, 4, 2, None, num_experts=2, top_k_experts=1, moe_intermediate_size=None, canvas_length=8
    )
    config.save_pretrained(tmp_path / "dg")
    real = sum(p.numel() for p in DiffusionGemmaCanvas(config).parameters())
    raw = {
        "pipeline": {"strategies": ["block_diffusion"]},
        "model": {"kind": "pretrained", "path": str(tmp_path / "dg")},
        "train": {"global_batch_size": 4, "micro_batch_size": 2, "parallel": "fsdp2"},
        "dllm": {"mask_token_id": 511},
    }
    spec = validate_config(raw)
    model, _ = plan_step.Planner(spec, "block_diffusion").full_model()
    assert sum(p.numel() for p in model.parameters()) == real
    r = plan.Resident.of(model, None, plan.layout(spec, 2), "cuda")
    trained = [p for p in model.parameters() if p.requires_grad]
    assert r.working == plan_estimate._nbytes(model.parameters()) + plan_estimate._nbytes(trained)
    assert plan.plan_strategy(spec, "block_diffusion", plan.Cluster(2), variants=False).peak > r.working

    spec = validate_config({**raw, "model": {"kind": "pretrained", "path": str(ROOT / "configs/models/llama-3-8b")}})
    with pytest.raises(ConfigError, match="not a DiffusionGemma one: .* set dllm.architecture: stack"):
        plan_step.Planner(spec, "block_diffusion")


def test_a_hub_id_not_in_the_local_cache_is_one_clear_error():
    spec = validate_config({"model": {"kind": "pretrained", "path": "no-such-org/no-such-model"}})
    with pytest.raises(ConfigError, match="neither a local directory nor a hub id in the local cache"):
        plan.plan(spec, plan.Cluster(1))


def test_quantities_read_as_written():
    assert plan.quantity("80GB", "m", "b|bytes", "80GB") == 80e9
    assert plan.quantity("80 GiB", "m", "b|bytes", "80GB") == 80 * 2**30
    assert plan.quantity("989T", "f", "flop/s|flops", "989T") == 989e12
    assert plan.quantity("1.98e15", "f", "flop/s|flops", "989T") == 1.98e15
    with pytest.raises(ConfigError, match="--gpu-memory 'eighty' is not a positive amount; write it like 80GB"):
        plan.quantity("eighty", "--gpu-memory", "b|bytes", "80GB")


def _config_file(tmp_path, **train) -> str:
    raw = {
        "pipeline": {"name": "p", "strategies": ["mdlm", "idlm"]},
        "data": {"seq_len": 64},
        "tokenizer": {"vocab_size": 512},
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "device": "cpu", **train},
        "dllm": {"mask_token_id": 3},
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_plan_prints_every_strategy_for_a_cluster(tmp_path, capsys):
    cfg = _config_file(tmp_path)
    assert cli.main(["plan", cfg, "--gpus", "2", "--gpu-memory", "80GB", "--gpu-flops", "100T", "--mfu", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "2 × CUDA (80 GB each), DDP; global batch 8 = 2 ranks × 2 micro-batches × 2 rows" in out
    assert "time at 50% of 100 TFLOP/s per GPU" in out
    for name in ("mdlm", "idlm"):
        assert len([line for line in out.splitlines() if line.startswith(f"| {name} |")]) == 3  # memory, settings, time
    assert cli.main(["plan", cfg, "--gpus", "3"]) == 2
    assert "must be a multiple of 3 GPUs × train.micro_batch_size (2)" in capsys.readouterr().err


def test_run_warns_in_one_line_and_names_the_setting(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_run_pipeline", lambda args, **kwargs: {"run_id": "r", "report": "x"})
    monkeypatch.setattr(cli, "prefect_env", lambda workdir: None)  # its settings would outlive the test
    cfg = _config_file(tmp_path, activation_checkpointing=False, global_batch_size=2)  # one micro-batch: quick
    spec = load_config(cfg)
    needs = plan.plan_strategy(spec, "idlm", plan.Cluster(1, None), variants=False, sizing=False).peak
    changed = spec.model_copy(update={"train": spec.train.model_copy(update={"activation_checkpointing": True})})
    enough = plan.plan_strategy(changed, "idlm", plan.Cluster(1, None), variants=False, sizing=False).peak
    memory = ((needs + enough) / 2 + plan.CONTEXT_RESERVE) / (1 - plan.FRAGMENTATION)  # between the two
    t0 = time.perf_counter()
    assert cli.main(["run", cfg, "--workdir", str(tmp_path / "w"), "--gpu-memory", f"{memory:.0f}"]) == 0
    seconds = time.perf_counter() - t0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dllm-flow: warning:")]
    assert len(warnings) == 1, warnings  # mdlm fits, idlm (twice the sequence) does not
    assert warnings[0].startswith("dllm-flow: warning: train[idlm] needs about ")
    assert warnings[0].endswith(f"set train.activation_checkpointing: true (plan: {plan.size(enough)})")
    assert seconds < 60  # planning before a run costs seconds, not minutes (2 shared cores)


def test_run_without_a_declared_gpu_plans_nothing_on_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_run_pipeline", lambda args, **kwargs: {"run_id": "r", "report": "x"})
    monkeypatch.setattr(cli, "prefect_env", lambda workdir: None)  # its settings would outlive the test
    monkeypatch.delenv(cli.GPU_MEMORY_ENV, raising=False)

    def planned(*args):
        raise AssertionError("a CPU training with no GPU declared must not be planned")

    monkeypatch.setattr(plan, "fit_warnings", planned)
    assert cli.main(["run", _config_file(tmp_path), "--workdir", str(tmp_path / "w")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_the_environment_declares_the_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_run_pipeline", lambda args, **kwargs: {"run_id": "r", "report": "x"})
    monkeypatch.setattr(cli, "prefect_env", lambda workdir: None)  # its settings would outlive the test
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, "1GB")  # less than the CUDA context alone (1.61 GB): nothing fits
    cfg = _config_file(tmp_path, global_batch_size=2)  # one micro-batch: the settings tried are few and quick
    assert cli.main(["run", cfg, "--workdir", str(tmp_path / "w")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 2 and all("no single setting is enough" in line for line in warnings)


def test_fake_scalars_and_real_masks_in_the_trace():
    """Inside a traced step a real mask selects as many fake rows as it holds, and a fake scalar reads as 1."""
    tracer = plan_trace.Tracer()
    with tracer:
        hidden = torch.empty(2, 5, 8)
    mask = torch.tensor([[True, False, True, False, False], [False, False, False, True, True]])
    tracer.tracking = True
    try:
        with tracer:
            picked = hidden[mask]
            total = float(hidden.sum())
            counted = int(mask.sum())
    finally:
        tracer.tracking = False
    assert picked.shape == (4, 8) and total == 1.0 and counted == 4
