"""Domino's fused loss during its base-anchor curriculum: one chunked pass for both losses against two, in one run.

While λ > 0 Domino's objective is `(1 − λ)·L(head + correction) + λ·L(head)` (docs/strategies.md §10.15). With
`use_fused_linear_ce` both go through checkpointed chunks of rows; the loss computes them in one pass
(`DFlashDecayLoss.forward_chunked` given both logits of a chunk: the head's `[rows, V]` matmul once per chunk,
forward and recompute) where it used to run two (`forward_chunked` for the corrected logits, then `forward_fused`
for the head's). Both are timed
alternately, forward + backward, on the same inputs, after checking they give the same loss and gradients; the
table prints the medians and new ÷ old.

    python benchmarks/domino_loss.py [--batch 16] [--predictions 12] [--hidden 576] [--vocab 49152] [--threads 1]

The defaults are configs/dflash-smollm2.yaml's: 16 rows, 4 blocks of 3 predictions, SmolLM2-135M's width and
vocabulary, Domino's default head (GRU 256, embedding 128).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from strategies.dflash.loss import DFlashDecayLoss

WEIGHT = 0.6  # λ early in the curriculum (any λ > 0 runs both losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--predictions", type=int, default=12, help="predicted positions per row (blocks × (bs − 1))")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--gru", type=int, default=256)
    ap.add_argument("--emb", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, t, h, v = args.batch, args.predictions, args.hidden, args.vocab
    head = nn.Linear(h, v, bias=False)
    proj = nn.Sequential(nn.Linear(h + args.gru, args.emb, bias=False), nn.SiLU(), nn.Linear(args.emb, v, bias=False))
    pred = torch.randn(b, t, h, requires_grad=True)
    states = torch.randn(b, t, args.gru)
    targets = torch.randint(0, v, (b, t))
    mask = torch.ones(b, t)
    loss = DFlashDecayLoss(7.0, use_fused_linear_ce=True)
    kw = {"num_tokens": b * t, "block_size": args.block_size}
    params = [pred, head.weight, *proj.parameters()]

    def correction(x, g):
        return proj(torch.cat([x, g], dim=-1))

    def two_passes():
        (out,) = loss.forward_chunked(lambda x, g: (head(x) + correction(x, g),), (pred, states), targets, mask, **kw)
        base = loss.forward_fused(pred, head.weight, targets, mask, **kw)
        return (1 - WEIGHT) * out.total_loss + WEIGHT * base.total_loss

    def one_pass():
        def both(x, g):
            base = head(x)
            return base + correction(x, g), base

        out, base = loss.forward_chunked(both, (pred, states), targets, mask, **kw)
        return (1 - WEIGHT) * out.total_loss + WEIGHT * base.total_loss

    old, new = two_passes(), one_pass()
    torch.testing.assert_close(new, old)
    for g_new, g_old in zip(torch.autograd.grad(new, params), torch.autograd.grad(old, params)):
        torch.testing.assert_close(g_new, g_old, rtol=1e-5, atol=1e-7)

    times: dict[str, list[float]] = {"two passes": [], "one pass": []}
    for i in range(args.repeats + 1):
        for name, fn in (("two passes", two_passes), ("one pass", one_pass)):
            start = time.perf_counter()
            fn().backward()
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"Domino loss, λ = {WEIGHT}: {b}×{t} predictions, hidden {h}, V {v}, {args.threads} thread(s)")
    for name, m in med.items():
        print(f"  {name:<11} {m * 1e3:8.1f} ms  (forward + backward, median of {args.repeats})")
    print(f"  one ÷ two   {med['one pass'] / med['two passes']:8.2f}")


if __name__ == "__main__":
    main()
