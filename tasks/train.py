"""Stage `train[strategy]`: train one strategy on prepared data, or reuse or resume it.

The stage goes through the store's one protocol (`Store.reuse_or_build`); building runs the training
loop (`tasks.training.loop`) in this process, or on every rank under torchrun with `train.nproc_per_node > 1`.
Resumable: every `train.checkpoint_every` steps the model, optimizer, scheduler, step and MLflow run id
go to `store/train/<key>.work/checkpoint` (`tasks.training.resume`). The finished model is published to
`store/train/<key>/model`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect.deployments import run_deployment
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

from dllm_common.checkpoint import checkpoint_problem, read_meta, recover_checkpoint, write_checkpoint
from dllm_common.config import PipelineSpec, flatten
from dllm_common.store import stage_key
from strategies import strategy_class
from strategies.models import lora_state_dict, merge_lora
from strategies.options import resolve_options
from tasks.common import StageRef, prefect_task, stage_code_version, store_for, tracking_for
from tasks.devices import stage_device
from tasks.stages import Roles, Stage
from tasks.training import distributed
from tasks.training.job import StageJob
from tasks.training.loop import LoopRun, LoopSettings, train_loop
from tasks.training.resume import Checkpointer, layout
from tasks.training.runtime import OptimSettings, Split, make_optimizer
from tasks.training.trainee import build_trainee

STAGE = "train"

# how a training is laid out on hardware, not what it computes: left out of the stage key, so a rerun with
# another layout reuses the published result or resumes its checkpoint (DCP reshards it); recorded instead
LAYOUT_KEYS = (
    "nproc_per_node",
    "nnodes",
    "rdzv_endpoint",
    "node_rank",
    "parallel",
    "micro_batch_size",
    "device",
    "threads",
    "checkpoint_async",
)
# nor is what only decides whether a training that meets a non-finite step fails or skips it (the count of skipped
# steps is recorded with the result)
NOT_IN_KEY = (*LAYOUT_KEYS, "skip_nonfinite_steps")


def train_slice(spec: PipelineSpec, strategy: str) -> dict:
    """The config that shapes training (the stage key's config part): model, train without its layout
    (`NOT_IN_KEY`), the strategy's options."""
    train = {k: v for k, v in spec.train.model_dump(mode="json").items() if k not in NOT_IN_KEY}
    out = {
        "strategy": strategy,
        "model": spec.model.model_dump(mode="json"),
        "train": train,
        "options": resolve_options(spec, strategy).model_dump(mode="json"),
    }
    settings = strategy_class(strategy).train_settings(spec)
    return {**out, "settings": settings} if settings else out


def stage_of(
    spec: PipelineSpec, strategy: str, data: StageRef, workdir: str, inputs: dict | None = None, **_
) -> tuple[str, str]:
    """`inputs`: the upstream stages besides the data that the strategy declares (DFlash: `target`, `features`)."""
    upstream = {"data": data.key, **{name: ref.key for name, ref in sorted((inputs or {}).items())}}
    key = stage_key(
        STAGE,
        train_slice(spec, strategy),
        upstream,
        stage_code_version(__name__, strategy),
    )
    return STAGE, key


def check_inputs(spec: PipelineSpec, strategy: str, inputs: dict | None) -> dict:
    """Every upstream stage the strategy declares is given (most declare none)."""
    inputs = dict(inputs or {})
    missing = [s for s in strategy_class(strategy).upstream_stages(spec) if s not in inputs]
    if missing:
        raise ValueError(
            f"train[{strategy}] needs its {missing[0]} stage: run it through the pipeline (`dllm-flow run`), "
            f"which builds {missing} before training"
        )
    return inputs


@dataclass(frozen=True, kw_only=True)
class TrainJob(StageJob):
    """What one training needs: the data stage's descriptor and the strategy's further upstream stages."""

    stage = STAGE
    data: StageRef
    inputs: dict

    def _upstream(self) -> dict:
        return {"data": asdict(self.data), "inputs": {name: asdict(ref) for name, ref in self.inputs.items()}}

    @classmethod
    def _upstream_from(cls, raw: dict) -> dict:
        return {
            "data": StageRef(**raw["data"]),
            "inputs": {name: StageRef(**ref) for name, ref in raw["inputs"].items()},
        }

    def run(self, out: Path, info: distributed.DistInfo) -> dict | None:
        """What each rank runs under torchrun (`tasks.training.torchrun_entry`)."""
        return run_training(self, out, info)


# ------------------------------------------------------------------ setup, loop, publish


def _open_tracker(job: TrainJob, resume_run_id: str | None):
    tracking = tracking_for(job.spec, job.workdir)
    if tracking.run_exists(resume_run_id):
        return tracking.reopen(resume_run_id)
    tags = {"strategy": job.strategy, "dllm.stage": "train", "dllm.stage_key": job.key}
    return tracking.start_run(job.strategy, tags, parent_run_id=job.parent_run_id)


VALIDATE_ROWS = 8192  # rows a strategy checks at a time: a memory-mapped split is never read whole


def validate_rows(strategy, split: Split) -> None:
    """The strategy's check of the training rows (`validate_data`), a block of rows at a time."""
    for start in range(0, len(split.ids), VALIDATE_ROWS):
        end = min(start + VALIDATE_ROWS, len(split.ids))
        try:
            strategy.validate_data(split.loss_mask[start:end].float(), split.attention_mask[start:end].long())
        except ValueError as exc:
            raise ValueError(f"{exc} (row numbers count from training row {start})") if start else exc from None


def checkpoint_meta(job: TrainJob, trainee, run_id: str | None) -> dict:
    """What every checkpoint of this training records: enough to rebuild the strategy from it alone."""
    meta = {
        "strategy": job.strategy,
        "mask_token_id": trainee.mask_token_id,
        "stage_key": job.key,
        "seq_len": job.spec.data.seq_len,
        "mlflow_run_id": run_id,
        "options": trainee.strategy.options.model_dump(mode="json"),
        "chat": job.spec.chat_rows,
    }
    if "target" in job.inputs:  # what evaluation and `dllm-flow generate` need to load the frozen target
        t, d = job.inputs["target"], job.spec.dflash
        meta["target"] = {
            "path": t.info["model_path"],
            "stage": t.stage,
            "key": t.key,
            "weights_digest": t.info["weights_digest"],
            "torch_dtype": d.target_torch_dtype,
            "trust_remote_code": d.target_trust_remote_code,
        }
    return meta


def setup_run(job: TrainJob, dist: distributed.DistInfo) -> LoopRun:
    """Model, optimizer, data, tracker and checkpointer of one training (resumed where a checkpoint exists)."""
    cfg = job.spec.train
    device = distributed.rank_device(stage_device(job.spec), dist)
    train_split = Split.open(job.data.path, "train")
    val_split = Split.open(job.data.path, "val")
    trainee = build_trainee(job.spec, job.strategy, job.data, device, job.inputs)
    validate_rows(trainee.strategy, train_split)
    model = stepper = trainee.model
    sharded = dist.world > 1 and cfg.parallel == "fsdp2"
    checkpointer = Checkpointer(job.work / "checkpoint", dist, sharded, cfg.checkpoint_async)
    resuming = checkpointer.exists
    if sharded:
        checkpointer.keep_skeleton(model)
        distributed.shard_fsdp2(model)
    elif dist.world > 1:
        stepper = DistributedDataParallel(model, device_ids=[dist.local_rank] if device.startswith("cuda") else None)
    opt, sched = make_optimizer(model, OptimSettings.of(cfg))
    # each rank loads its part of the checkpoint, whatever world size and layout wrote it (DCP reshards)
    start, run_id = checkpointer.restore(model, opt, sched) if resuming else (0, None)
    skipped = read_meta(checkpointer.directory).get("skipped_steps", 0) if resuming else 0
    if resuming and dist.is_main:
        print(
            f"[dllm-flow] train[{job.strategy}]: resuming from the step-{start} checkpoint in {checkpointer.directory}",
            flush=True,
        )
    tracker = _open_tracker(job, run_id) if dist.is_main else None
    if tracker is not None:
        tracker.log_params(
            {
                **flatten(train_slice(job.spec, job.strategy)),
                "data.key": job.data.key,
                "stage.key": job.key,
                **{f"{name}.key": ref.key for name, ref in job.inputs.items()},
            }
        )
        # the layout is a tag, not a param: a run resumed at another world size continues this MLflow run
        where = layout(dist.world, cfg.parallel, device, cfg.nnodes)
        tracker.set_tags({f"dllm.layout.{k}": v for k, v in where.items()})
    return LoopRun(
        trainee=trainee,
        stepper=stepper,
        opt=opt,
        sched=sched,
        train=train_split,
        val=val_split,
        device=device,
        dist=dist,
        tracker=tracker,
        checkpointer=checkpointer,
        checkpoint_meta=checkpoint_meta(job, trainee, tracker.run_id if tracker else None),
        start=start,
        logged_upto=tracker.last_step("train/loss") if (start and tracker) else -1,
        pending=checkpointer.pending_metrics() if resuming else [],
        skipped=skipped,
    )


def run_training(job: TrainJob, out: Path, dist: distributed.DistInfo) -> dict | None:
    """Set up, loop, then (rank 0) write the published files into `out`; returns the manifest fields
    on rank 0, None on the others."""
    run = setup_run(job, dist)
    val_loss = train_loop(run, LoopSettings.of(job.spec.train, f"train[{job.strategy}]"))
    model = run.checkpointer.full_model(run.trainee.model)
    fields = _write_result(job, run, model, val_loss, Path(out)) if dist.is_main else None
    distributed.barrier()
    return fields


def _write_result(job: TrainJob, run: LoopRun, model, val_loss: float | None, out: Path) -> dict:
    """The final model (and LoRA adapter) into `out`, logged to the strategy's MLflow run; the manifest fields."""
    spec, tracker = job.spec, run.tracker
    meta = {**run.checkpoint_meta, "step": spec.train.steps, "final_val_loss": val_loss, "data_key": job.data.key}
    if run.skipped:
        meta["skipped_steps"] = run.skipped
    meta["layout"] = {
        **layout(run.dist.world, spec.train.parallel, run.device, spec.train.nnodes),
        "micro_batch_size": spec.train.micro_batch_size,
    }
    peft = spec.train.peft
    if peft is not None:
        meta["peft"] = {**peft.model_dump(mode="json"), "merged": peft.merge}
        write_adapter(out / "adapter", model, peft)
        if peft.merge:
            merge_lora(model)
    write_checkpoint(out / "model", model, run.trainee.tokenizer, meta)
    tracker.log_dataset(
        Path(job.data.path), name=f"{spec.pipeline.name}-{job.data.key[:8]}", digest=job.data.info["digest"]
    )
    if spec.tracking.log_checkpoints:
        tracker.log_artifact(out / "model", "model")
        if (out / "adapter").is_dir():
            tracker.log_artifact(out / "adapter", "adapter")
        if spec.tracking.register_model:
            name = f"{spec.pipeline.name}-{job.strategy}"
            version = tracker.register_model(name, "model")
            tracker.set_tags({"dllm.registered_model": f"{name}/{version}"})
    tracker.close()
    return {
        "strategy": job.strategy,
        "config": train_slice(spec, job.strategy),
        "upstream": {"data": job.data.key},
        "info": meta,
    }


def write_adapter(dest: Path, model, peft) -> None:
    """The LoRA adapter alone (safetensors + its config): small enough to ship without the base weights."""
    dest.mkdir(parents=True)
    save_file(lora_state_dict(model), str(dest / "adapter_model.safetensors"))
    config = {**peft.model_dump(mode="json"), "peft_type": "LORA"}
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2))


# ------------------------------------------------------------------ the stage


def set_aside_damaged(job: TrainJob) -> None:
    """A resumable checkpoint whose files fail their digests is never loaded: it is moved aside (kept for
    inspection, as a damaged store entry is) and the training starts over, with one line saying so."""
    ckpt = job.work / "checkpoint"
    if not ckpt.is_dir():
        return
    problem, _ = checkpoint_problem(ckpt)
    if problem is None:
        return
    try:
        step = f"step-{read_meta(ckpt)['step']} "
    except (OSError, ValueError, KeyError):
        step = ""
    # beside the work dir, which goes once the training publishes
    aside = job.work.with_name(f"{job.key}.checkpoint.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.rename(ckpt, aside)
    print(
        f"[dllm-flow] train[{job.strategy}]: its {step}checkpoint is damaged ({problem}); moved aside to {aside}; "
        "the training starts over from step 0",
        flush=True,
    )


def _build(job: TrainJob, out: Path) -> dict:
    """Train into `out`: in this process, or under torchrun (rank 0 writes `out` and the manifest fields)."""
    recover_checkpoint(job.work / "checkpoint")  # a checkpoint write killed mid-swap
    set_aside_damaged(job)
    if job.spec.train.world_size == 1 and job.spec.pipeline.max_parallel == 1:
        return run_training(job, out, distributed.DistInfo())
    # torchrun, or one child process per training when several train at once (global RNG, threads, memory)
    job.work.mkdir(parents=True, exist_ok=True)
    job.manifest_file.unlink(missing_ok=True)
    distributed.launch(job, out)
    if not job.manifest_file.is_file():
        raise RuntimeError(f"torchrun finished but train[{job.strategy}] wrote no result into {out}")
    return json.loads(job.manifest_file.read_text())


def train(
    spec: PipelineSpec,
    strategy: str,
    data: StageRef,
    workdir: str,
    parent_run_id: str | None = None,
    inputs: dict | None = None,
) -> StageRef:
    """Train `strategy` on the prepared data (or reuse/resume it); publish the final checkpoint.

    With `train.nproc_per_node > 1` this launches torchrun and every rank runs the training loop."""
    inputs = check_inputs(spec, strategy, inputs)
    stage, key = stage_of(spec, strategy, data, workdir, inputs)
    job = TrainJob(
        spec=spec, strategy=strategy, data=data, workdir=workdir, parent_run_id=parent_run_id, key=key, inputs=inputs
    )
    if distributed.node_rank(spec.train) > 0:
        return _follow(job)
    entry, reused = store_for(workdir).reuse_or_build(stage, key, lambda out: _build(job, out))
    if not reused:
        shutil.rmtree(job.work, ignore_errors=True)
    return _ref(entry, strategy, reused)


FOLLOW_TIMEOUT_S = 1800  # how long node k > 0 waits for node 0 to publish after its own ranks are done


def _follow(job: TrainJob) -> StageRef:
    """Node k > 0 of a multi-node training: its ranks train with the others, node 0 (global rank 0) writes and
    publishes the result into the shared store; this node waits for that entry."""
    store = store_for(job.workdir)
    if (hit := store.lookup(STAGE, job.key)) is not None:
        return _ref(hit, job.strategy, reused=True)
    job.work.mkdir(parents=True, exist_ok=True)
    distributed.launch(job, job.work / f"node-{distributed.node_rank(job.spec.train)}")  # global rank 0 isn't here
    deadline = time.monotonic() + FOLLOW_TIMEOUT_S
    while (entry := store.lookup(STAGE, job.key)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"train[{job.strategy}]: this node's ranks finished, but node 0 published nothing under {store.root} "
                f"within {FOLLOW_TIMEOUT_S} s; every node must see the same workdir (shared storage)"
            )
        time.sleep(1)
    return _ref(entry, job.strategy, reused=False)


def _ref(entry, strategy: str, reused: bool) -> StageRef:
    return StageRef.of(entry, reused, f"train[{strategy}]")


def model_dir(ref: StageRef) -> Path:
    return Path(ref.path) / "model"


def train_on_deployment(
    spec: PipelineSpec,
    strategy: str,
    data: StageRef,
    workdir: str,
    parent_run_id: str | None = None,
    inputs: dict | None = None,
) -> StageRef:
    """Submit the train stage to `pipeline.train_deployment` (a GPU work pool) and wait for it.

    Only small descriptors cross: the resolved config, the data stage's descriptor and paths. The
    worker runs `train` (same function, same store, same key), so results are those of a local run."""
    inputs = check_inputs(spec, strategy, inputs)
    store = store_for(workdir)
    stage, key = stage_of(spec, strategy, data, workdir, inputs)
    if (hit := store.lookup(stage, key)) is not None:
        return _ref(hit, strategy, reused=True)
    parameters = {
        "spec": spec.model_dump(mode="json"),
        "strategy": strategy,
        "data": asdict(data),
        "workdir": str(Path(workdir).resolve()),
        "parent_run_id": parent_run_id,
        "inputs": {name: asdict(ref) for name, ref in inputs.items()},
    }
    entry = run_on_deployment(spec.pipeline.train_deployment, parameters, f"train[{strategy}]", store, stage, key)
    return _ref(entry, strategy, reused=False)


def run_on_deployment(deployment: str, parameters: dict, label: str, store, stage: str, key: str):
    """Run a stage as a deployment run (a worker calls the same stage function on the same store) and wait; its
    published entry, or one error saying where to look."""
    run = run_deployment(deployment, timeout=None, parameters=parameters)
    if not run.state or not run.state.is_completed():
        raise RuntimeError(
            f"{label} on deployment {deployment!r} ended {run.state.name if run.state else 'without a state'} "
            f"(flow run {run.id}); `prefect flow-run logs` shows why, `prefect flow-run retry` reruns it"
        )
    if (entry := store.lookup(stage, key)) is None:
        raise RuntimeError(
            f"deployment run {run.id} completed but published nothing under {store.root}; "
            "is the workdir on storage the worker can see?"
        )
    return entry


train_task = prefect_task(train, name="train", stage_of=stage_of)
train_remote_task = prefect_task(train_on_deployment, name="train", stage_of=stage_of)


def _consumes(spec: PipelineSpec, strategy: str) -> dict:
    """The rows the strategy trains on (prepared, or the target's regenerated text) and the upstream stages it
    declares (DFlash: its frozen target and the target's cached features)."""
    cls = strategy_class(strategy)
    data = "regenerated" if cls.training_data(spec) == "regenerated" else "data"
    return {"data": data, "inputs": Roles(tuple(cls.upstream_stages(spec)))}


DECLARATION = Stage(
    name=STAGE,
    task=train_task,
    produces="trained",
    consumes=_consumes,
    per_strategy=True,
    # on a GPU work pool when the YAML names its deployment (a worker runs the same function on the same store)
    task_for=lambda spec: train_remote_task if spec.pipeline.train_deployment else train_task,
)
