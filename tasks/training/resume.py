"""The training checkpoint: written every `train.checkpoint_every` steps into the stage's work dir,
read back when a stage that died mid-way is rerun — at the same or at another world size.

A checkpoint is a `torch.distributed.checkpoint` (DCP) folder: every rank writes and reads only its own
part of the model and optimizer state (its FSDP2 shards; under DDP the replicas are written once), keyed
by parameter name, so a checkpoint written by N processes loads into M, DDP or FSDP2 alike (DCP reshards
on load). Beside the shards: `dllm.json` (step, MLflow run id, what the strategy needs), the scheduler's
state and `digests.json`, the sha256 of every file; the folder is swapped into place atomically
(`dllm_common.checkpoint.swap_into`). No rank holds the full state at a checkpoint; the published model
is gathered once, after the last step (`full_model`). docs/architecture.md, "The training runtime".
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dllm_common import faults
from dllm_common.checkpoint import DIGESTS, read_meta, swap_into, tied_groups
from dllm_common.store import DiskFullError, fsync_tree, is_disk_full, sha256_file
from strategies.base import global_sum
from tasks.training.distributed import DistInfo, barrier

SHARDS = "shards"  # the DCP folder inside a checkpoint
SCHEDULER = "scheduler.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_is_intended():
    """DCP warns that it assumes a single process when no process group exists: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _upload(response):
    """The future that completes when an `async_save` has written everything (its type varies across torch)."""
    return getattr(response, "upload_completion", response)


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers live on the meta device (no memory; ties kept):
    the module the gathered weights are loaded into at the end, on rank 0 only."""
    memo = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(model, memo)


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Register every name of each group as the group's first parameter again. Loading a state dict with
    `assign=True` gives each name its own tensor, which silently unties them: the model would then publish two
    copies that `from_pretrained` and a strict load of the tied architecture refuse."""
    for first, *others in groups:
        param = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)


class _ShardWriter(FileSystemWriter):
    """DCP's file writer, with the fault point where a rank writes its shards (the fault suite fills the disk
    there: the error then comes back wrapped in DCP's `CheckpointException`, as a real full disk's does)."""

    def write_data(self, plan, planner):
        faults.reached("checkpoint.shards")
        return super().write_data(plan, planner)


def _causes(exc: BaseException) -> list[BaseException]:
    """The per-rank errors inside a DCP `CheckpointException` (a BaseException), or the error itself."""
    if isinstance(exc, CheckpointException):
        return [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
    return [exc]


class Checkpointer:
    def __init__(self, directory: Path, dist_info: DistInfo, sharded: bool, asynchronous: bool = False):
        self.directory, self.dist, self.sharded, self.asynchronous = Path(directory), dist_info, sharded, asynchronous
        self._pending = None  # an asynchronous save being written: (its future, what finalizing it needs)
        self._group = None  # the gloo group asynchronous writes use (from their background thread)
        self._poll_group = None  # the gloo group the main thread asks "is every rank's write done?" over
        self._skeleton = None  # FSDP2, rank 0: the meta-device module the final weights are gathered into
        self._tied: list[list[str]] = []  # its tied parameters' names, tied again once the weights are in
        self.saved_step: int | None = None  # the step of the checkpoint on disk (written or restored)
        self.save_seconds: float | None = None  # how long the last save took

    @property
    def exists(self) -> bool:
        return (self.directory / "dllm.json").is_file() and (self.directory / SHARDS).is_dir()

    def fits_in(self, seconds: float, model) -> bool:
        """Whether a save likely ends within `seconds`: the last save's time, or before any, the bytes of
        this rank's weights + two AdamW moments at a cautious 200 MB/s."""
        if self.save_seconds is not None:
            return 1.5 * self.save_seconds < seconds
        local = (getattr(p, "to_local", lambda p=p: p)() for p in model.parameters())  # an FSDP2 shard is a DTensor
        nbytes = sum(t.numel() * t.element_size() for t in local)
        return 3 * nbytes / 200e6 < seconds

    def keep_skeleton(self, model) -> None:
        """Before sharding (FSDP2): rank 0 keeps the model's structure, without its memory."""
        if self.sharded and self.dist.is_main:
            self._skeleton = meta_skeleton(model)
            self._tied = tied_groups(self._skeleton)

    def _state(self, model, opt) -> dict:
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}

    def restore(self, model, opt, sched) -> tuple[int, str | None]:
        """Every rank loads its part of the model and optimizer state (after sharding or wrapping, at any
        world size); returns (step, MLflow run id). The launching process verified the files first
        (`tasks.train.set_aside_damaged`)."""
        state = self._state(model, opt)
        with _single_process_is_intended():
            dcp.load(state, checkpoint_id=str(self.directory / SHARDS), no_dist=not _distributed())
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        sched.load_state_dict(json.loads((self.directory / SCHEDULER).read_text()))
        meta = read_meta(self.directory)
        self.saved_step = meta["step"]
        return meta["step"], meta.get("mlflow_run_id")

    def pending_metrics(self) -> list:
        """Metrics the checkpointed attempt could not log (its tracking server was down), as (step, metrics)."""
        return read_meta(self.directory).get("pending_metrics", []) if self.exists else []

    def save(self, model, opt, sched, tokenizer, meta: dict) -> None:
        """A collective: each rank writes its own part into a temp folder, rank 0 adds the metadata and
        digests and swaps the folder into place. Asynchronous (`train.checkpoint_async`): the state is
        staged and written in the background while training goes on, and the folder is swapped in once every
        rank's write is done (`poll` each step, `finish` at the end, at a stop or at the next save)."""
        self.finish()
        t0 = time.monotonic()
        tmp = self.directory.parent / f".tmp-{self.directory.name}-step{meta['step']}"
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        state, writer = self._state(model, opt), _ShardWriter(tmp / SHARDS)
        finalize = (tmp, dict(meta), json.loads(json.dumps(sched.state_dict())), t0)
        with _single_process_is_intended(), self._failing_write(tmp, meta["step"]):
            if self.asynchronous:
                self._pending = (dcp.async_save(state, storage_writer=writer, **self._async_group()), finalize)
                return
            dcp.save(state, storage_writer=writer, no_dist=not _distributed())
        self._finalize(*finalize)

    @contextlib.contextmanager
    def _failing_write(self, tmp: Path, step: int):
        """A checkpoint write that fails (on every rank: DCP agrees on failures, `_finalize` too) leaves no temp
        folder and keeps the previous checkpoint; a full disk is the one-line `DiskFullError`, DCP's wrapped
        error (a `BaseException` carrying every rank's traceback) a one-line RuntimeError."""
        try:
            yield
        except (Exception, CheckpointException) as exc:
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            kept = f"the step-{self.saved_step} checkpoint is kept" if self.saved_step else "no earlier checkpoint"
            again = "continues from the kept checkpoint" if self.saved_step else "starts the training again"
            causes = _causes(exc)
            if is_disk_full(exc):  # also torch's zip writer's "unexpected pos" over a write that failed
                raise DiskFullError(
                    errno.ENOSPC,
                    f"no space left on the device while writing the step-{step} checkpoint in {self.directory} "
                    f"({kept}; the partial write is removed): free space (or point --workdir at a larger disk), "
                    f"then `dllm-flow resume` {again}",
                ) from None
            if isinstance(exc, CheckpointException):
                first = causes[0]
                raise RuntimeError(
                    f"the step-{step} checkpoint could not be written in {self.directory} ({kept}): "
                    f"{type(first).__name__}: {first}"
                ) from first
            raise

    def _async_group(self) -> dict:
        """Background writes talk over their own gloo group, never the training's; the polls that ask whether
        they are done use a third one. Collectives of two threads on one group could pair up differently on
        each rank and deadlock (seen: a poll's all-reduce against the write's all-gather)."""
        if not _distributed():
            return {"no_dist": True}
        if self._group is None:  # every rank reaches its first asynchronous save together: same creation order
            self._group = dist.new_group(backend="gloo")
            self._poll_group = dist.new_group(backend="gloo")
        return {"process_group": self._group}

    def poll(self) -> None:
        """At a step boundary: swap in an asynchronous checkpoint once every rank has written its part."""
        if self._pending is None:
            return
        done = _upload(self._pending[0]).done()
        if _distributed():  # over the checkpoint's own gloo group: a CPU tensor, whatever the training's backend
            flag = torch.tensor([int(done)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._poll_group)
            done = bool(flag.item())
        if done:
            self.finish()

    def finish(self) -> None:
        """Wait for an asynchronous checkpoint still being written, then swap it in."""
        if self._pending is None:
            return
        future, finalize = self._pending
        self._pending = None
        with self._failing_write(finalize[0], finalize[1]["step"]):
            _upload(future).result()
        self._finalize(*finalize)

    def _finalize(self, tmp: Path, meta: dict, sched_state: dict, t0: float) -> None:
        barrier()
        faults.reached("checkpoint.written")
        failed: BaseException | None = None
        if self.dist.is_main:
            try:
                (tmp / "dllm.json").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
                (tmp / SCHEDULER).write_text(json.dumps(sched_state))
                files = sorted(p for p in tmp.rglob("*") if p.is_file())
                digests = {str(p.relative_to(tmp)): sha256_file(p) for p in files}
                (tmp / DIGESTS).write_text(json.dumps(digests, indent=2, sort_keys=True))
                fsync_tree(tmp)
                swap_into(tmp, self.directory)
            except Exception as exc:  # a full disk, say: every rank must learn it, none may wait at a barrier
                shutil.rmtree(tmp, ignore_errors=True)
                failed = exc
            except BaseException:  # a signal or SIGKILL ends the other ranks too (torchrun, the run's handler)
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        if global_sum(0 if failed is None else 1) > 0:  # agreed by every rank, in place of a barrier
            with self._failing_write(tmp, meta["step"]):
                if failed is not None:
                    raise failed
                raise RuntimeError(
                    f"rank 0 could not finish the checkpoint of step {meta['step']} (its error is above)"
                )
        self.saved_step, self.save_seconds = meta["step"], time.monotonic() - t0

    def full_model(self, model):
        """The trained module with full weights on rank 0, for publishing (a collective under FSDP2, where the
        weights — not the optimizer state — are gathered once, after the last step; None on other ranks)."""
        if not self.sharded:
            return model
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.dist.is_main:
            return None
        self._skeleton.load_state_dict(weights, assign=True)
        retie(self._skeleton, self._tied)
        return self._skeleton


def layout(world: int, parallel: str, device: str, nodes: int = 1) -> dict:
    """How a training ran (recorded with the published result; not part of its key)."""
    how = parallel if world > 1 else "single"
    return {"processes": world, "nodes": nodes, "parallel": how, "device": device, "torch": torch.__version__}
