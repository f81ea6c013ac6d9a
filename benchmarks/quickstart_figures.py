"""The quickstart's documented figures, measured: runs `dllm-flow run configs/quickstart.yaml` in a fresh workdir
(or reads one that ran) and writes docs/results/quickstart.json — steps, wall time per stage, the fixed-noise
val/loss first → last, eval/nelbo, and the samples' gen_ppl and entropy beside the data row's. The README quotes
these numbers and tests/unit/test_docs.py holds them to this file and the file to configs/quickstart.yaml and to the
code (the stage keys it records, `stage_keys`), so the README says what a newcomer's run prints.

    .venv/bin/python benchmarks/quickstart_figures.py              # run the quickstart, write the JSON
    .venv/bin/python benchmarks/quickstart_figures.py --workdir W  # a workdir that ran it already (no timing of
                                                                   # the whole run: the stages' own seconds)
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "configs" / "quickstart.yaml"
OUT = ROOT / "docs" / "results" / "quickstart.json"


def config_digest(path: Path = CONFIG) -> str:
    """sha256 of the validated quickstart config: a changed config (steps, model, data, eval) needs new figures."""
    from dllm_common.config import canonical_json
    from strategies.options import load_config

    spec = load_config(str(path))
    return hashlib.sha256(canonical_json(spec.model_dump(mode="json")).encode()).hexdigest()[:16]


def stage_keys(path: Path = CONFIG) -> dict[str, str]:
    """The quickstart's stage keys as today's code computes them, without running anything: prepare_data's and
    train's whole keys, and evaluate's less the checkpoint's digest (`tasks.evaluate.code_key`). Each key covers
    the stage's config slice and every module it runs (docs/architecture.md, "Stage keys"), so the figures are
    pinned to the code that produced them: a change anywhere on the quickstart's path changes a key."""
    from types import SimpleNamespace

    from strategies.options import load_config
    from tasks.evaluate import code_key
    from tasks.prepare_data import stage_of as data_stage
    from tasks.train import stage_of as train_stage

    spec = load_config(str(path))
    [strategy] = spec.pipeline.strategies
    _, data = data_stage(spec, workdir="")
    _, train = train_stage(spec, strategy, SimpleNamespace(key=data), "")
    return {
        "prepare_data": data,
        f"train[{strategy}]": train,
        f"evaluate[{strategy}] (less the checkpoint digest)": code_key(spec, strategy, train, data),
    }


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def figures(workdir: Path, wall_seconds: float | None) -> dict:
    from mlflow.tracking import MlflowClient

    from dllm_common.tracking import default_tracking_uri
    from strategies.options import load_config

    spec = load_config(str(CONFIG))
    record = json.loads(sorted((workdir / "runs").glob("*.json"))[-1].read_text())
    stages = {s["name"]: round(s["seconds"], 1) for s in record["stages"] if s.get("seconds") is not None}
    statuses = {s["name"]: s["status"] for s in record["stages"]}
    if set(statuses.values()) != {"COMPLETED"}:
        raise SystemExit(f"{workdir}: the last run reused stages {statuses}; measure a fresh workdir")
    from tasks.common import StageRef
    from tasks.evaluate import stage_of as evaluate_stage

    keys = stage_keys()
    published = {p.parent.name for p in (workdir / "store").glob("*/*/manifest.json")}
    data_key, train_key = list(keys.values())[:2]
    refs = {
        s: StageRef(s, k, str(workdir / "store" / s / k)) for s, k in (("prepare_data", data_key), ("train", train_key))
    }
    wanted = dict(zip(list(keys)[:2], (data_key, train_key), strict=True))
    if train_key in published:  # the evaluation's whole key: its checkpoint's digest too
        [strategy] = spec.pipeline.strategies
        _, wanted[f"evaluate[{strategy}]"] = evaluate_stage(spec, strategy, refs["train"], refs["prepare_data"], "")
    stale = [stage for stage, key in wanted.items() if key not in published]
    if stale:
        raise SystemExit(f"{workdir}: {stale} ran with other code or config than this checkout's; measure it again")
    train = json.loads(next((workdir / "store" / "train").glob("*/manifest.json")).read_text())
    evaluated = json.loads(next((workdir / "store" / "evaluate").glob("*/manifest.json")).read_text())
    metrics = evaluated["info"]["metrics"]
    client = MlflowClient(default_tracking_uri(workdir))
    history = sorted(client.get_metric_history(train["info"]["mlflow_run_id"], "val/loss"), key=lambda m: m.step)
    return {
        "measured_on": datetime.date.today().isoformat(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "machine": {"cpus": os.cpu_count(), "cpu": _cpu()},
        "config": "configs/quickstart.yaml",
        "config_digest": config_digest(),
        "stage_keys": keys,
        "steps": spec.train.steps,
        "wall_seconds": None if wall_seconds is None else round(wall_seconds, 1),
        "stage_seconds": stages,
        "val_loss": {
            "first_step": history[0].step,
            "first": round(history[0].value, 3),
            "last_step": history[-1].step,
            "last": round(history[-1].value, 3),
        },
        "eval": {
            "nelbo": round(metrics["eval/nelbo"], 3),
            "gen_ppl": round(metrics["eval/gen_ppl"], 1),
            "entropy": round(metrics["eval/entropy"], 2),
            "data_gen_ppl": round(metrics["eval/data_gen_ppl"], 1),
            "data_entropy": round(metrics["eval/data_entropy"], 2),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="a workdir the quickstart ran in (default: run it now)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    wall = None
    workdir = args.workdir
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="quickstart-figures-"))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "flows.cli", "run", str(CONFIG), "--workdir", str(workdir)]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        wall = time.perf_counter() - started
    out = figures(workdir, wall)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(args.out)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
