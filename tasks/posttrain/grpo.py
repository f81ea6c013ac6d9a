"""Stage `grpo[strategy]`: GRPO on verifiable rewards, starting from the trained checkpoint (docs/post-training.md,
"The GRPO stage"). Enabled by a `grpo:` section; its own MLflow run (a child of the pipeline's), its own store entry
(the tuned model, in the train stage's checkpoint format), resumable from `store/grpo/<key>.work/checkpoint`.

One step: `grpo.prompts_per_step` training problems, `grpo.group_size` completions each by the strategy's own
sampler (the one `generate` and evaluation use); rewards; advantages relative to each group; then `inner_updates`
optimizer steps of GRPO's clipped objective, each with one corruption draw per group shared by the policy that drew
the rollouts, the reference and the current policy. Every draw of a group (its rollouts, its corruption) comes from
a generator seeded by (seed, step, group[, inner update]), so a resumed stage repeats exactly what the killed one
would have done."""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dllm_common.checkpoint import checkpoint_digest, recover_checkpoint, write_checkpoint
from dllm_common.config import ConfigError, PipelineSpec, TrainingDiverged, context_overflow, flatten
from dllm_common.store import stage_key
from strategies.base_evaluation import SampleRequest
from strategies.sampling import SamplerConfig, trim_at_eos
from tasks.common import StageRef, prefect_task, stage_code_version, store_for, tracking_for
from tasks.data.tokenizer import load_tokenizer
from tasks.devices import resolve_device
from tasks.evaluation.chat import split_problems
from tasks.evaluation.likelihood import encode_prompts
from tasks.evaluation.trained_model import load_for_generation, load_trained_model
from tasks.posttrain.estimators import ESTIMATORS
from tasks.posttrain.families import Problem
from tasks.posttrain.grpo_loss import completion_mask, group_advantages, policy_loss
from tasks.posttrain.rewards import Rewards
from tasks.stages import Stage
from tasks.train import model_dir
from tasks.training.distributed import DistInfo
from tasks.training.resume import Checkpointer
from tasks.training.runtime import OptimSettings, make_optimizer

STAGE = "grpo"


def grpo_slice(spec: PipelineSpec, strategy: str) -> dict:
    """What decides the tuned model besides the checkpoint: the `grpo:` section and the task it draws prompts from."""
    return {
        "strategy": strategy,
        "grpo": spec.grpo.model_dump(mode="json"),
        "task": spec.data.task.model_dump(mode="json"),
        "split": {"seed": spec.data.seed, "val_fraction": spec.data.val_fraction},
    }


def stage_of(spec: PipelineSpec, strategy: str, trained: StageRef, workdir: str, **_) -> tuple[str, str]:
    upstream = {"train": trained.key, "checkpoint": checkpoint_digest(model_dir(trained))}
    return STAGE, stage_key(STAGE, grpo_slice(spec, strategy), upstream, stage_code_version(__name__, strategy))


def _seed(*parts) -> int:
    """A generator seed from (grpo.seed, step, group, …): the same draws on any rank, in any resumed run."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def step_problems(problems: list[Problem], spec: PipelineSpec, step: int) -> list[Problem]:
    """The problems of rollout batch `step`: the training problems in an order drawn from `grpo.seed`, cycled."""
    g = spec.grpo
    order = list(range(len(problems)))
    random.Random(g.seed).shuffle(order)
    start = step * g.prompts_per_step
    return [problems[order[(start + i) % len(order)]] for i in range(g.prompts_per_step)]


@dataclass
class Policy:
    """The model being tuned with its strategy and tokenizer, the frozen reference, and the estimator's scorer."""

    model: torch.nn.Module
    reference: torch.nn.Module | None
    strategy: object
    tokenizer: object
    mask_id: int | None
    meta: dict
    device: str
    estimator: str = "one_step"

    def scorer(self, model):
        """What the estimator forwards: the strategy's denoiser, or its causal path for `exact_ar`."""
        return (
            self.strategy.evaluator.causal_logits(model)
            if self.estimator == "exact_ar"
            else self.strategy.denoiser(model)
        )


@dataclass
class Group:
    """One prompt's rollouts: prompt ids [G, Lp], completions [G, L], their mask and advantages, what is logged."""

    prompt: torch.Tensor
    completion: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    texts: list[str]
    rewards: list[float]
    each: dict[str, list[float]]
    ended: list[bool]
    lengths: list[int]


def rollouts(policy: Policy, spec: PipelineSpec, rewards: Rewards, problem: Problem, prompt_ids, seed: int) -> Group:
    """G completions of one prompt by the strategy's sampler, scored and turned into advantages."""
    g, tok = spec.grpo, policy.tokenizer
    cfg = SamplerConfig(
        steps=g.sample_steps,
        max_new_tokens=g.completion_length,
        block_size=g.sample_block_size or g.completion_length,
        temperature=g.temperature,
        eos_token_id=tok.eos_token_id,
        logit_shift=policy.strategy.logit_shift,
    )
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    request = SampleRequest([prompt_ids] * g.group_size, policy.mask_id, tok.pad_token_id or 0, cfg, gen, policy.device)
    result = policy.strategy.sample(policy.model.eval(), request)
    raw = [result.generated(i) for i in range(g.group_size)]
    completion = torch.stack([r[: g.completion_length] for r in raw]).to(policy.device)
    ended = [bool((r == tok.eos_token_id).any()) for r in completion]
    texts = [tok.decode(trim_at_eos(r, tok.eos_token_id)) for r in completion]
    fields = {"problem": [problem] * len(texts), "answer": [problem.answer] * len(texts), "ended": ended}
    total, each = rewards.score([problem.prompt] * len(texts), texts, fields)
    mask = completion_mask(completion, tok.eos_token_id)
    prompt = torch.tensor([prompt_ids] * g.group_size, device=policy.device)
    advantages = group_advantages(torch.tensor(total), g.group_size, g.scale_rewards).to(policy.device)
    lengths = [int(m.sum()) - int(e) for m, e in zip(mask, ended)]  # tokens before the EOS
    return Group(prompt, completion, mask, advantages, texts, total, each, ended, lengths)


def token_logps(policy: Policy, model, group: Group, seed: int, spec: PipelineSpec) -> torch.Tensor:
    """The estimator's per-token log-probabilities of the group's completions under `model`, corruption from `seed`."""
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    fn = ESTIMATORS[spec.grpo.estimator]
    extra = {"p_mask_prompt": spec.grpo.p_mask_prompt} if spec.grpo.estimator == "one_step" else {}
    return fn(policy.scorer(model), group.prompt, group.completion, policy.mask_id, gen, **extra)


def grpo_step(
    policy: Policy, opt, spec: PipelineSpec, groups: list[Group], step: int, indices: list[int] | None = None
) -> dict:
    """`inner_updates` optimizer steps on one batch of rollouts; what they log.

    Under torch.distributed each rank holds a share of the step's groups (`indices`: their numbers in the step, which
    seed their corruption draws) and the gradients are summed over the ranks before each optimizer step: every
    group weighs 1 / (groups in the step) wherever it ran, so W processes make the one-process update."""
    g = spec.grpo
    indices = list(range(len(groups))) if indices is None else indices
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    total = g.prompts_per_step if world > 1 else len(groups)
    seeds = [[_seed(g.seed, "corrupt", step, k, i) for i in indices] for k in range(g.inner_updates)]
    with torch.no_grad():  # the policy that drew the rollouts and the reference, at every update's corruption
        # with one update the policy that drew them is the current one at the same draw: its values are the
        # current pass's own, detached below, and need no forward of their own (what `dllm-flow plan` counts)
        old = (
            [[token_logps(policy, policy.model, gr, s, spec) for gr, s in zip(groups, row)] for row in seeds]
            if g.inner_updates > 1
            else None
        )
        ref = (
            [[token_logps(policy, policy.reference, gr, s, spec) for gr, s in zip(groups, row)] for row in seeds]
            if g.beta
            else None
        )
    losses, kls, clips, norms = [], [], [], []
    params = [p for p in policy.model.parameters() if p.requires_grad]
    for k in range(g.inner_updates):
        opt.zero_grad(set_to_none=False)
        for i, (group, seed) in enumerate(zip(groups, seeds[k])):
            logp = token_logps(policy, policy.model, group, seed, spec)
            before = old[k][i] if old else logp.detach()
            terms = policy_loss(
                logp, before, ref[k][i] if ref else None, group.advantages, group.mask, g.clip_eps, g.beta
            )
            (terms.loss / total).backward()
            losses.append(float(terms.loss.detach()))
            kls.append(terms.kl)
            clips.append(terms.clip_fraction)
        if world > 1:
            for p in params:
                if p.grad is None:  # a parameter no group reached on this rank
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, g.grad_clip)))
        opt.step()
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return {
        "grpo/loss": mean(losses),
        "grpo/kl": mean(kls),
        "grpo/clip_fraction": mean(clips),
        "grpo/grad_norm": mean(norms),
    }


def rollout_metrics(groups: list[Group]) -> dict:
    rewards = torch.tensor([r for gr in groups for r in gr.rewards])
    out = {
        "grpo/reward_mean": float(rewards.mean()),
        "grpo/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "grpo/completion_length": sum(sum(gr.lengths) for gr in groups) / sum(len(gr.lengths) for gr in groups),
        "grpo/eos_rate": sum(sum(gr.ended) for gr in groups) / sum(len(gr.ended) for gr in groups),
        # groups whose completions all got one reward: advantage 0 everywhere, nothing learnt from them
        "grpo/flat_groups": sum(len(set(gr.rewards)) == 1 for gr in groups) / len(groups),
    }
    for name in groups[0].each:
        values = [v for gr in groups for v in gr.each[name]]
        out[f"grpo/reward_{name}"] = sum(values) / len(values)
    if "task_answer" in groups[0].each:
        out["grpo/accuracy"] = out["grpo/reward_task_answer"]
    return out


# ------------------------------------------------------------------ the stage


def load_policy(spec: PipelineSpec, trained: StageRef, device: str) -> Policy:
    ckpt = model_dir(trained)
    loaded = load_for_generation(ckpt, device)
    reference = None
    if spec.grpo.beta:
        reference = load_trained_model(ckpt, device).requires_grad_(False)
    model = loaded.model.eval()  # eval mode throughout: no dropout, so the ratio is 1 before the first update
    return Policy(
        model, reference, loaded.strategy, loaded.tokenizer, loaded.mask_id, loaded.meta, device, spec.grpo.estimator
    )


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


def one_step_of_grpo(policy: Policy, opt, spec: PipelineSpec, rewards: Rewards, batch, prompt_ids, step: int):
    """Rollouts of every problem of the step, then the updates: (the step's metrics, its groups)."""
    g = spec.grpo
    t0 = time.perf_counter()
    groups = [
        rollouts(policy, spec, rewards, p, prompt_ids[p.prompt], _seed(g.seed, "rollout", step, i))
        for i, p in enumerate(batch)
    ]
    t1 = time.perf_counter()
    metrics = {**rollout_metrics(groups), **grpo_step(policy, opt, spec, groups, step)}
    if not math.isfinite(metrics["grpo/loss"]) or not math.isfinite(metrics["grpo/grad_norm"]):
        raise TrainingDiverged(
            f"grpo step {step + 1}: the loss or gradient norm is not finite (loss {metrics['grpo/loss']}, gradient "
            f"norm {metrics['grpo/grad_norm']}); lower grpo.lr ({g.lr}) or raise grpo.beta ({g.beta}); nothing "
            "was published, and the last checkpoint is kept"
        )
    end = time.perf_counter()
    return {**metrics, "grpo/rollout_s": t1 - t0, "grpo/update_s": end - t1, "grpo/step_s": end - t0}, groups


def run_grpo(spec: PipelineSpec, strategy: str, trained: StageRef, workdir: str, parent_run_id, key: str, out: Path):
    g = spec.grpo
    torch.manual_seed(g.seed)
    policy = load_policy(spec, trained, resolve_device(spec.train.device))
    rewards = Rewards.of(g)
    problems, _ = split_problems(spec)
    encoded = encode_prompts(policy.tokenizer, [p.prompt for p in problems], chat=True)
    prompt_ids = {p.prompt: ids for p, ids in zip(problems, encoded)}
    settings = OptimSettings(
        steps=g.steps * g.inner_updates, lr=g.lr, warmup_steps=0, schedule="constant", weight_decay=g.weight_decay
    )
    opt, sched = make_optimizer(policy.model, settings)
    work = store_for(workdir).work_dir(STAGE, key)
    work.mkdir(parents=True, exist_ok=True)
    recover_checkpoint(work / "checkpoint")
    checkpointer = Checkpointer(work / "checkpoint", DistInfo(), sharded=False)
    start, run_id = checkpointer.restore(policy.model, opt, sched) if checkpointer.exists else (0, None)
    tracker = _open_run(spec, strategy, trained, workdir, key, parent_run_id, run_id)
    if start:
        print(f"[dllm-flow] grpo[{strategy}]: resuming from the step-{start} checkpoint", flush=True)
    shown_file = work / "rollouts.jsonl"  # the first group of every step (a resumed run keeps the steps before it)
    kept = [r for r in _read_jsonl(shown_file) if r["step"] < start]
    shown_file.write_text("".join(json.dumps(r) + "\n" for r in kept))
    for step in range(start, g.steps):
        batch = step_problems(problems, spec, step)
        metrics, groups = one_step_of_grpo(policy, opt, spec, rewards, batch, prompt_ids, step)
        sched.step()
        if (step + 1) % g.log_every == 0 or step + 1 == g.steps:
            tracker.log_metrics(metrics, step=step + 1)
            print(
                f"[dllm-flow] grpo[{strategy}] step {step + 1}/{g.steps}: reward {metrics['grpo/reward_mean']:.3f} "
                f"kl {metrics['grpo/kl']:.4f} clip {metrics['grpo/clip_fraction']:.3f} {metrics['grpo/step_s']:.1f} s",
                flush=True,
            )
        first = {"step": step, "prompt": batch[0].prompt, "answer": batch[0].answer, "completions": groups[0].texts}
        with shown_file.open("a") as f:
            f.write(json.dumps({**first, "rewards": groups[0].rewards}) + "\n")
        if (step + 1) % g.checkpoint_every == 0 and step + 1 < g.steps:
            meta = {**policy.meta, "step": step + 1, "mlflow_run_id": tracker.run_id}
            checkpointer.save(policy.model, opt, sched, policy.tokenizer, meta)
    return _publish(spec, strategy, policy, tracker, trained, key, out, shown_file)


def _publish(spec: PipelineSpec, strategy: str, policy: Policy, tracker, trained: StageRef, key: str, out, shown):
    """The tuned model (the train stage's checkpoint format, recording where it came from) and the rollouts kept, into
    `out`; logged, and registered as `<pipeline>-<strategy>-grpo`; the manifest fields."""
    g = spec.grpo
    meta = {
        **policy.meta,
        "stage_key": key,
        "step": g.steps,
        "mlflow_run_id": tracker.run_id,
        "grpo": {"from": trained.key, **g.model_dump(mode="json")},
    }
    write_checkpoint(out / "model", policy.model, policy.tokenizer, meta)
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
    entry, reused = store_for(workdir).reuse_or_build(
        stage, key, lambda out: run_grpo(spec, strategy, trained, workdir, parent_run_id, key, Path(out))
    )
    return StageRef.of(entry, reused, f"grpo[{strategy}]")


# ------------------------------------------------------------------ checks before any training


def check_rewards(spec: PipelineSpec) -> None:
    """Every reward resolves and, given each of a step's problems with its reference answer as the completion,
    returns one finite number per completion: a broken reward is refused before the SFT, not after it."""
    g = spec.grpo
    train, _ = split_problems(spec)
    if not train:
        raise ConfigError("grpo: the task has no training problem to draw prompts from; raise data.task.problems")
    batch = train[: g.prompts_per_step]
    fields = {"problem": batch, "answer": [p.answer for p in batch], "ended": [True] * len(batch)}
    Rewards.of(g).score([p.prompt for p in batch], [p.answer for p in batch], fields)


def check_prompts_fit(spec: PipelineSpec, data: StageRef) -> None:
    """Every training prompt, rendered as a chat turn, plus `grpo.completion_length` fits the model's context."""
    if spec.model.kind != "tiny":
        return  # a pretrained model's context is checked by the evaluate stage's rule on load
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    train, _ = split_problems(spec)
    lengths = [len(ids) for ids in encode_prompts(tokenizer, [p.prompt for p in train], chat=True)]
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


grpo_task = prefect_task(grpo, name="grpo", stage_of=stage_of)

DECLARATION = Stage(
    name=STAGE,
    task=grpo_task,
    produces="tuned",
    consumes={"trained": "trained"},
    per_strategy=True,
    enabled=lambda spec: spec.grpo is not None,
    leader_only=True,
    checks=(((), check_rewards), (("data",), check_prompts_fit)),
)
