"""`benchmarks/step_cost.py --json FILE`: what the run measured, the file `dllm-flow plan --step-cost FILE` reads
(`tasks.commands.plan.measured`, docs/planning.md "Measured step costs").

Per strategy: its step ÷ the causal-LM step (`measured`), the same ratio of the planner's FLOPs count
(`flops_ratio`) and `measured_over_flops`, the factor the plan multiplies its FLOPs-based time by; beside them the
device, dtype, torch version, model shape and date of the run, and the strategies whose measurement failed. The
file is written whole or not at all (a temporary file beside it, then `os.replace`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

from tasks.commands.plan.measured import FORMAT, VERSION

SHAPE = ("hidden", "layers", "heads", "seq", "batch", "vocab", "draft_layers", "attn")


def document(results: dict, failures: dict | None = None, **meta) -> dict:
    """The file's content: `results` as `step_cost.measure` (+ the FLOPs counts) returns them per strategy — its
    `ratio`, `flops`, `causal_flops`, and `strategy` / `causal` milliseconds — and `meta`: device, device_name, dtype,
    torch, date, model, clock (torch and date default to this process's version and now)."""
    strategies = {}
    for name, r in results.items():
        if "flops" not in r or "causal_flops" not in r:
            raise ValueError(f"{name}: no FLOPs count (--no-flops): measured ÷ FLOPs is what the file is for")
        flops_ratio = r["flops"] / r["causal_flops"]
        strategies[name] = {
            "measured": r["ratio"],
            "flops_ratio": flops_ratio,
            "measured_over_flops": r["ratio"] / flops_ratio,
            "step_ms": r.get("strategy"),
            "causal_ms": r.get("causal"),
        }
    return {
        "format": FORMAT,
        "version": VERSION,
        "date": meta.get("date") or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": meta["device"],
        "device_name": meta.get("device_name") or meta["device"],
        "dtype": meta["dtype"],
        "torch": meta.get("torch") or torch.__version__,
        "model": dict(meta.get("model") or {}),
        "clock": meta.get("clock", "wall"),
        "strategies": strategies,
        "failed": dict(failures or {}),
    }


def write_json(path: str | Path, results: dict, failures: dict | None = None, **meta) -> Path:
    """Write `document(results, failures, **meta)` to `path` atomically; returns the path."""
    path = Path(path)
    text = json.dumps(document(results, failures, **meta), indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_run(path: str | Path, results: dict, failures: dict, args) -> Path:
    """`write_json` with what `step_cost.py`'s arguments and this machine say of the run."""
    cuda = args.device == "cuda"
    model = {flag: getattr(args, flag) for flag in SHAPE}
    model.update(fused_head=not args.no_fused_head, compile=args.compile)
    return write_json(
        path,
        results,
        failures,
        device=args.device,
        device_name=torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine() or "cpu"),
        dtype=args.dtype,
        model=model,
        clock=args.clock,
    )
