"""One GRPO step's mechanics (docs/post-training.md, "The GRPO stage"): the policy being tuned and its reference,
one prompt's rollouts by the strategy's own sampler, the likelihood estimate of a group under a model, its loss
(GRPO's clipped ratio and KL, or SPG's bounds), the inner updates with gradients summed over torch.distributed ranks,
and the metrics a step logs. `tasks.posttrain.grpo` runs them as a stage."""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from dllm_common.config import PipelineSpec, TrainingDiverged
from strategies.base_evaluation import SampleRequest
from strategies.models import adapters_off, add_lora, backbone_lm, merge_lora
from strategies.sampling import SamplerConfig, trim_at_eos
from tasks.common import StageRef
from tasks.evaluation.trained_model import load_for_generation, load_trained_model
from tasks.posttrain.estimators import ESTIMATORS, elbo_eubo
from tasks.posttrain.grpo_loss import PolicyTerms, completion_mask, group_advantages, policy_loss, sandwich_loss
from tasks.posttrain.prompts import PromptRow, reward_fields
from tasks.posttrain.rewards import Rewards
from tasks.train import model_dir
from tasks.training.distributed import DistInfo


def _seed(*parts) -> int:
    """A generator seed from (grpo.seed, step, group, …): the same draws on any rank, in any resumed run."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def step_prompts(rows: list[PromptRow], spec: PipelineSpec, step: int) -> list[PromptRow]:
    """The prompts of rollout batch `step`: the training prompts in an order drawn from `grpo.seed`, cycled."""
    g = spec.grpo
    order = list(range(len(rows)))
    random.Random(g.seed).shuffle(order)
    start = step * g.prompts_per_step
    return [rows[order[(start + i) % len(order)]] for i in range(g.prompts_per_step)]


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

    @contextlib.contextmanager
    def reference_model(self):
        """The frozen reference: its own copy of the trained model, or under LoRA the policy with its adapters off."""
        if self.reference is not None:
            yield self.reference
        else:
            with adapters_off(self.model) as base:
                yield base

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


@contextlib.contextmanager
def gathered(model):
    """Under FSDP2, the weights stay gathered for the rollouts: a sampler stops once every row has ended, so ranks
    run different numbers of forwards, which per-forward all-gathers cannot survive. Each unit gathers on the first
    forward (every rank runs at least one) and keeps its weights until the rollouts are done — what DeepSpeed's
    ZeRO-3 does for generation (TRL's `ds3_gather_for_generation`)."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
            unit.reshard()
        model.set_reshard_after_forward(True)


def rollouts(policy: Policy, spec: PipelineSpec, rewards: Rewards, row: PromptRow, prompt_ids, seed: int) -> Group:
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
    with gathered(policy.model):
        result = policy.strategy.sample(policy.model.eval(), request)
    raw = [result.generated(i) for i in range(g.group_size)]
    completion = torch.stack([r[: g.completion_length] for r in raw]).to(policy.device)
    ended = [bool((r == tok.eos_token_id).any()) for r in completion]
    texts = [tok.decode(trim_at_eos(r, tok.eos_token_id)) for r in completion]
    total, each = rewards.score([row.prompt] * len(texts), texts, reward_fields([row] * len(texts), ended))
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


def sandwich_terms(policy: Policy, model, group: Group, seed: int, spec: PipelineSpec) -> PolicyTerms:
    """SPG's loss of one group under `model`: its ELBO and EUBO from block-wise views drawn from `seed`."""
    g = spec.grpo
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    block = g.sample_block_size or g.completion_length  # the rollouts' blocks
    bounds = elbo_eubo(
        policy.scorer(model), group.prompt, group.completion, policy.mask_id, gen, group.mask, block,
        g.likelihood_draws, g.eubo_beta,
    )  # fmt: skip
    return sandwich_loss(*bounds, group.advantages, group.mask, g.mix_weight)


def update_terms(policy: Policy, group: Group, seed: int, spec: PipelineSpec, old=None, ref=None) -> PolicyTerms:
    """One group's loss under the current policy: GRPO's clipped ratio (with `old`, the drawing policy's values,
    None: the current pass's own, detached) and KL to `ref`, or SPG's bounds for `elbo_eubo`."""
    g = spec.grpo
    if g.estimator == "elbo_eubo":
        return sandwich_terms(policy, policy.model, group, seed, spec)
    logp = token_logps(policy, policy.model, group, seed, spec)
    return policy_loss(
        logp, logp.detach() if old is None else old, ref, group.advantages, group.mask, g.clip_eps, g.beta
    )


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
    # FSDP2 averages the gradients it reduce-scatters over the ranks: scaled by W, that average is the sum
    sharded = isinstance(policy.model, FSDPModule)
    scale = world if sharded else 1
    seeds = [[_seed(g.seed, "corrupt", step, k, i) for i in indices] for k in range(g.inner_updates)]
    with torch.no_grad():  # the policy that drew the rollouts and the reference, at every update's corruption
        # with one update the policy that drew them is the current one at the same draw: its values are the
        # current pass's own, detached below, and need no forward of their own (what `dllm-flow plan` counts)
        old = (
            [[token_logps(policy, policy.model, gr, s, spec) for gr, s in zip(groups, row)] for row in seeds]
            if g.inner_updates > 1 and g.estimator != "elbo_eubo"  # SPG has no ratio
            else None
        )
        ref = None
        if g.beta:
            with policy.reference_model() as reference:
                ref = [[token_logps(policy, reference, gr, s, spec) for gr, s in zip(groups, row)] for row in seeds]
    losses, kls, clips, norms = [], [], [], []
    params = [p for p in policy.model.parameters() if p.requires_grad]
    for k in range(g.inner_updates):
        opt.zero_grad(set_to_none=False)
        for i, (group, seed) in enumerate(zip(groups, seeds[k])):
            terms = update_terms(policy, group, seed, spec, old[k][i] if old else None, ref[k][i] if ref else None)
            (terms.loss * scale / total).backward()
            losses.append(float(terms.loss.detach()))
            kls.append(terms.kl)
            clips.append(terms.clip_fraction)
        if world > 1 and not sharded:
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


def load_policy(spec: PipelineSpec, trained: StageRef, device: str) -> Policy:
    ckpt, peft = model_dir(trained), spec.grpo.peft
    loaded = load_for_generation(ckpt, device)
    model = loaded.model.eval()  # eval mode throughout: no dropout, so the ratio is 1 before the first update
    reference = None
    if peft is not None:  # the adapter-off model is the reference: the trained model, an SFT adapter merged into it
        if getattr(backbone_lm(model).config, "dllm_lora", None):
            merge_lora(model)
        add_lora(
            backbone_lm(model), r=peft.r, alpha=peft.alpha, dropout=peft.dropout, target_modules=peft.target_modules
        )
        for name, param in model.named_parameters():
            param.requires_grad = "lora_" in name
    elif spec.grpo.beta:
        reference = load_trained_model(ckpt, device).requires_grad_(False)
    return Policy(
        model, reference, loaded.strategy, loaded.tokenizer, loaded.mask_id, loaded.meta, device, spec.grpo.estimator
    )


def _gathered(groups: list[Group], update: dict, info: DistInfo) -> tuple[list[Group], dict]:
    """Every rank's groups (what the rollout metrics need, in the step's order) and the update metrics averaged
    over groups, on every rank alike (each decides the same: log, stop on a non-finite loss)."""
    if info.world == 1:
        return groups, update
    kept = [Group(None, None, None, None, gr.texts, gr.rewards, gr.each, gr.ended, gr.lengths) for gr in groups]
    shares: list = [None] * info.world
    dist.all_gather_object(shares, (kept, update))
    ordered = [shares[i % info.world][0][i // info.world] for i in range(sum(len(k) for k, _ in shares))]
    weights = [len(k) for k, _ in shares]
    mean = {name: sum(w * u[name] for w, (_, u) in zip(weights, shares)) / sum(weights) for name in update}
    return ordered, mean


def one_step_of_grpo(policy: Policy, opt, spec: PipelineSpec, rewards: Rewards, batch, prompt_ids, step: int, info):
    """Rollouts of this rank's prompts of the step (rank r: prompts r, r + W, …), then the updates: (the step's
    metrics over every rank, the first group's completions and rewards)."""
    g = spec.grpo
    t0 = time.perf_counter()
    mine = list(range(info.rank, len(batch), info.world))
    groups = [
        rollouts(policy, spec, rewards, batch[i], prompt_ids[batch[i].prompt], _seed(g.seed, "rollout", step, i))
        for i in mine
    ]
    t1 = time.perf_counter()
    update = grpo_step(policy, opt, spec, groups, step, mine if info.world > 1 else None)
    everyone, update = _gathered(groups, update, info)
    metrics = {**rollout_metrics(everyone), **update}
    if not math.isfinite(metrics["grpo/loss"]) or not math.isfinite(metrics["grpo/grad_norm"]):
        raise TrainingDiverged(
            f"grpo step {step + 1}: the loss or gradient norm is not finite (loss {metrics['grpo/loss']}, gradient "
            f"norm {metrics['grpo/grad_norm']}); lower grpo.lr ({g.lr}) or raise grpo.beta ({g.beta}); nothing "
            "was published, and the last checkpoint is kept"
        )
    end = time.perf_counter()
    timing = {"grpo/rollout_s": t1 - t0, "grpo/update_s": end - t1, "grpo/step_s": end - t0}
    return {**metrics, **timing}, everyone[0]
