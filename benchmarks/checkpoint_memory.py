"""Peak resident memory of rank 0 while checkpointing a ~100M-parameter model with its AdamW state,
FSDP2 over 2 CPU processes (gloo): the previous path (full weights + optimizer state gathered onto rank 0,
which writes them) against the sharded one (`torch.distributed.checkpoint`: each rank writes its own
shards, `tasks/training/resume.py`). Both in the same run, printed as ratios to the full state's bytes.

    python benchmarks/checkpoint_memory.py [--hidden 768 --layers 12]

Goal (issue 13): sharded ≤ 0.6 × the full state's bytes on rank 0, against ≥ 1.0 for the gathered path.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class PeakRSS:
    """Samples this process's resident memory every 5 ms; `peak` is the largest, minus the baseline at start."""

    def __init__(self):
        import psutil

        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self.base = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss - self.base)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()


def release_freed_memory() -> None:
    """Hand memory freed earlier (activations, gradients) back to the OS, so a save's peak is its own."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def worker(hidden: int, layers: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from strategies.models import build_model, tiny_model_config
    from tasks.training.distributed import shard_fsdp2

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = build_model(tiny_model_config("llama", 8192, 128, hidden, layers, 12, None, None, True), seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    shard_fsdp2(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = model(input_ids=torch.randint(0, 8192, (1, 16))).logits.float().mean()
    loss.backward()
    opt.step()  # AdamW's two moments exist now
    opt.zero_grad(set_to_none=True)
    full_bytes = n_params * 4 * 3  # fp32 weights + exp_avg + exp_avg_sq
    results = {}
    # the previous path: everything gathered onto rank 0 (full_state_dict + cpu_offload), rank 0 writes it
    release_freed_memory()
    with PeakRSS() as gathered:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        optim = get_optimizer_state_dict(model, opt, options=options)
        if rank == 0:
            torch.save({"model": weights, "optim": optim}, out / "full.pt")
        del weights, optim
        dist.barrier()
    results["gathered"] = gathered.peak
    release_freed_memory()
    with PeakRSS() as sharded:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=str(out / "dcp"))
        del state
        dist.barrier()
    results["sharded"] = sharded.peak
    if rank == 0:
        mib = full_bytes / 2**20
        print(f"model: {n_params / 1e6:.1f}M parameters; full state (weights + AdamW moments): {mib:.0f} MiB")
        print("| path | rank-0 peak RSS while saving (MiB) | ÷ full state |")
        print("|---|---|---|")
        for name in ("gathered", "sharded"):
            print(f"| {name} | {results[name] / 2**20:.0f} | {results[name] / full_bytes:.2f} |")
        print(f"sharded ÷ gathered: {results['sharded'] / max(results['gathered'], 1):.2f}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.hidden, args.layers, Path(args.worker))
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        cmd += [__file__, "--hidden", str(args.hidden), "--layers", str(args.layers), "--worker", tmp]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        sys.exit(subprocess.call(cmd, env=env, cwd=ROOT))


if __name__ == "__main__":
    main()
