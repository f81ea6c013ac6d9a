"""Run a function on two (or more) gloo CPU ranks from a test, with a deadline: each rank's process group times out
its collectives, every rank waits at a barrier before it leaves (so none tears its group down while another is
still talking to it), and the parent kills the ranks and fails the test when the deadline passes instead of
waiting for ever (a hung rank once held the whole suite past CI's limit)."""

import time
from datetime import timedelta
from pathlib import Path

import pytest


def _rank_entry(rank: int, world: int, init_file: str, timeout_s: float, fn, args: tuple):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, *args, tmp_path: Path, world: int = 2, deadline_s: float = 240) -> None:
    """`fn(rank, world, *args)` on `world` spawned processes joined in one gloo group (file rendezvous under
    `tmp_path`). `fn` must be importable by name (a module-level function). A rank that raises fails the test
    with its traceback; ranks still alive after `deadline_s` are killed and the test fails."""
    import torch.multiprocessing as mp

    init_file = str(tmp_path / f"rendezvous-{time.monotonic_ns()}")
    ctx = mp.start_processes(
        _rank_entry, args=(world, init_file, deadline_s / 2, fn, args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            alive = [rank for rank, proc in enumerate(ctx.processes) if proc.is_alive()]
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"ranks {alive} of {world} were still running {deadline_s:.0f} s after the start")
