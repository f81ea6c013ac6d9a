"""Training-step time with and without `train.compile` (regional torch.compile of the decoder layers), in one run.

Each mode runs in its own subprocess: it builds a small Llama-shaped model, runs `--warmup` steps (the
compiled mode compiles in them; its compile time is reported separately) and then times `--steps`
steps of `tasks.training.loop.run_step` on fixed-shape batches. Prints the median step time of each mode, the
ratio eager ÷ compiled (> 1: compile is faster), and the losses of both (they must agree).

    python benchmarks/compile.py [--strategy mdlm] [--hidden 256] [--layers 4] [--seq 256] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace


def _child(args) -> None:
    import torch

    from strategies import Microbatch, assemble_strategy, strategy_class
    from strategies.head import make_head_deferrable
    from strategies.models import build_model, tiny_model_config, wrap_for_architecture
    from tasks.training.distributed import DistInfo
    from tasks.training.loop import run_step, step_context
    from tasks.training.runtime import Trainee
    from tasks.training.trainee import compile_layers

    torch.set_num_threads(args.threads)
    vocab = args.vocab
    config = tiny_model_config("llama", vocab, args.seq, args.hidden, args.layers, 4, None, None, True)
    model = build_model(config, seed=0)
    tokenizer = SimpleNamespace(mask_token_id=vocab - 1, pad_token_id=0, eos_token_id=1)
    model = wrap_for_architecture(model, strategy_class(args.strategy).model_architecture, mask_token_id=vocab - 1)
    built = assemble_strategy(args.strategy, {"mask_token_id": vocab - 1}, model, tokenizer)
    fused = make_head_deferrable(model)
    if args.mode == "compiled":
        compile_layers(model)
    trainee = Trainee.assembled(model, tokenizer, built, "fp32", fused_head=fused)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab - 1, (args.batch, args.seq), generator=g)
    mbs = [Microbatch(ids, torch.ones_like(ids), torch.ones_like(ids))]
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        ctx = step_context(trainee, step, 0, model, DistInfo(), 1)
        t0 = time.perf_counter()
        loss, _, _ = run_step(trainee, ctx, mbs, is_train=True)
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    print(
        json.dumps(
            {"warmup_s": sum(times[: args.warmup]), "step_s": statistics.median(times[args.warmup :]), "losses": losses}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="mdlm")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        return _child(args)
    results = {}
    for mode in ("eager", "compiled"):
        cmd = [sys.executable, __file__, "--mode", mode] + [
            f"--{k}={getattr(args, k)}"
            for k in ("strategy", "hidden", "layers", "seq", "batch", "vocab", "warmup", "steps", "threads")
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode:
            raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    eager, comp = results["eager"], results["compiled"]
    drift = max(abs(a - b) for a, b in zip(eager["losses"], comp["losses"]))
    print(
        f"{args.strategy}: hidden {args.hidden}, {args.layers} layers, batch {args.batch} × {args.seq}, "
        f"{args.threads} threads"
    )
    print(f"eager     step {eager['step_s']:.3f} s   (first {args.warmup} steps {eager['warmup_s']:.1f} s)")
    print(f"compiled  step {comp['step_s']:.3f} s   (first {args.warmup} steps incl. compile {comp['warmup_s']:.1f} s)")
    print(f"speedup eager/compiled: {eager['step_s'] / comp['step_s']:.2f}x; max loss difference {drift:.1e}")


if __name__ == "__main__":
    main()
