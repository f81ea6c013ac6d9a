"""Stage `grpo[strategy]`: GRPO on verifiable rewards, starting from the trained checkpoint (docs/post-training.md,
"The GRPO stage"). Enabled by a `grpo:` section; its own MLflow run (a child of the pipeline's), its own store entry
(the tuned model, in the train stage's checkpoint format), resumable from `store/grpo/<key>.work/checkpoint`.

One step: `grpo.prompts_per_step` training problems, `grpo.group_size` completions each by the strategy's own
sampler (the one `generate` and evaluation use); rewards; advantages relative to each group; then `inner_updates`
optimizer steps of GRPO's clipped objective, each with one corruption draw per group shared by the policy that drew
the rollouts, the reference and the current policy. Every draw of a group (its rollouts, its corruption) comes from
a generator seeded by (seed, step, group[, inner update]), so a resumed stage repeats exactly what the killed one
would have done, and W processes (`train.nproc_per_node`, under torchrun) make the one-process run: each rolls out
every W-th problem of a step and the gradients are summed over them. The step's mechanics are in
`tasks.posttrain.update`; this module runs them as a stage."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dllm_common.checkpoint import checkpoint_digest, recover_checkpoint, write_checkpoint
from dllm_common.config import ConfigError, PipelineSpec, context_overflow, flatten
from dllm_common.store import stage_key
from strategies.models import merge_lora
from tasks.common import StageRef, prefect_task, stage_code_version, store_for, tracking_for
from tasks.data.tokenizer import load_tokenizer
from tasks.devices import resolve_device
from tasks.evaluation.likelihood import encode_prompts
from tasks.posttrain.prompts import prompts_digest, reward_fields, training_prompts
from tasks.posttrain.rewards import Rewards
from tasks.posttrain.update import Policy, load_policy, one_step_of_grpo, step_prompts
from tasks.stages import Stage
from tasks.train import model_dir, run_on_deployment, write_adapter
from tasks.training.distributed import DistInfo, barrier, launch, rank_device, shard_fsdp2
from tasks.training.job import StageJob
from tasks.training.resume import Checkpointer
from tasks.training.runtime import OptimSettings, make_optimizer

STAGE = "grpo"


def grpo_slice(spec: PipelineSpec, strategy: str) -> dict:
    """What decides the tuned model besides the checkpoint: the `grpo:` section and the prompts it draws from (the
    task's training problems, or the prompts file's content)."""
    if spec.grpo.prompts is not None:  # the file's content, not its path, decides the prompts
        source = {"prompts": prompts_digest(spec)}
    else:
        source = {
            "task": spec.data.task.model_dump(mode="json"),
            "split": {"seed": spec.data.seed, "val_fraction": spec.data.val_fraction},
        }
    grpo = {k: v for k, v in spec.grpo.model_dump(mode="json").items() if k != "prompts"}
    return {"strategy": strategy, "grpo": grpo, **source}


def stage_of(spec: PipelineSpec, strategy: str, trained: StageRef, workdir: str, **_) -> tuple[str, str]:
    upstream = {"train": trained.key, "checkpoint": checkpoint_digest(model_dir(trained))}
    return STAGE, stage_key(STAGE, grpo_slice(spec, strategy), upstream, stage_code_version(__name__, strategy))


# ------------------------------------------------------------------ the stage


def _open_run(spec: PipelineSpec, strategy: str, trained: StageRef, workdir: str, key: str, parent_run_id, run_id):
    """The stage's MLflow run: the checkpointed one when resuming, else a new child of the pipeline's run."""
    tracking = tracking_for(spec, workdir)
    if tracking.run_exists(run_id):
        return tracking.reopen(run_id)
    tags = {
        "strategy": strategy,
        "dllm.stage": STAGE,
        "dllm.stage_key": key,
        "dllm.sft_run": trained.mlflow_run_id or "",
    }
    tracker = tracking.start_run(f"grpo-{strategy}", tags, parent_run_id=parent_run_id)
    tracker.log_params(
        {**flatten({"grpo": spec.grpo.model_dump(mode="json")}), "train.key": trained.key, "stage.key": key}
    )
    return tracker


@dataclass(frozen=True, kw_only=True)
class GRPOJob(StageJob):
    """What the stage's processes need: the trained model's descriptor besides the common ones."""

    stage = STAGE
    trained: StageRef

    def _upstream(self) -> dict:
        return {"trained": asdict(self.trained)}

    @classmethod
    def _upstream_from(cls, raw: dict) -> dict:
        return {"trained": StageRef(**raw["trained"])}

    def run(self, out: Path, info: DistInfo) -> dict | None:
        """What each rank runs under torchrun (`tasks.training.torchrun_entry`)."""
        return run_grpo(self, out, info)


def run_grpo(job: GRPOJob, out: Path, info: DistInfo | None = None) -> dict | None:
    """The stage on this process: every rank rolls out its share of each step's problems and the gradients are
    summed over the ranks (`grpo_step`); rank 0 tracks, checkpoints and writes the tuned model into `out`.
    Returns the manifest fields on rank 0, None on the others."""
    spec, strategy, g, info = job.spec, job.strategy, job.spec.grpo, info or DistInfo()
    torch.manual_seed(g.seed)
    policy = load_policy(spec, job.trained, rank_device(resolve_device(spec.train.device), info))
    rewards = Rewards.of(g)
    rows = training_prompts(spec)
    encoded = encode_prompts(policy.tokenizer, [r.prompt for r in rows], chat=True)
    prompt_ids = {r.prompt: ids for r, ids in zip(rows, encoded)}
    settings = OptimSettings(
        steps=g.steps * g.inner_updates, lr=g.lr, warmup_steps=0, schedule="constant", weight_decay=g.weight_decay
    )
    sharded = info.world > 1 and spec.train.parallel == "fsdp2"
    checkpointer = Checkpointer(job.work / "checkpoint", info, sharded=sharded)
    if sharded:  # the policy (and a reference copy) sharded as the train stage shards; rank 0 keeps the structure
        checkpointer.keep_skeleton(policy.model)
        shard_fsdp2(policy.model)
        if policy.reference is not None:
            shard_fsdp2(policy.reference)
    opt, sched = make_optimizer(policy.model, settings)
    start, run_id = checkpointer.restore(policy.model, opt, sched) if checkpointer.exists else (0, None)
    tracker = (
        _open_run(spec, strategy, job.trained, job.workdir, job.key, job.parent_run_id, run_id)
        if info.is_main
        else None
    )
    shown_file = job.work / "rollouts.jsonl"  # the first group of every step (a resumed run keeps the steps before it)
    if info.is_main:
        if start:
            print(f"[dllm-flow] {job.label}: resuming from the step-{start} checkpoint", flush=True)
        kept = [r for r in _read_jsonl(shown_file) if r["step"] < start]
        shown_file.write_text("".join(json.dumps(r) + "\n" for r in kept))
    for step in range(start, g.steps):
        batch = step_prompts(rows, spec, step)
        metrics, first = one_step_of_grpo(policy, opt, spec, rewards, batch, prompt_ids, step, info)
        sched.step()
        if info.is_main:
            _log_step(job, tracker, metrics, step)
            shown = {"step": step, "prompt": batch[0].prompt, "answer": batch[0].answer, "completions": first.texts}
            with shown_file.open("a") as f:
                f.write(json.dumps({**shown, "rewards": first.rewards}) + "\n")
        if (step + 1) % g.checkpoint_every == 0 and step + 1 < g.steps:
            meta = {**policy.meta, "step": step + 1, "mlflow_run_id": tracker.run_id if tracker else None}
            checkpointer.save(policy.model, opt, sched, policy.tokenizer, meta)
    model = checkpointer.full_model(policy.model)  # a collective under FSDP2: the full weights on rank 0
    fields = _publish(spec, strategy, policy, model, tracker, job, out, shown_file) if info.is_main else None
    barrier()
    return fields


def _log_step(job: GRPOJob, tracker, metrics: dict, step: int) -> None:
    g = job.spec.grpo
    if (step + 1) % g.log_every == 0 or step + 1 == g.steps:
        tracker.log_metrics(metrics, step=step + 1)
        print(
            f"[dllm-flow] {job.label} step {step + 1}/{g.steps}: reward {metrics['grpo/reward_mean']:.3f} "
            f"kl {metrics['grpo/kl']:.4f} clip {metrics['grpo/clip_fraction']:.3f} {metrics['grpo/step_s']:.1f} s",
            flush=True,
        )


def _build(job: GRPOJob, out: Path) -> dict:
    """Tune into `out`: in this process, or on `train.nproc_per_node` processes under torchrun (rank 0 writes
    `out` and the manifest fields)."""
    job.work.mkdir(parents=True, exist_ok=True)
    recover_checkpoint(job.work / "checkpoint")  # a checkpoint write killed mid-swap
    if job.spec.train.world_size == 1:
        return run_grpo(job, out)
    job.manifest_file.unlink(missing_ok=True)
    launch(job, out)
    if not job.manifest_file.is_file():
        raise RuntimeError(f"torchrun finished but {job.label} wrote no result into {out}")
    return json.loads(job.manifest_file.read_text())


def _publish(spec: PipelineSpec, strategy: str, policy: Policy, model, tracker, job: GRPOJob, out, shown):
    """The tuned model (`model`: the policy, or its full weights gathered from FSDP2's shards; the train stage's
    checkpoint format, recording where it came from) and the rollouts kept, into `out`; logged, and registered as
    `<pipeline>-<strategy>-grpo`; the manifest fields."""
    g, key, trained = spec.grpo, job.key, job.trained
    meta = {
        **policy.meta,
        "stage_key": key,
        "step": g.steps,
        "mlflow_run_id": tracker.run_id,
        "grpo": {"from": trained.key, **g.model_dump(mode="json")},
    }
    if g.peft is not None:  # the adapter alone too, small enough to ship without the weights it was trained on
        write_adapter(out / "adapter", model, g.peft)
        meta["peft"] = {**g.peft.model_dump(mode="json"), "merged": g.peft.merge}
        if g.peft.merge:
            merge_lora(model)
    write_checkpoint(out / "model", model, policy.tokenizer, meta)
    (out / "rollouts.jsonl").write_text(shown.read_text() if shown.is_file() else "")
    if spec.tracking.log_checkpoints:
        tracker.log_artifact(out / "model", "model")
        if spec.tracking.register_model:
            name = f"{spec.pipeline.name}-{strategy}-grpo"
            tracker.set_tags({"dllm.registered_model": f"{name}/{tracker.register_model(name, 'model')}"})
    tracker.log_artifact(out / "rollouts.jsonl")
    tracker.close()
    return {
        "strategy": strategy,
        "upstream": {"train": trained.key},
        "info": {"mlflow_run_id": tracker.run_id, "from": trained.key},
    }


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def grpo(
    spec: PipelineSpec, strategy: str, trained: StageRef, workdir: str, parent_run_id: str | None = None
) -> StageRef:
    """Tune the trained model with GRPO (or reuse or resume the tuned one)."""
    stage, key = stage_of(spec, strategy, trained, workdir)
    job = GRPOJob(spec=spec, strategy=strategy, trained=trained, workdir=workdir, parent_run_id=parent_run_id, key=key)
    entry, reused = store_for(workdir).reuse_or_build(stage, key, lambda out: _build(job, Path(out)))
    return StageRef.of(entry, reused, f"grpo[{strategy}]")


# ------------------------------------------------------------------ checks before any training


def check_rewards(spec: PipelineSpec) -> None:
    """The prompts read, and every reward resolves and, given a step's prompts with their reference answers as the
    completions (an empty completion where a row has none), returns one finite number per completion: a broken
    reward or prompts file is refused before the SFT, not after it."""
    batch = training_prompts(spec)[: spec.grpo.prompts_per_step]
    said = ["" if r.answer is None else str(r.answer) for r in batch]
    Rewards.of(spec.grpo).score([r.prompt for r in batch], said, reward_fields(batch, [True] * len(batch)))


def check_prompts_fit(spec: PipelineSpec, data: StageRef) -> None:
    """Every training prompt, rendered as a chat turn, plus `grpo.completion_length` fits the model's context."""
    if spec.model.kind != "tiny":
        return  # a pretrained model's context is checked by the evaluate stage's rule on load
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    train = training_prompts(spec)
    lengths = [len(ids) for ids in encode_prompts(tokenizer, [r.prompt for r in train], chat=True)]
    longest = max(range(len(train)), key=lengths.__getitem__)
    problem = context_overflow(
        lengths[longest],
        spec.grpo.completion_length,
        spec.data.seq_len,
        prompt=f"the training prompt {train[longest].prompt!r}",
        new="grpo.completion_length",
        context_of="the model's context (data.seq_len)",
    )
    if problem:
        raise ConfigError(f"{problem} (grpo's rollouts)")


def grpo_on_deployment(
    spec: PipelineSpec, strategy: str, trained: StageRef, workdir: str, parent_run_id: str | None = None
) -> StageRef:
    """Submit the stage to `pipeline.grpo_deployment` (a GPU work pool) and wait for it: the worker runs `grpo`
    (same function, same store, same key)."""
    store = store_for(workdir)
    stage, key = stage_of(spec, strategy, trained, workdir)
    if (hit := store.lookup(stage, key)) is not None:
        return StageRef.of(hit, True, f"grpo[{strategy}]")
    parameters = {
        "spec": spec.model_dump(mode="json"),
        "strategy": strategy,
        "trained": asdict(trained),
        "workdir": str(Path(workdir).resolve()),
        "parent_run_id": parent_run_id,
    }
    entry = run_on_deployment(spec.pipeline.grpo_deployment, parameters, f"grpo[{strategy}]", store, stage, key)
    return StageRef.of(entry, False, f"grpo[{strategy}]")


grpo_task = prefect_task(grpo, name="grpo", stage_of=stage_of)
grpo_remote_task = prefect_task(grpo_on_deployment, name="grpo", stage_of=stage_of)

DECLARATION = Stage(
    name=STAGE,
    task=grpo_task,
    produces="tuned",
    consumes={"trained": "trained"},
    per_strategy=True,
    enabled=lambda spec: spec.grpo is not None,
    leader_only=True,
    checks=(((), check_rewards), (("data",), check_prompts_fit)),
    # on a GPU work pool when the YAML names its deployment (a worker runs the same function on the same store)
    task_for=lambda spec: grpo_remote_task if spec.pipeline.grpo_deployment else grpo_task,
)
