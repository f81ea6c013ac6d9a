"""Peak memory and time of one training step per strategy, full logits vs the fused head, in one run.

Each (strategy, mode) runs in its own subprocess: it builds a small Llama-shaped model with a large
vocabulary (the LM head then dominates activation memory, as it does in real models), prepares the
batch, records its resident memory, runs one optimizer step's forward + backward (`tasks.training.loop.run_step`,
what training runs) and reports the peak resident memory above that point. "full" is
`train.fused_head: false` (the `[B, L, V]` logits built and kept for backward), "fused" is the default
(docs/strategies.md §5.9). Ratios are fused ÷ full from the same run.

    python benchmarks/train_memory.py [--seq 1024] [--vocab 49152] [--batch 2] [--hidden 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from types import SimpleNamespace

STRATEGIES = ["mdlm", "scdd", "hybrid", "idlm", "block_diffusion"]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _child(args) -> None:
    import torch

    from strategies import Microbatch, assemble_strategy, strategy_class
    from strategies.head import make_head_deferrable
    from strategies.models import build_model, tiny_model_config, wrap_for_architecture
    from tasks.training.distributed import DistInfo
    from tasks.training.loop import run_step, step_context
    from tasks.training.runtime import Trainee

    torch.set_num_threads(args.threads)
    vocab, mask_id = args.vocab, args.vocab - 1
    config = tiny_model_config(
        "llama", vocab, 2 * args.seq, args.hidden, args.layers, 4, None, None, tie_embeddings=True
    )
    lm = build_model(config, seed=0)
    tokenizer = SimpleNamespace(mask_token_id=mask_id, pad_token_id=0, eos_token_id=1)
    model = wrap_for_architecture(lm, strategy_class(args.child).model_architecture, mask_token_id=mask_id)
    built = assemble_strategy(args.child, {"mask_token_id": mask_id}, model, tokenizer)
    fused = args.mode == "fused" and make_head_deferrable(model)
    trainee = Trainee.assembled(model, tokenizer, built, "fp32", fused_head=fused)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab - 1, (args.batch, args.seq), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, : args.seq // 8] = 0  # a prompt, so prompt/response strategies have both
    mbs = [Microbatch(ids, loss_mask, torch.ones_like(ids))]
    ctx = step_context(trainee, 0, 0, model, DistInfo(), 1)
    before = _rss_mib()  # ru_maxrss is a lifetime peak: the measured step is the process's first
    t0 = time.perf_counter()
    loss, _, _ = run_step(trainee, ctx, mbs, is_train=True)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"loss": loss, "seconds": seconds, "step_mib": peak - before, "fused": bool(fused)}))


def _measure(name: str, mode: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--mode", mode]
    for key in ("seq", "vocab", "batch", "hidden", "layers", "threads"):
        cmd += [f"--{key}", str(getattr(args, key))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{name}/{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["full", "fused"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)

    logits_mib = args.batch * args.seq * args.vocab * 4 / 2**20
    print(
        f"B={args.batch} L={args.seq} V={args.vocab} hidden={args.hidden} layers={args.layers}; "
        f"one fp32 [B, L, V] logits tensor = {logits_mib:.0f} MiB; memory = peak RSS of the step above its start"
    )
    print(f"{'strategy':<16}{'full MiB':>10}{'fused MiB':>11}{'ratio':>7}{'full s':>8}{'fused s':>9}{'loss Δ':>10}")
    for name in args.strategies.split(","):
        full, fused = _measure(name, "full", args), _measure(name, "fused", args)
        assert fused["fused"] and not full["fused"], name
        print(
            f"{name:<16}{full['step_mib']:>10.0f}{fused['step_mib']:>11.0f}"
            f"{fused['step_mib'] / max(full['step_mib'], 1e-9):>7.2f}"
            f"{full['seconds']:>8.2f}{fused['seconds']:>9.2f}{abs(full['loss'] - fused['loss']):>10.1e}"
        )


if __name__ == "__main__":
    main()
