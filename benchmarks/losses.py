"""Forward + backward time and peak memory of every dLLM loss, ours next to the reference's, in one run.

Each (loss, implementation) pair runs in its own subprocess, so its peak resident memory is its own and one
implementation's allocator state never warms the other's. Both implementations get identical inputs (same
seed, same shapes, same masks). The baseline is plain `F.cross_entropy` over `[B, L, V]` logits: every
process times it alternately with its loss, so `×CE` is a ratio taken in one process (the machine's load at
that moment cancels), and `ours/ref` is the ratio of the two `×CE`. Times are the median of `--repeats` runs
after one warm-up, with `torch.set_num_threads(--threads)`. SCDD is measured chunked (1024 positions) and
unchunked; the rows `scdd_* ÷ mdlm` are SCDD's `×CE` over MDLM's.

The reference is NVIDIA NeMo Automodel's `components/loss/dllm_loss.py` (see benchmarks/reference_losses.py:
it is read from `--reference` — a wheel or an unpacked `nemo_automodel/` folder — or from an installed
`nemo_automodel` distribution, and loaded without running the package's `__init__`). Without it, only
ours is measured.

    python benchmarks/losses.py [--batch 8] [--seq 512] [--vocab 32000] [--repeats 3] [--threads 2]
                                [--reference nemo_automodel-0.7.0-py3-none-any.whl]
    python benchmarks/losses.py --check      # loss values and gradients, ours vs reference, at B=2 L=16 V=64
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import reference_losses

LOSSES = ["mdlm", "hybrid", "block_diffusion", "idlm", "scdd_chunked", "scdd_unchunked"]
CLASSES = ["MDLMCrossEntropyLoss", "HybridDiffusionLLMLoss", "BlockDiffusionCrossEntropyLoss", "IDLMLoss", "SCDDLoss"]


def _inputs(name: str, batch: int, seq: int, vocab: int, mask: str = "all") -> dict:
    """The inputs of one call, identical for ours and the reference (seeded). `mask="all"` supervises every
    position (the benchmark); `"prompt+pad"` leaves a 4-token prompt and a padded tail unsupervised."""
    import torch

    g = torch.Generator().manual_seed(0)
    length = 2 * seq if name == "idlm" else seq
    logits = torch.randn(batch, length, vocab, generator=g)
    target = torch.randint(0, vocab - 1, (batch, seq), generator=g)
    noise = torch.rand(batch, seq, generator=g) < 0.5
    swap = (torch.rand(batch, seq, generator=g) < 0.2) & ~noise  # SCDD's uniform channel: a wrong visible token
    p = torch.rand(batch, 1, generator=g).clamp_min(0.05).expand(batch, seq).contiguous()
    valid = torch.ones(batch, seq, dtype=torch.bool)
    loss_mask = torch.ones(batch, seq)
    if mask == "prompt+pad":
        valid[-1, -3:] = False
        loss_mask[:, :4] = 0
        loss_mask[~valid] = 0
    mask_id = vocab - 1
    noisy = torch.where(swap, torch.randint(0, vocab - 1, (batch, seq), generator=g), target)
    noisy = torch.where(noise, torch.full_like(target, mask_id), noisy)
    # the hybrid's separate causal-branch logits (only there: they are a second [B, L, V] tensor)
    causal = logits.roll(1, dims=1).requires_grad_(True) if name == "hybrid" else None
    return {
        "logits": logits.requires_grad_(True),
        "causal": causal,
        "target": target,
        "noise": noise,
        "p": p,
        "loss_mask": loss_mask,
        "valid": valid,
        "noisy": noisy,
        "mask_id": mask_id,
        "n": max(int(loss_mask.sum()), 1),
        "seq": seq,
    }


def _call(lib, name: str, x: dict):
    """One loss of `lib` (the `strategies` package or the reference's dllm_loss module) on inputs `x`. Ours take
    the logits, a `CorruptedBatch` and the `TokenCounts` (`strategies.base.DiffusionLoss`, `_call_ours`); the
    reference's take the tensors (keyword arguments after the first five)."""
    import torch.nn.functional as F

    logits, target, noise, p, lm = x["logits"], x["target"], x["noise"], x["p"], x["loss_mask"]
    n = x["n"]
    if name == "cross_entropy":
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    if name == "idlm":  # the same call in both (I-DLM's own, docs/strategies.md §5.6)
        # answer_mask = the supervised positions, valid_mask = the non-padding ones; p_mask etc. do not apply
        return lib.IDLMLoss()(logits, target, lm, x["valid"], seq_len=x["seq"], num_diffusion_tokens=n).total_loss
    if getattr(lib, "__name__", None) == "strategies":
        return _call_ours(lib, name, x)
    if name == "mdlm":
        return lib.MDLMCrossEntropyLoss()(logits, target, noise, p, lm, num_diffusion_tokens=n).total_loss
    if name == "hybrid":
        return lib.HybridDiffusionLLMLoss(alpha=0.3)(
            logits,
            target,
            noise,
            p,
            lm,
            loss_mask_ar=lm,
            num_diffusion_tokens=n,
            num_ar_tokens=n,
            causal_logits=x["causal"],
        ).total_loss
    if name == "block_diffusion":
        return lib.BlockDiffusionCrossEntropyLoss()(logits, target, noise, p, lm, num_diffusion_tokens=n).total_loss
    # SCDD: p_mask carries the diffusion time t (one per row), noisy_input_ids the corrupted z_t
    chunk = 1024 if name == "scdd_chunked" else None
    return lib.SCDDLoss(x["mask_id"], chunk_size=chunk)(
        logits, target, noise, p, lm, noisy_input_ids=x["noisy"], num_diffusion_tokens=n
    ).total_loss


def _call_ours(lib, name: str, x: dict):
    """`_call` for ours: the same inputs as one `CorruptedBatch` (SCDD reads its time t from `p_mask` and z_t from
    `noisy_ids`), the same denominators as `TokenCounts`."""
    from strategies.base import CorruptedBatch, TokenCounts

    logits, n = x["logits"], x["n"]
    batch = CorruptedBatch(x["target"], x["noisy"], x["noise"], x["p"], x["loss_mask"], x["valid"])
    if name == "mdlm":
        return lib.MDLMCrossEntropyLoss()(logits, batch, TokenCounts(diffusion=n)).total_loss
    if name == "hybrid":  # the AR term supervises batch.loss_mask, the reference's loss_mask_ar above
        return lib.HybridDiffusionLLMLoss(alpha=0.3)(
            logits, batch, TokenCounts(n, n), causal_logits=x["causal"]
        ).total_loss
    if name == "block_diffusion":
        return lib.BlockDiffusionCrossEntropyLoss()(logits, batch, TokenCounts(diffusion=n)).total_loss
    chunk = 1024 if name == "scdd_chunked" else None
    return lib.SCDDLoss(x["mask_id"], chunk_size=chunk)(logits, batch, TokenCounts(diffusion=n)).total_loss


def _library(impl: str, reference: str | None):
    if impl == "reference":
        return reference_losses.load(Path(reference))
    import strategies

    return strategies


def _rss_mib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _timed(lib, name: str, args) -> float:
    """Seconds of one forward + backward of `name` on fresh inputs (their creation is not timed)."""
    x = _inputs(name, args.batch, args.seq, args.vocab)
    t0 = time.perf_counter()
    _call(lib, name, x).backward()
    return time.perf_counter() - t0  # x and the graph go when this returns: one set of inputs alive at a time


def _child(args) -> None:
    """Time one loss of one implementation, alternating each run with plain CE over [B, L, V] logits in this
    same process (skipped for the CE row itself); the peak RSS is taken over the loss's runs only."""
    import torch

    torch.set_num_threads(args.threads)
    name = args.child
    lib = _library(args.impl, args.reference) if name != "cross_entropy" else None
    base = _rss_mib("VmRSS")  # after imports, before any input exists
    times, ce_times, peak = [], [], 0.0
    for _ in range(1 + args.repeats):  # the first is the warm-up
        if name != "cross_entropy":
            ce_times.append(_timed(None, "cross_entropy", args))
        reset = _reset_peak()  # so the CE run just before does not count in the loss's peak
        times.append(_timed(lib, name, args))
        hwm = _rss_mib("VmHWM") if reset else None
        # without the reset, the process's lifetime peak (which then includes the CE runs)
        peak = max(peak, hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    seconds = statistics.median(times[1:])
    ce_seconds = statistics.median(ce_times[1:]) if ce_times else seconds
    out = {
        "name": name,
        "impl": args.impl,
        "seconds": seconds,
        "ce_seconds": ce_seconds,
        "x_ce": seconds / ce_seconds,
        "runs": times[1:],
        "ce_runs": ce_times[1:],
        "peak_mib": peak,
        "base_mib": base if base is not None else 0.0,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(out))


def _run_child(args, name: str, impl: str, reference: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--impl", impl]
    for opt in ("batch", "seq", "vocab", "repeats", "threads"):
        cmd += [f"--{opt}", str(getattr(args, opt))]
    if reference is not None:
        cmd += ["--reference", str(reference)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{name} ({impl}) failed:\n{out.stderr[-4000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"  {name:<16} {impl:<9} {row['seconds']:.3f} s (runs {' '.join(f'{t:.3f}' for t in row['runs'])}), "
        f"CE here {row['ce_seconds']:.3f} s (runs {' '.join(f'{t:.3f}' for t in row['ce_runs'])}), "
        f"peak {row['peak_mib']:.0f} MiB",
        file=sys.stderr,
        flush=True,
    )
    return row


def _fmt(value: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def _table(args, rows: dict, ce: dict, ref_desc: str | None) -> None:
    print(
        f"B={args.batch} L={args.seq} V={args.vocab}  forward+backward, median of {args.repeats} after 1 warm-up, "
        f"{ce['threads']} threads, fp32 logits"
    )
    print(f"reference: {ref_desc}" if ref_desc else "reference: not measured")
    print(
        "×CE = the loss's median time / the median time of plain F.cross_entropy over [B, L, V] logits, run "
        "alternately with it in the same process;\nours/ref = ours ×CE / ref ×CE; "
        "peak = max RSS of that process during the loss's runs (includes its logits and their gradient); "
        "Δ = peak − the process's RSS after imports"
    )
    head = ["loss", "ours s", "ref s", "ours ×CE", "ref ×CE", "ours/ref", "ours peak", "ref peak", "ours Δ", "ref Δ"]
    widths = [22, 8, 8, 9, 9, 9, 10, 9, 8, 8]
    print("".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(zip(head, widths))))
    get = lambda row, key: None if row is None else row[key]  # noqa: E731
    delta = lambda row: None if row is None else row["peak_mib"] - row["base_mib"]  # noqa: E731
    ce_delta = ce["peak_mib"] - ce["base_mib"]
    print(
        f"{'cross_entropy':<22}{ce['seconds']:>8.3f}{'':>8}{1:>9.2f}{'':>27}{ce['peak_mib']:>10.0f}{'':>9}"
        f"{ce_delta:>8.0f}"
    )
    for name in LOSSES:
        o, r = rows.get((name, "ours")), rows.get((name, "reference"))
        ratio = None if o is None or r is None else o["x_ce"] / r["x_ce"]
        print(
            f"{name:<22}{_fmt(get(o, 'seconds'), '.3f', 8)}{_fmt(get(r, 'seconds'), '.3f', 8)}"
            f"{_fmt(get(o, 'x_ce'), '.2f', 9)}{_fmt(get(r, 'x_ce'), '.2f', 9)}{_fmt(ratio, '.2f', 9)}"
            f"{_fmt(get(o, 'peak_mib'), '.0f', 10)}{_fmt(get(r, 'peak_mib'), '.0f', 9)}"
            f"{_fmt(delta(o), '.0f', 8)}{_fmt(delta(r), '.0f', 8)}"
        )
    for scdd in ("scdd_chunked", "scdd_unchunked"):
        per = {}
        for impl in ("ours", "reference"):
            a, b = rows.get((scdd, impl)), rows.get(("mdlm", impl))
            per[impl] = None if a is None or b is None else a["x_ce"] / b["x_ce"]
        print(f"{scdd + ' ÷ mdlm':<22}{'':>16}{_fmt(per['ours'], '.2f', 9)}{_fmt(per['reference'], '.2f', 9)}")


def _benchmark(args, reference: Path | None, ref_desc: str | None) -> None:
    impls = ["ours"] + (["reference"] if reference is not None else [])
    ce = _run_child(args, "cross_entropy", "ours", None)
    rows = {}
    for name in LOSSES:  # interleaved, so slow drift of the machine hits both implementations alike
        for impl in impls:
            rows[(name, impl)] = _run_child(args, name, impl, reference)
    _table(args, rows, ce, ref_desc)


def _check(args, reference: Path | None) -> None:
    """Loss value and gradient of ours vs the reference on identical small inputs, for both mask layouts."""
    import torch

    torch.set_num_threads(args.threads)
    if reference is None:
        print("--check needs the reference")
        return
    ours, ref = _library("ours", None), _library("reference", str(reference))
    for cls in CLASSES:
        a = list(inspect.signature(getattr(ours, cls).forward).parameters)
        b = list(inspect.signature(getattr(ref, cls).forward).parameters)
        if a != b:
            print(f"signature {cls}.forward: ours {a[1:]} vs reference {b[1:]}")
    batch, seq, vocab = 2, 16, 64
    print(f"B={batch} L={seq} V={vocab}, fp32; |Δ| = |ours − reference|")
    print(f"{'loss':<16}{'mask':<12}{'ours':>14}{'reference':>14}{'|Δ loss|':>11}{'rel':>10}{'max|Δ grad|':>13}")
    for name in LOSSES:
        for mask in ("all", "prompt+pad"):
            values, grads = [], []
            for lib in (ours, ref):
                x = _inputs(name, batch, seq, vocab, mask)
                loss = _call(lib, name, x)
                loss.backward()
                values.append(loss.item())
                used = [t.grad.flatten() for t in (x["logits"], x["causal"]) if t is not None]
                grads.append(torch.cat(used))
            diff = abs(values[0] - values[1])
            gdiff = (grads[0] - grads[1]).abs().max().item()
            print(
                f"{name:<16}{mask:<12}{values[0]:>14.7g}{values[1]:>14.7g}{diff:>11.2e}"
                f"{diff / max(abs(values[1]), 1e-30):>10.1e}{gdiff:>13.2e}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--reference",
        default=None,
        help="a nemo_automodel wheel or unpacked package folder (default: the installed nemo_automodel, if any)",
    )
    ap.add_argument("--check", action="store_true", help="compare loss values and gradients with the reference")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="ours", choices=["ours", "reference"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    reference = reference_losses.locate(args.reference)
    ref_desc = None
    if reference is None:
        print(reference_losses.HOW_TO_GET)
    else:
        ref_desc = f"nemo_automodel {reference_losses.version(reference)} ({args.reference or reference})"
    try:
        if args.check:
            _check(args, reference)
        else:
            _benchmark(args, reference, ref_desc)
    finally:
        if reference is not None and args.reference and args.reference.endswith(".whl"):
            shutil.rmtree(reference.parent, ignore_errors=True)  # the wheel's files were extracted for this run


if __name__ == "__main__":
    main()
