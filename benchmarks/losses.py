"""Forward + backward time and peak memory of every dLLM loss at a realistic shape, in one run.

Each loss runs in its own subprocess so its peak resident memory (ru_maxrss) is its own; the
baseline row is plain `F.cross_entropy` over the same logits, and every other row is reported as a
ratio to it. SCDD is measured chunked (1024 positions) and unchunked.

    python benchmarks/losses.py [--batch 8] [--seq 512] [--vocab 32000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

LOSSES = ["cross_entropy", "mdlm", "hybrid", "block_diffusion", "idlm", "scdd_chunked", "scdd_unchunked"]


def _inputs(name: str, batch: int, seq: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    length = 2 * seq if name == "idlm" else seq
    logits = torch.randn(batch, length, vocab, generator=g).requires_grad_(True)
    target = torch.randint(0, vocab - 1, (batch, seq), generator=g)
    noise = torch.rand(batch, seq, generator=g) < 0.5
    p = torch.rand(batch, 1, generator=g).clamp_min(0.05).expand(batch, seq).contiguous()
    loss_mask = torch.ones(batch, seq)
    return logits, target, noise, p, loss_mask


def _run_one(name: str, batch: int, seq: int, vocab: int) -> float:
    import torch
    import torch.nn.functional as F

    from strategies import (
        BlockDiffusionCrossEntropyLoss,
        HybridDiffusionLLMLoss,
        IDLMLoss,
        MDLMCrossEntropyLoss,
        SCDDLoss,
    )

    logits, target, noise, p, lm = _inputs(name, batch, seq, vocab)
    n = int(lm.sum())
    mask_id = vocab - 1
    noisy = torch.where(noise, torch.full_like(target, mask_id), target)
    t0 = time.perf_counter()
    if name == "cross_entropy":
        loss = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
    elif name == "mdlm":
        loss = MDLMCrossEntropyLoss()(logits, target, noise, p, lm, num_diffusion_tokens=n).total_loss
    elif name == "hybrid":
        causal = logits.detach().roll(1, dims=1).requires_grad_(True)
        loss = HybridDiffusionLLMLoss(0.3)(
            logits, target, noise, p, lm, loss_mask_ar=lm, num_diffusion_tokens=n, num_ar_tokens=n, causal_logits=causal
        ).total_loss
    elif name == "block_diffusion":
        loss = BlockDiffusionCrossEntropyLoss()(logits, target, noise, p, lm, num_diffusion_tokens=n).total_loss
    elif name == "idlm":
        loss = IDLMLoss()(logits, target, lm, lm, seq_len=seq, num_diffusion_tokens=n).total_loss
    else:
        chunk = 1024 if name == "scdd_chunked" else None
        loss = SCDDLoss(mask_id, chunk_size=chunk)(
            logits, target, noise, p, lm, noisy_input_ids=noisy, num_diffusion_tokens=n
        ).total_loss
    loss.backward()
    return time.perf_counter() - t0


def _child(args) -> None:
    import torch

    times = [_run_one(args.child, args.batch, args.seq, args.vocab) for _ in range(args.repeats)]
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {"name": args.child, "seconds": min(times), "peak_mib": peak_mib, "threads": torch.get_num_threads()}
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    rows = []
    for name in LOSSES:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                name,
                "--batch",
                str(args.batch),
                "--seq",
                str(args.seq),
                "--vocab",
                str(args.vocab),
                "--repeats",
                str(args.repeats),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(
        f"B={args.batch} L={args.seq} V={args.vocab}  forward+backward, best of {args.repeats}, "
        f"{base['threads']} threads; peak = process max RSS (includes the fp32 logits and their gradient)"
    )
    print(f"{'loss':<18}{'seconds':>10}{'× CE':>8}{'peak MiB':>11}{'× CE':>8}")
    for r in rows:
        print(
            f"{r['name']:<18}{r['seconds']:>10.3f}{r['seconds'] / base['seconds']:>8.2f}"
            f"{r['peak_mib']:>11.0f}{r['peak_mib'] / base['peak_mib']:>8.2f}"
        )


if __name__ == "__main__":
    main()
