"""Measured step costs for the plan's time column (`dllm-flow plan --step-cost FILE`, docs/planning.md).

`benchmarks/step_cost.py --json FILE` writes, per strategy, its training step ÷ the causal-LM step of the same
backbone (measured), the same ratio of the planner's FLOPs count, and measured ÷ FLOPs: how much more (or less) a
strategy's step costs than its counted FLOPs say, relative to the causal step. The plan's time is counted FLOPs ÷
(peak × utilization), the utilization being that of a causal-LM step; multiplied by measured ÷ FLOPs, each
strategy's time holds the overhead beyond its FLOPs that the user measured on their own hardware. A strategy the
file lacks keeps a ratio of 1, and the plan says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from dllm_common.config import ConfigError

FORMAT = "dllm-flow step-cost"  # the file's "format"; "version" VERSION (benchmarks/step_cost_json.py writes both)
VERSION = 1
DEVICES = ("cpu", "cuda")
FLAG = "--step-cost"


@dataclass(frozen=True)
class StepCost:
    """What one `step_cost.py --json` file says: measured ÷ FLOPs per strategy (`ratios`), the strategies whose
    measurement failed in that run (`failed`), and where it was measured."""

    path: str
    device: str  # "cpu" or "cuda"
    device_name: str
    dtype: str
    torch: str
    date: str
    model: dict = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def ratio(self, strategy: str) -> float:
        """measured ÷ FLOPs of `strategy`; 1 (its counted FLOPs) where the file has none."""
        return self.ratios.get(strategy, 1.0)

    def shape(self) -> str:
        """The measured model in a few words (`hidden 128, 4 layers, 8 × 128 tokens`)."""
        m = self.model
        parts = []
        if "hidden" in m and "layers" in m:
            parts.append(f"hidden {m['hidden']}, {m['layers']} layers")
        if "batch" in m and "seq" in m:
            parts.append(f"{m['batch']} × {m['seq']} tokens")
        return ", ".join(parts)


def _refuse(path: str, why: str) -> ConfigError:
    return ConfigError(
        f"{FLAG} {path}: {why}; write it with `python benchmarks/step_cost.py --device cuda --json {path}` on the "
        f"GPU you plan for, or leave out {FLAG} (each step is then assumed to cost its counted FLOPs)"
    )


def _text(doc: dict, key: str, path: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value:
        raise _refuse(path, f"its {key!r} is {value!r}, not a text")
    return value


def read_step_cost(path: str | Path) -> StepCost:
    """The file `benchmarks/step_cost.py --json` wrote; a missing, unreadable or malformed one is one clear error
    naming the flag and what to do."""
    path = str(path)
    try:
        raw = Path(path).read_text()
    except FileNotFoundError:
        raise _refuse(path, "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _refuse(path, f"cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _refuse(path, f"is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _refuse(path, f'is not a step-cost file (no "format": "{FORMAT}")')
    if doc.get("version") != VERSION:
        raise _refuse(path, f"is version {doc.get('version')!r} of the format; this dllm-flow reads {VERSION}")
    device = doc.get("device")
    if device not in DEVICES:
        raise _refuse(path, f"its 'device' is {device!r}, not one of {', '.join(DEVICES)}")
    strategies = doc.get("strategies")
    if not isinstance(strategies, dict):
        raise _refuse(path, "it has no 'strategies' object")
    ratios = {}
    for name, entry in strategies.items():
        value = entry.get("measured_over_flops") if isinstance(entry, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise _refuse(path, f"strategy {name!r} has no positive 'measured_over_flops' (it has {value!r})")
        ratios[name] = float(value)
    failed = doc.get("failed") or {}
    if not isinstance(failed, dict):
        raise _refuse(path, "its 'failed' is not an object of strategy → error")
    model = doc.get("model") or {}
    if not isinstance(model, dict):
        raise _refuse(path, "its 'model' is not an object")
    return StepCost(
        path=path,
        device=device,
        device_name=_text(doc, "device_name", path),
        dtype=_text(doc, "dtype", path),
        torch=_text(doc, "torch", path),
        date=_text(doc, "date", path),
        model=model,
        ratios=ratios,
        failed={str(k): str(v) for k, v in failed.items()},
    )


def step_cost_for(path: str | Path | None, device: str) -> StepCost | None:
    """The step costs of `path` for a plan of `device` ("cuda" or "cpu"); None without a file. A file measured on
    the other kind of device is refused: CPU overheads (Python per operation, element-wise work) say nothing of a
    GPU's, nor the reverse."""
    if path is None:
        return None
    cost = read_step_cost(path)
    if cost.device != device:
        raise ConfigError(
            f"{FLAG} {cost.path} was measured on {cost.device} ({cost.device_name}) and this plan is for "
            f"{device.upper() if device == 'cuda' else device} ranks: measure on the device you plan for "
            f"(`python benchmarks/step_cost.py --device {device} --json FILE`), or leave out {FLAG}"
        )
    return cost


_PRECISION = {"bf16": "bfloat16", "fp32": "float32"}


def header_lines(cost: StepCost | None, strategies: list[str], precision: str) -> list[str]:
    """The lines under the plan's utilization line that say what its time column assumes: each step at its counted
    FLOPs, or the measured ratios applied (which, from which file, measured where) and the strategies at 1."""
    if cost is None:
        return [
            "the time assumes each step costs exactly its counted FLOPs (no overhead beyond them): "
            "`python benchmarks/step_cost.py --device cuda --json FILE` measures each strategy's on your GPU, "
            f"`{FLAG} FILE` applies it"
        ]
    applied = [name for name in strategies if name in cost.ratios]
    assumed = [name for name in strategies if name not in cost.ratios]
    where = ", ".join(
        filter(None, [f"{cost.device} {cost.device_name}", cost.dtype, f"torch {cost.torch}", cost.shape(), cost.date])
    )
    lines = [
        "time × each strategy's measured step cost ÷ its counted FLOPs (a causal-LM step at that utilization "
        f"being 1), from {cost.path} ({where}): "
        + (", ".join(f"{name} × {cost.ratios[name]:.3g}" for name in applied) or "none of this config's strategies")
    ]
    if assumed:
        why = [f"{name} (its measurement failed there)" if name in cost.failed else name for name in assumed]
        lines.append(f"× 1 assumed (each step at its counted FLOPs) for those not in {cost.path}: {', '.join(why)}")
    trained = _PRECISION.get(precision, precision)
    if cost.dtype != trained:
        lines.append(f"measured in {cost.dtype}, while this config trains in {trained}: the ratios may differ")
    return lines
