"""How far a DFlash training's setup wanders: the project modules `train`'s `setup_run` enters for
`configs/dflash.yaml` (shortened), and how often control returns into a module it had left.

The upstream stages (prepare_data, pretrain_target, cache_target) run first at a tiny size; then `setup_run` runs
under `sys.setprofile`, which sees every call and return. The current module is that of the innermost frame of the
project (flows, tasks, strategies, dllm_common); a return that moves it to another module is a return to a module
already left (the stack holds it). Works on this tree and on older ones (`PYTHONPATH=<checkout> python
benchmarks/dflash_walk.py`), which is how issue 53's before/after was measured.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(sys.path[0]).resolve().parent if Path(sys.path[0]).name == "benchmarks" else Path.cwd()
PACKAGES = ("flows", "tasks", "strategies", "dllm_common")
SMALL = [
    "data.max_train_rows=256",
    "data.max_val_rows=64",
    "dflash.pretrain.steps=4",
    "dflash.regenerate=null",
    "train.steps=1",
    "train.warmup_steps=0",
    "dflash.pretrain.warmup_steps=0",
    "train.checkpoint_every=1000",
]


def _stage(*names: str):
    """The first of `names` ("module:function") this checkout has (stages moved between versions)."""
    for ref in names:
        module, _, attr = ref.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError:
            continue
    raise ImportError(f"none of {names}")


def _project(frame) -> str | None:
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.split(".")[0] in PACKAGES:
            return name
        frame = frame.f_back
    return None


def walk(fn, *args) -> tuple[Counter, int, int]:
    """(entries per module, module changes, returns into a module already left) while `fn(*args)` runs."""
    entered, state = Counter(), {"cur": None, "changes": 0, "returns": 0}

    def profile(frame, event, _arg):
        if event not in ("call", "return"):
            return
        new = _project(frame if event == "call" else frame.f_back)
        if new is None or new == state["cur"]:
            return
        state["changes"] += 1
        state["returns"] += event == "return"
        if event == "call":
            entered[new] += 1
        state["cur"] = new

    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return entered, state["changes"], state["returns"]


def main() -> None:
    from strategies.options import load_config
    from tasks.train import TrainJob, setup_run, stage_of
    from tasks.training.distributed import DistInfo

    prepare = _stage("tasks.prepare_data:prepare_data")
    target = _stage("tasks.speculative.target:target", "tasks.target:target")
    cache = _stage("tasks.speculative.cache_target:cache_target", "tasks.cache_target:cache_target")
    spec = load_config(str(ROOT / "configs" / "dflash.yaml"), SMALL)
    with tempfile.TemporaryDirectory() as wd:
        data = prepare(spec, wd)
        inputs = {"target": target(spec, data, wd)}
        inputs["features"] = cache(spec, inputs["target"], data, wd)
        key = stage_of(spec, "dflash", data, wd, inputs)[1]
        job = TrainJob(spec=spec, strategy="dflash", data=data, workdir=wd, parent_run_id=None, key=key, inputs=inputs)
        entered, changes, returns = walk(setup_run, job, DistInfo())
    print(
        f"setup_run of configs/dflash.yaml: {len(entered)} project modules entered, {changes} module changes, "
        f"{returns} returns into a module already left"
    )
    for name, count in entered.most_common():
        print(f"  {count:5d}  {name}")


if __name__ == "__main__":
    main()
