"""Data-parallel training on torch.distributed, launched with torchrun.

`train.nproc_per_node > 1` makes the train stage launch
`python -m torch.distributed.run --standalone --nproc_per_node N -m tasks.training.torchrun_entry ...`; every
rank runs the same training loop (gloo on CPU, NCCL on GPU; the model wrapped in DDP). The batch
is a *global* batch: rank r takes rows r, r + N, r + 2N, ... of it, which is exactly the strided
layout the per-sample noise seeds assume (docs/strategies.md §3), so each sample gets the same noise for any N.
Token counts are all-reduced, each rank's loss is local sum ÷ global count and backward is scaled
by N (DDP averages), which makes the applied gradient the global token mean (docs/strategies.md §7.2). Rank 0
tracks, checkpoints and writes the result; the launching process publishes it.
"""

from __future__ import annotations

import codecs
import errno
import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from dllm_common import interrupt
from dllm_common.config import ConfigError, TrainingDiverged


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def init_distributed(device: str) -> DistInfo:
    """Join the process group torchrun set up (gloo on CPU, NCCL on CUDA); single process otherwise."""
    if not under_torchrun():
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group(backend=backend)
    return info


def rank_device(device: str, info: DistInfo) -> str:
    return f"cuda:{info.local_rank}" if device == "cuda" and info.world > 1 else device


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard_fsdp2(model) -> None:
    """FSDP2: shard every decoder layer of the backbone, then the whole (wrapped) model as the root unit.

    A model whose layers are run by two modules (`shares_layers`: DiffusionGemma's encoder and decoder hold the
    same parameters, and a step runs each layer three times: encoder, two decoder passes) is one root unit: a
    per-layer unit reshards after the backward of the first module that ran it, before the other has run its
    own, and a unit per module would shard each tied parameter twice. Gradients and optimizer state stay
    sharded; the parameters are gathered once per step (docs/strategies.md §9.5)."""
    if getattr(model, "shares_layers", False):
        fully_shard(model)
        return
    lm = getattr(model, "lm", model)
    layers = lm.layers if hasattr(lm, "layers") else lm.model.layers  # a DFlash draft holds its layers directly
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def _relay(stream, to) -> None:
    """torchrun's output (rank logs, the progress bar) to this process's stream `to` as it comes; once the run
    is interrupted, to the log file only (torchrun answers a signal with a traceback of its own)."""
    log, decode = logging.getLogger("dllm_flow.torchrun"), codecs.getincrementaldecoder("utf-8")("replace").decode
    for chunk in iter(lambda: os.read(stream.fileno(), 1 << 16), b""):
        text = decode(chunk)
        if interrupt.requested():
            log.info(text)
        else:
            to.write(text)
            to.flush()


# where a scheduler says which node this is: torchrun-style launchers, a Kubernetes Indexed Job, Slurm
NODE_RANK_ENV = ("NODE_RANK", "JOB_COMPLETION_INDEX", "SLURM_NODEID")


def node_rank(train) -> int:
    """This node's rank among `train.nnodes`: the config's `train.node_rank`, else the scheduler's environment."""
    if train.nnodes == 1:
        return 0
    if train.node_rank is not None:
        return train.node_rank
    for name in NODE_RANK_ENV:
        value = os.environ.get(name, "")
        if value.isdigit():
            if int(value) >= train.nnodes:
                raise ConfigError(f"${name} is {value}, but train.nnodes is {train.nnodes}: node ranks are 0..N-1")
            return int(value)
    raise ConfigError(
        f"train.nnodes is {train.nnodes} but this node's rank is unknown: set train.node_rank, or one of "
        f"{', '.join('$' + n for n in NODE_RANK_ENV)} (Kubernetes Indexed Jobs and Slurm set theirs)"
    )


def rendezvous(train) -> tuple[str, int]:
    """(host, port) of node 0's rendezvous: `train.rdzv_endpoint`, else $MASTER_ADDR:$MASTER_PORT."""
    endpoint = train.rdzv_endpoint
    if endpoint is None and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if endpoint is None:
        raise ConfigError(
            f"train.nnodes is {train.nnodes}: set train.rdzv_endpoint to HOST:PORT of node 0 (e.g. the headless "
            "service name of pod 0 and a free port), or $MASTER_ADDR and $MASTER_PORT"
        )
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)


ENTRY = "tasks.training.torchrun_entry"  # what each rank runs: the job the args file names


def torchrun_command(train, args_file: Path) -> list[str]:
    """torchrun for one node: `--standalone` on one host; on N hosts a static rendezvous at node 0, so global
    rank 0 (the one that writes the result) is always on node 0. One process in all: a plain child process
    (a training fanned out beside others, `pipeline.max_parallel`)."""
    if train.world_size == 1:
        return [sys.executable, "-m", ENTRY, str(args_file)]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={train.nproc_per_node}"]
    if train.nnodes == 1:
        cmd.append("--standalone")
    else:
        host, port = rendezvous(train)
        cmd += [f"--nnodes={train.nnodes}", f"--node_rank={node_rank(train)}"]
        cmd += [f"--master_addr={host}", f"--master_port={port}"]
    return cmd + ["-m", ENTRY, str(args_file)]


CHILD_ERROR = "child-error.txt"  # a lone training process's traceback, for the launching process to report
_children: set[subprocess.Popen] = set()  # trainings running in child processes (several when fanned out)


def terminate_children() -> None:
    """SIGTERM every training child process: each checkpoints the step it is on and exits (a run stopping)."""
    for proc in list(_children):
        if proc.poll() is None:
            proc.terminate()


def child_error(label: str, record: dict) -> Exception:
    """The exception rank 0 of a training process recorded (`tasks.training.torchrun_entry`), raised again here: the
    errors a user can act on keep their type, so the command reports them as such (exit 2, one line); others become a
    RuntimeError with the child's message."""
    from dllm_common.checkpoint import CorruptCheckpointError
    from dllm_common.store import DiskFullError

    logging.getLogger("dllm_flow.train").info(
        "%s failed in its process:\n%s", label, "".join(record.get("traceback", []))
    )
    message = record["message"]
    if not message.startswith(label):
        message = f"{label}: {message}"
    kinds = {  # what a user can act on, nearest first (the CLI's user errors: exit 2, one line)
        "TrainingDiverged": TrainingDiverged,
        "ConfigError": ConfigError,
        "CorruptCheckpointError": CorruptCheckpointError,
        "DiskFullError": lambda text: DiskFullError(errno.ENOSPC, text),
        "FileNotFoundError": FileNotFoundError,
        "ValueError": ValueError,
    }
    for name in record.get("bases", [record["type"]]):
        if name in kinds:
            return kinds[name](message)
    return RuntimeError(f"{message} ({record['type']})")


def launch(job, out: Path) -> None:
    """Run a job under torchrun: a training (`tasks.train.TrainJob`) or another stage's work on the training's
    processes (`tasks.posttrain.grpo.GRPOJob`): this node's `train.nproc_per_node` processes of `train.nnodes` ×
    that, each running `job.run(out, DistInfo)` (`tasks.training.torchrun_entry`), global rank 0 writing its result
    into `out`; raise if torchrun fails. A job has `spec`, `label`, `work`, `manifest_file`, `to_json`, `from_dict`
    and `run`."""
    train, rank = job.spec.train, node_rank(job.spec.train)
    args_file = job.work / f"torchrun-args-node{rank}.json"
    kind = f"{type(job).__module__}:{type(job).__name__}"
    args_file.write_text(json.dumps({"kind": kind, "job": json.loads(job.to_json()), "out": str(out)}))
    (job.work / CHILD_ERROR).unlink(missing_ok=True)
    nproc = f"{train.nproc_per_node} processes" + (f" on node {rank} of {train.nnodes}" if train.nnodes > 1 else "")
    if train.world_size == 1:
        nproc = "1 process (a child process, beside the other strategies)"
    what = "torchrun" if train.world_size > 1 else "training"
    print(f"[dllm-flow] {job.label}: launching {what} with {nproc}", flush=True)
    if interrupt.requested():  # a run being stopped starts no training
        raise interrupt.Interrupted(interrupt.requested(), f"{job.label} was not started")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(job.spec.train.threads or 1))
    code = _run_child(torchrun_command(train, args_file), env, train.world_size > 1)
    _raise_for_exit(job, code)


def _run_child(cmd: list[str], env: dict, torchrun: bool) -> int:
    """Start the training process in its own session (a Ctrl-C to the run's group reaches the run alone, which
    forwards one SIGTERM), relay its output, wait for it; a signal stops it after its checkpoint."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=str(Path(__file__).resolve().parents[2]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=interrupt.detach_and_die_with_parent,
    )
    _children.add(proc)
    pumps = [
        threading.Thread(target=_relay, args=pair, daemon=True)
        for pair in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
    ]
    for pump in pumps:
        pump.start()
    where = (
        "torchrun stopped; the ranks resume from their last periodic checkpoint"
        if torchrun
        else "each training process checkpoints the step it is on, then stops"
    )
    interrupt.note(where)
    try:
        return proc.wait()
    except BaseException:  # interrupted (dllm_common/interrupt.py): torchrun stops its ranks, then itself
        proc.terminate()
        try:
            proc.wait(timeout=interrupt.GRACE_SECONDS + 3)  # the step, then its checkpoint
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    finally:
        _children.discard(proc)
        if interrupt.requested() is None:  # after a signal the note is the run's last word
            interrupt.note("")
        for pump in pumps:
            pump.join(timeout=5)


def _raise_for_exit(job, code: int) -> None:
    """A failed training as one error: stopped with the run, rank 0's own error, or the exit status."""
    if code != 0 and interrupt.requested():  # stopped with the run (fanned out: this is a worker thread)
        raise interrupt.Interrupted(interrupt.requested(), f"{job.label} checkpointed and stopped")
    if code != 0:
        error = job.work / CHILD_ERROR
        if error.is_file():  # rank 0's error as one line of its own type; its traceback into the log file
            raise child_error(job.label, json.loads(error.read_text()))
        who = "torchrun" if job.spec.train.world_size > 1 else "the training process"
        raise RuntimeError(
            f"{who} for {job.label} exited with status {code}; see the rank logs above. "
            "Rerun to resume from the last checkpoint."
        )
