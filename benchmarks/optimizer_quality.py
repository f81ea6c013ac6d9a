"""Did AdamW's fused kernel change what the quickstart learns, or only its trajectory? Trains configs/quickstart.yaml
at its full budget with the fused kernel (what training uses) and with the per-tensor loop it replaced, for each of
two seeds (`train.seed`), each in a fresh workdir through the pipeline's own stage functions, and prints the
fixed-noise val/loss at the last step, eval/nelbo and the samples' gen_ppl per run, then each optimizer's mean and the
fused − loop difference beside the spread between seeds. Both optimizers compute the same update; the fused kernel
rounds in another order, so a difference the size of the seed spread is trajectory, not quality.

    .venv/bin/python benchmarks/optimizer_quality.py                  # 2 seeds × 2 optimizers (~20 min on 2 cores)
    .venv/bin/python benchmarks/optimizer_quality.py --seeds 0 --steps 200   # a quick look
    .venv/bin/python benchmarks/optimizer_quality.py --seeds 0 --optimizers loop --set train.threads=1  # rounding
                                                                   # alone moved: the loop on one thread
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextmanager
def per_tensor_adamw():
    """`make_optimizer` with the per-tensor AdamW loop (fused=False, foreach=False): the optimizer before db845c8."""
    import torch

    from tasks.training import runtime

    fused_adamw = torch.optim.AdamW

    def loop_adamw(params, **kwargs):
        kwargs.update(fused=None, foreach=False)
        return fused_adamw(params, **kwargs)

    runtime.torch.optim.AdamW = loop_adamw
    try:
        yield
    finally:
        runtime.torch.optim.AdamW = fused_adamw


def one_run(spec, workdir: Path) -> dict:
    from mlflow.tracking import MlflowClient

    from dllm_common.tracking import default_tracking_uri
    from tasks.evaluate import evaluate
    from tasks.prepare_data import prepare_data
    from tasks.train import train

    data = prepare_data(spec, str(workdir))
    trained = train(spec, "mdlm", data, str(workdir))
    evaluated = evaluate(spec, "mdlm", trained, data, str(workdir))
    client = MlflowClient(default_tracking_uri(workdir))
    val = sorted(client.get_metric_history(trained.mlflow_run_id, "val/loss"), key=lambda m: m.step)
    m = evaluated.info["metrics"]
    return {"val_loss": val[-1].value, "nelbo": m["eval/nelbo"], "gen_ppl": m["eval/gen_ppl"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, help="train.steps (default: the quickstart's)")
    parser.add_argument("--optimizers", nargs="+", choices=["fused", "loop"], default=["fused", "loop"])
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE on the config, e.g. train.threads=1")
    parser.add_argument("--out", type=Path, help="write the runs as JSON here")
    args = parser.parse_args()
    from flows.environment import prefect_env

    root = Path(tempfile.mkdtemp(prefix="optimizer-quality-"))
    prefect_env(root)
    import torch

    from strategies.options import load_config

    torch.set_num_threads(2)
    runs = []
    for seed in args.seeds:
        overrides = [f"train.seed={seed}", *args.set] + ([f"train.steps={args.steps}"] if args.steps else [])
        spec = load_config(ROOT / "configs" / "quickstart.yaml", overrides)
        for optimizer in args.optimizers:
            workdir = root / f"{optimizer}-seed{seed}"
            if optimizer == "loop":
                with per_tensor_adamw():
                    row = one_run(spec, workdir)
            else:
                row = one_run(spec, workdir)
            runs.append({"optimizer": optimizer, "seed": seed, **row})
            print(json.dumps(runs[-1]), flush=True)
    print("\n| optimizer | seed | val/loss (last) | eval/nelbo | gen_ppl |\n|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['optimizer']} | {r['seed']} | {r['val_loss']:.3f} | {r['nelbo']:.3f} | {r['gen_ppl']:.1f} |")
    for metric in ("val_loss", "nelbo", "gen_ppl") if len(args.optimizers) == 2 else ():
        by = {o: [r[metric] for r in runs if r["optimizer"] == o] for o in ("fused", "loop")}
        means = {o: statistics.fmean(v) for o, v in by.items()}
        seed_spread = max(max(v) - min(v) for v in by.values())
        print(
            f"{metric}: fused {means['fused']:.3f}, loop {means['loop']:.3f}, fused − loop "
            f"{means['fused'] - means['loop']:+.3f}; largest spread between seeds of one optimizer {seed_spread:.3f}"
        )
    if args.out:
        args.out.write_text(json.dumps(runs, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
