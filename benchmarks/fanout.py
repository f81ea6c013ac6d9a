"""Fan-out (`pipeline.max_parallel`, issue 13): the wall time of two strategies trained one after another
against the same two trained at once in two slots of one thread each, in the same run.

    python benchmarks/fanout.py [--steps 600 --strategies mdlm,scdd --repeats 1]

Both modes run `dllm-flow run configs/smoke.yaml` with the given strategies and `train.steps`, each in a
fresh workdir (nothing reused) against one Prefect server started first and not timed:

  sequential  pipeline.max_parallel=1: each training in the flow's process, one after the other
  concurrent  pipeline.max_parallel=2: each training in its own child process, both at once

Every process runs with one thread (OMP_NUM_THREADS=1 and train.threads=1), so a concurrent run uses two
cores where the sequential one uses one. Reported per mode: the CLI's wall time, and the train span, from
the first `train[...]: started` to the last `train[...]: ran` line of the run's log. The ideal speedup of
the span is sum ÷ max of the sequential trainings' own times (the longest training bounds the concurrent
span). Both modes must publish the same weights and evaluation numbers: the script says whether they do.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from dllm_common.tracking import TELEMETRY_OFF
from flows.local_api import local_prefect_api
from tasks.common import published_results

ROOT = Path(__file__).resolve().parents[1]
QUIET = {**TELEMETRY_OFF, "HF_HUB_OFFLINE": "1"}  # no telemetry, no hub
MODES = {"sequential": 1, "concurrent": 2}  # mode: pipeline.max_parallel
# a stage's start and end lines in the run's log file (flows/pipeline.py StageRunner, flows/environment.py format)
STAGE_LINE = re.compile(r"^(\S+ \S+) INFO prefect\.flow_runs: (train\[[^\]]+\]): (started|ran )")


def train_windows(workdir: Path) -> dict[str, tuple[datetime, datetime]]:
    """Each training's (start, end) as the run's log file timestamps them."""
    starts, ends = {}, {}
    (log,) = (workdir / "logs").glob("*.log")
    for line in log.read_text().splitlines():
        match = STAGE_LINE.match(line)
        if match:
            stamp = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f")
            (starts if match[3] == "started" else ends)[match[2]] = stamp
    return {name: (starts[name], ends[name]) for name in starts}


def measure(workdir: Path, api: str, strategies: str, steps: int, max_parallel: int) -> dict:
    """One `dllm-flow run` in `workdir`: its wall time, its trainings' windows and what it published."""
    overrides = [f"pipeline.strategies=[{strategies}]", f"pipeline.max_parallel={max_parallel}"]
    overrides += [f"train.steps={steps}", "train.threads=1"]
    cmd = [sys.executable, "-m", "flows.cli", "run", "configs/smoke.yaml", "--workdir", str(workdir)]
    for override in overrides:
        cmd += ["--set", override]
    env = {**os.environ, **QUIET, "PREFECT_API_URL": api, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    windows = train_windows(workdir)
    span = max(end for _, end in windows.values()) - min(start for start, _ in windows.values())
    trains = {name: (end - start).total_seconds() for name, (start, end) in windows.items()}
    return {"wall": wall, "span": span.total_seconds(), "trains": trains, "outcomes": published_results(workdir)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600, help="train.steps of each strategy")
    ap.add_argument("--strategies", default="mdlm,scdd", help="comma-separated; two fill the two slots")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each mode; the best of each is reported")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="fanout-bench-") as tmp:
        os.environ.setdefault("PREFECT_HOME", str(Path(tmp) / "prefect"))
        # one detached local API both modes talk to (the one `dllm-flow run` boots for itself), so neither
        # pays for booting a temporary API inside its timed run; a configured PREFECT_API_URL is used as is
        with local_prefect_api() as local:
            api = local or os.environ["PREFECT_API_URL"]
            for r in range(args.repeats):
                # alternate which mode goes first, so neither always meets the colder caches
                order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    workdir = Path(tmp) / f"{mode}{r}"
                    runs[mode].append(measure(workdir, api, args.strategies, args.steps, MODES[mode]))
                    print(f"{mode} run {r + 1}: {runs[mode][-1]['wall']:.1f} s", flush=True)
    best = {mode: {key: min(run[key] for run in done) for key in ("wall", "span")} for mode, done in runs.items()}
    seq, conc = best["sequential"], best["concurrent"]
    # each mode's trainings as its best run timed them: how much a training slows beside another
    trains = {mode: min(done, key=lambda run: run["span"])["trains"] for mode, done in runs.items()}
    print(f"\n{args.strategies} × {args.steps} steps (configs/smoke.yaml), one thread each, best of {args.repeats}")
    print("| mode | pipeline wall (s) | train span (s) |")
    print("|---|---|---|")
    for mode, row in best.items():
        print(f"| {mode} (max_parallel={MODES[mode]}) | {row['wall']:.1f} | {row['span']:.1f} |")
    print(f"| concurrent ÷ sequential | {conc['wall'] / seq['wall']:.2f} | {conc['span'] / seq['span']:.2f} |")
    print(f"| speedup: sequential ÷ concurrent | {seq['wall'] / conc['wall']:.2f} | {seq['span'] / conc['span']:.2f} |")
    for mode, times in trains.items():
        print(f"{mode} trainings: " + ", ".join(f"{name} {s:.1f} s" for name, s in sorted(times.items())))
    alone = trains["sequential"].values()
    print(f"ideal train-span speedup with two slots (sum ÷ max of sequential): {sum(alone) / max(alone):.2f}")
    published = [run["outcomes"] for done in runs.values() for run in done]
    same = all(o == published[0] for o in published) and len(published[0]) == len(args.strategies.split(","))
    print(f"same weights sha256 and eval metrics in every run: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
