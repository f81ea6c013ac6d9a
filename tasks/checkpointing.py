"""The training checkpoint: written every `train.checkpoint_every` steps into the stage's work dir,
read back when a stage that died mid-way is rerun.

A checkpoint holds the model weights, optimizer and scheduler state, the step and the MLflow run
id (atomically, see `dllm_common.checkpoint.write_checkpoint`). Under FSDP2 the shards are gathered
into a full copy that rank 0 keeps on the CPU and writes; every other layout writes rank 0's model.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

from dllm_common.checkpoint import load_trainer_state, load_weights_into, read_meta, write_checkpoint
from tasks.distributed import DistInfo, barrier, gather_full_state, load_full_optimizer_state


class Checkpointer:
    def __init__(self, directory: Path, dist: DistInfo, sharded: bool):
        self.directory, self.dist, self.sharded = Path(directory), dist, sharded
        self._shadow = None  # FSDP2: rank 0's unsharded CPU copy, the module full checkpoints are written from
        self.saved_step: int | None = None  # the step of the checkpoint on disk (written or restored)
        self.save_seconds: float | None = None  # how long the last save took

    def fits_in(self, seconds: float, model) -> bool:
        """Whether a save likely ends within `seconds`: the last save's time, or before any, the bytes of
        weights + two AdamW moments at a cautious 200 MB/s."""
        if self.save_seconds is not None:
            return 1.5 * self.save_seconds < seconds
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return 3 * nbytes / 200e6 < seconds

    @property
    def exists(self) -> bool:
        return self.directory.exists()

    def load_weights(self, model) -> None:
        """Before sharding: every rank loads the same full weights."""
        load_weights_into(model, self.directory)

    def keep_full_copy(self, model) -> None:
        """Before sharding (FSDP2): rank 0 keeps the module that full checkpoints are written from."""
        if self.sharded and self.dist.is_main:
            self._shadow = copy.deepcopy(model).cpu()

    def restore(self, model, opt, sched) -> tuple[int, str | None]:
        """Optimizer and scheduler state of the checkpoint; returns (step, MLflow run id)."""
        state = load_trainer_state(self.directory)
        if self.sharded:
            load_full_optimizer_state(model, opt, state["optimizer_full"])
        else:
            opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        meta = read_meta(self.directory)
        self.saved_step = meta["step"]
        return meta["step"], meta.get("mlflow_run_id")

    def pending_metrics(self) -> list:
        """Metrics the checkpointed attempt could not log (its tracking server was down), as (step, metrics)."""
        return read_meta(self.directory).get("pending_metrics", []) if self.exists else []

    def save(self, model, opt, sched, tokenizer, meta: dict) -> None:
        """A collective under FSDP2 (every rank gathers), rank 0 writes; all ranks wait for it."""
        t0 = time.monotonic()
        if self.sharded:
            weights, optim = gather_full_state(model, opt)
            if self.dist.is_main:
                self._shadow.load_state_dict(weights)
                write_checkpoint(
                    self.directory,
                    self._shadow,
                    tokenizer,
                    meta,
                    {"optimizer_full": optim, "scheduler": sched.state_dict()},
                )
        elif self.dist.is_main:
            write_checkpoint(
                self.directory, model, tokenizer, meta, {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
            )
        barrier()
        self.saved_step, self.save_seconds = meta["step"], time.monotonic() - t0

    def full_model(self, model):
        """The trained module with full weights on rank 0 (a collective under FSDP2; None on other ranks there)."""
        if not self.sharded:
            return model
        weights, _ = gather_full_state(model, None)
        if not self.dist.is_main:
            return None
        self._shadow.load_state_dict(weights)
        return self._shadow
