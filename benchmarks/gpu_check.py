"""The GPU check: what the CPU suite cannot prove, in one command on a machine with CUDA GPUs.

    python benchmarks/gpu_check.py            # everything, ~5 min on one H100-class GPU
    python benchmarks/gpu_check.py --cpu-smoke  # the same code paths, tiny and on CPU (flex parts skipped)

1. **flex attention vs dense masks**: the I-DLM and DFlash flex-attention training paths against their dense
   (SDPA) equivalents, forward and backward (the `gpu`-marked tests, which skip on CPU).
2. **bf16 training of every strategy**: 6 steps of mdlm, scdd, hybrid, idlm and block_diffusion through the
   train stage with `train.precision: bf16` on `cuda`, and the DFlash pipeline (target, feature cache, draft);
   each loss must be finite and the result published.
3. **FSDP2 + sharded checkpoints on the visible GPUs**: mdlm trained on every GPU with FSDP2, killed after its
   step-2 checkpoint, resumed on one GPU (DCP reshards) and finished; the loss curve must match an undisturbed
   one-GPU run within bf16 noise.
4. **Throughput and the plan**: tokens/s and model FLOPs utilization (6 · parameters · tokens/s ÷ the GPU's bf16
   peak) per strategy on a ~1B-parameter llama built from config, sequence 1024; beside each, what `dllm-flow plan`
   predicts for the same step (`tasks.commands.plan`): its peak memory against the measured one (`max_memory_allocated`;
   on CPU the allocator's own events, benchmarks/plan_memory.py) and the utilization of the plan's counted FLOPs
   that the measured tokens/s imply, the number to give `dllm-flow plan --mfu` on this GPU (docs/planning.md).
Exits non-zero if any check fails. Nothing is downloaded (the embedded Shakespeare corpus, models from config).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

STRATEGIES = ("mdlm", "scdd", "hybrid", "idlm", "block_diffusion")
# dense bf16 peak TFLOP/s by device name (no sparsity); --peak-tflops overrides
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, "4090": 165.0}
PLAN_BAND = 0.15
FLEX_TESTS = [
    "tests/unit/test_masks.py::test_idlm_flex_attention_matches_sdpa_on_gpu",
    "tests/unit/dflash/test_dflash_strategy.py::test_flex_block_mask_trains_like_the_dense_mask_on_gpu",
]


class Report:
    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []

    def add(self, check: str, ok: bool | None, detail: str) -> None:
        status = {True: "ok", False: "FAILED", None: "skipped"}[ok]
        self.rows.append((check, status, detail))
        print(f"[gpu_check] {check}: {status} — {detail}", flush=True)

    @property
    def failed(self) -> bool:
        return any(status == "FAILED" for _, status, _ in self.rows)


def base_spec(device: str, smoke: bool, **train) -> dict:
    return {
        "pipeline": {"name": "gpu-check", "strategies": list(STRATEGIES)},
        "data": {"seq_len": 64 if smoke else 256, "max_documents": 8, "max_train_rows": 512, "max_val_rows": 32},
        "tokenizer": {"vocab_size": 512 if smoke else 2048},
        "model": {"hidden_size": 64 if smoke else 256, "num_layers": 2, "num_heads": 4},
        "train": {
            "steps": 6,
            "warmup_steps": 2,
            "global_batch_size": 8,
            "micro_batch_size": 8,
            "val_every": 3,
            "log_every": 1,
            "checkpoint_every": 2,
            "device": device,
            "precision": "bf16",
            **train,
        },
        "tracking": {"experiment": "gpu-check"},
    }


def check_flex(report: Report, device: str) -> None:
    if device != "cuda":
        report.add("flex attention vs dense masks", None, "needs CUDA (flex attention has no CPU backward)")
        return
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", *FLEX_TESTS], cwd=ROOT, capture_output=True, text=True
    )
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]
    report.add("flex attention vs dense masks", out.returncode == 0 and "skipped" not in last, last)


def check_bf16(report: Report, device: str, smoke: bool, work: Path) -> None:
    from strategies.options import validate_config
    from tasks.prepare_data import prepare_data
    from tasks.train import train

    spec = validate_config(base_spec(device, smoke))
    data = prepare_data(spec, str(work))
    for name in STRATEGIES:
        t0 = time.time()
        try:
            ref = train(spec, name, data, str(work))
            losses = _losses(work, ref.mlflow_run_id)
            ok = len(losses) == 6 and all(math.isfinite(x) for x in losses)
            report.add(
                f"bf16 training: {name}", ok, f"losses {losses[0]:.3f} → {losses[-1]:.3f} in {time.time() - t0:.0f} s"
            )
        except Exception as exc:  # one strategy failing must not hide the others
            report.add(f"bf16 training: {name}", False, f"{type(exc).__name__}: {str(exc)[:300]}")
    cmd = [sys.executable, "-m", "flows.cli", "run", "configs/dflash.yaml", "--workdir", str(work / "dflash")]
    sets = {"train.steps": 6, "train.warmup_steps": 2, "train.precision": "bf16", "train.device": device}
    sets.update({"dflash.pretrain.steps": 20, "dflash.pretrain.warmup_steps": 5})
    sets.update({"dflash.regenerate.max_rows": 64, "data.max_train_rows": 512, "eval.num_samples": 1})
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    detail = (
        out.stderr.strip().splitlines()[-1][:300]
        if out.returncode
        else f"pipeline completed in {time.time() - t0:.0f} s"
    )
    report.add("bf16 training: dflash (target, cache, draft, speculative eval)", out.returncode == 0, detail)


def _losses(workdir: Path, run_id: str) -> list[float]:
    from mlflow.tracking import MlflowClient

    from dllm_common.tracking import default_tracking_uri

    client = MlflowClient(default_tracking_uri(workdir))
    return [m.value for m in sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)]


def check_fsdp2(report: Report, device: str, smoke: bool, work: Path, gpus: int) -> None:
    """Killed after the step-2 checkpoint on every GPU (FSDP2), resumed on one; vs an undisturbed one-GPU run."""
    from strategies.options import validate_config
    from tasks.prepare_data import prepare_data
    from tasks.train import train

    nproc = gpus if device == "cuda" else 2
    if nproc < 2:
        report.add("FSDP2 + sharded checkpoint", None, "one GPU: nothing to shard over")
        return
    one = validate_config(base_spec(device, smoke, precision="fp32"))
    many = validate_config(
        base_spec(
            device,
            smoke,
            precision="fp32",
            nproc_per_node=nproc,
            parallel="fsdp2",
            global_batch_size=8 * nproc,
            micro_batch_size=8,
        )
    )
    one = validate_config(
        {**one.model_dump(mode="json"), "train": {**one.train.model_dump(mode="json"), "global_batch_size": 8 * nproc}}
    )
    data = prepare_data(one, str(work / "fsdp"))
    ref = train(one, "mdlm", data, str(work / "fsdp-one"))
    os.environ["DLLM_FLOW_FAULT"] = "train.step=kill@4"
    try:
        train(many, "mdlm", data, str(work / "fsdp"))
        killed = False
    except RuntimeError:
        killed = True
    finally:
        del os.environ["DLLM_FLOW_FAULT"]
    resumed = train(one, "mdlm", data, str(work / "fsdp"))
    a, b = _losses(work / "fsdp-one", ref.mlflow_run_id), _losses(work / "fsdp", resumed.mlflow_run_id)
    diff = max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")
    ok = killed and len(b) == 6 and diff < 1e-3
    report.add("FSDP2 + sharded checkpoint", ok, f"{nproc} processes → 1, max per-step loss difference {diff:.1e}")


def throughput(report: Report, device: str, smoke: bool, work: Path, peak: float | None) -> list[tuple]:
    """Timed train steps of each strategy on a ~1B llama (hidden 2048, 16 layers) at sequence 1024, each beside
    its plan: the predicted peak memory and FLOPs per token, and the measured peak memory of step 4."""
    import torch

    from strategies.options import validate_config
    from tasks.commands.plan import Cluster, plan_strategy
    from tasks.prepare_data import prepare_data
    from tasks.training.loop import LoopRun, LoopSettings
    from tasks.training.runtime import OptimSettings, Split, make_optimizer
    from tasks.training.trainee import build_trainee

    shape = (
        {"hidden_size": 2048, "num_layers": 16, "num_heads": 16}
        if not smoke
        else {"hidden_size": 64, "num_layers": 5, "num_heads": 4}
    )
    seq, batch = (1024, 8) if not smoke else (64, 4)
    raw = base_spec(device, smoke, global_batch_size=batch, micro_batch_size=batch)
    raw["model"], raw["data"]["seq_len"] = shape, seq
    raw["data"].pop("max_documents")
    spec = validate_config(raw)
    data = prepare_data(spec, str(work / "throughput"))
    # the planner sizes the tokenizer the data stage trained (its vocabulary can come out below tokenizer.vocab_size)
    planned = validate_config({**raw, "tokenizer": {"kind": "pretrained", "path": str(Path(data.path) / "tokenizer")}})
    cluster = Cluster(1, None, peak * 1e12 if peak else None, device=device)
    rows = []
    for name in STRATEGIES:
        predicted = plan_strategy(planned, name, cluster, variants=False, sizing=False)
        trainee = build_trainee(spec, name, data, device)
        params = sum(p.numel() for p in trainee.model.parameters())
        opt, sched = make_optimizer(trainee.model, OptimSettings.of(spec.train))
        split = Split.open(data.path, "train")
        run = LoopRun(
            trainee=trainee, stepper=trainee.model, opt=opt, sched=sched, train=split, val=split, device=device
        )
        times, measured = _timed_steps(run, LoopSettings.of(spec.train, name), split, batch, device)
        tps = batch * seq / (sum(times[3:]) / len(times[3:]))  # after 3 warm-up steps
        mfu = 6 * params * tps / (peak * 1e12) if peak else float("nan")
        used = tps * predicted.flops_per_token / (peak * 1e12) if peak else float("nan")
        rows.append((name, params, tps, mfu, predicted.peak, measured, used, predicted.tokens_per_second))
        del trainee, opt, run
        if device == "cuda":
            torch.cuda.empty_cache()
    # the band docs/planning.md states for the plan's peak memory; outside it the plan misleads a user
    outside = [f"{r[0]} {r[4] / r[5]:.2f}" for r in rows if abs(r[4] / r[5] - 1) > PLAN_BAND]
    detail = f"{len(rows)} strategies timed; plan ÷ measured peak memory " + (
        f"outside ±{PLAN_BAND:.0%}: {', '.join(outside)}" if outside else f"within ±{PLAN_BAND:.0%}"
    )
    report.add("throughput and plan", not outside, detail)
    return rows


def _timed_steps(run, settings, split, batch: int, device: str) -> tuple[list[float], int | None]:
    """Seven timed train steps and, apart from them, step 4's peak memory (AdamW's moments exist since step 0:
    a steady step)."""
    import torch

    from tasks.training.distributed import DistInfo
    from tasks.training.loop import step_context, train_step

    times, measured, trainee = [], None, run.trainee
    for step in range(8):
        ctx = step_context(trainee, step, 0, trainee.model, DistInfo(), 1)
        mbs = split.microbatches(torch.arange(batch) + step * batch, batch, device)
        if step == 4:
            measured = _step_memory(device, trainee, run.opt, partial(train_step, run, settings, ctx, mbs))
            continue
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(run, settings, ctx, mbs)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, measured


def _step_memory(device: str, trainee, opt, step) -> int:
    """The most bytes allocated while `step` runs, what the training held before it included."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plan_memory import allocator_peak, held_bytes

    return held_bytes(trainee, opt) + allocator_peak(step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: the code paths, not the numbers")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by name)")
    args = ap.parse_args()
    import torch

    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; run it on a GPU machine (or --cpu-smoke for the code paths)")
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    name = torch.cuda.get_device_name(0) if gpus else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    print(
        f"[gpu_check] {name} × {gpus or 1}; bf16 peak {peak or 'unknown'} TFLOP/s; torch {torch.__version__}",
        flush=True,
    )
    report, t0 = Report(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        check_flex(report, device)
        check_bf16(report, device, args.cpu_smoke, work / "bf16")
        check_fsdp2(report, device, args.cpu_smoke, work, gpus)
        rows = throughput(report, device, args.cpu_smoke, work, peak)
    print("\n| check | result | detail |\n|---|---|---|")
    for check, status, detail in report.rows:
        print(f"| {check} | {status} | {detail} |")
    print(
        "\n| strategy | parameters | tokens/s | MFU | plan peak | measured peak | plan ÷ measured "
        "| counted-FLOPs utilization | plan tokens/s at 40 % |\n|---|---|---|---|---|---|---|---|---|"
    )
    for strategy, params, tps, mfu, planned, measured, used, plan_tps in rows:
        print(
            f"| {strategy} | {params / 1e9:.2f} B | {tps:,.0f} | {mfu:.1%} | {planned / 1e9:.2f} GB "
            f"| {measured / 1e9:.2f} GB | {planned / measured:.3f} | {used:.1%} | {plan_tps:,.0f} |"
        )
    print(f"\n[gpu_check] {time.time() - t0:.0f} s; {'FAILED' if report.failed else 'all checks passed'}")
    sys.exit(1 if report.failed else 0)


if __name__ == "__main__":
    main()
