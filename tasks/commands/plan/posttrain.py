"""The GRPO stage in `dllm-flow plan` (docs/post-training.md, "The GRPO stage"): one group's update traced on fake
tensors through the stage's own estimator and objective (`tasks.posttrain.grpo.token_logps` and `policy_loss`, or
SPG's `update_terms`), one no-grad forward of a group for the rollouts' and the reference's passes, and the memory
the stage holds: the policy with its gradients and AdamW moments (the train stage's `Resident`), plus the frozen
reference when `grpo.beta` is not 0. Rollout FLOPs assume a full forward per sampler step (no K/V reuse), an upper
bound."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_common.config import PipelineSpec
from tasks.commands.plan.estimate import DEFAULT_FLOPS, Cluster, StrategyPlan
from tasks.commands.plan.step import Planner
from tasks.commands.plan.trace import count, size
from tasks.posttrain.grpo_loss import policy_loss
from tasks.posttrain.update import Group, Policy, token_logps, update_terms


def views(g) -> int:
    """Forwards of a group per estimate."""
    return {"coupled": 3, "elbo_eubo": g.likelihood_draws}.get(g.estimator, 1)


@dataclass(frozen=True)
class GRPOPlan:
    strategy: str
    rows: int  # rows one group's update forwards (G × the estimator's views)
    canvas: int  # tokens per row: the longest prompt the stage accepts + grpo.completion_length
    resident: int  # policy weights, gradients and AdamW moments, and the reference's weights
    reference: int
    activations: int  # one group's update: forward, estimate, loss, backward
    peak: int
    step_flops: float  # one GRPO step: rollouts, the old and reference passes, the updates, over every group
    step_seconds: float


def plan_grpo(spec: PipelineSpec, trained: StrategyPlan, cluster: Cluster) -> GRPOPlan:
    g, name = spec.grpo, trained.strategy
    planner = Planner(spec, name)
    trainee = planner.builder.build(False, False)  # the stage scores with full logits (the denoiser samplers use)
    model = trainee.model
    policy = Policy(model, None, trainee.strategy, None, trainee.mask_token_id, {}, "cpu", g.estimator)
    canvas = spec.data.seq_len  # the prompt-length check admits prompts up to seq_len − completion_length
    with planner.tracer:
        prompt = torch.zeros(g.group_size, canvas - g.completion_length, dtype=torch.long)
        completion = torch.ones(g.group_size, g.completion_length, dtype=torch.long)
        group = Group(prompt, completion, torch.ones(completion.shape), torch.zeros(g.group_size), [], [], {}, [], [])

    def update():
        if g.estimator == "elbo_eubo":  # SPG: no ratio, no reference
            update_terms(policy, group, 0, spec).loss.backward()
            return
        logp = token_logps(policy, model, group, 0, spec)
        reference = logp.detach() if g.beta else None
        policy_loss(logp, logp.detach(), reference, group.advantages, group.mask, g.clip_eps, g.beta).loss.backward()

    def forward():
        with torch.no_grad():
            policy.scorer(model)(torch.cat([prompt, completion], dim=1), None)

    step, one = planner.trace_call(model, update), planner.trace_call(model, forward)
    old = g.inner_updates if g.inner_updates > 1 and g.estimator != "elbo_eubo" else 0  # SPG has no ratio
    passes = old + (g.inner_updates if g.beta else 0)
    per_group = g.sample_steps * one.flops + passes * views(g) * one.flops + g.inner_updates * step.flops
    res = trained.resident
    reference = res.weights if g.beta and g.peft is None else 0  # under LoRA: the adapter-off policy
    resident = res.weights + res.gradients + res.optimizer + res.update + reference
    flops = cluster.flops or DEFAULT_FLOPS[spec.train.precision]
    return GRPOPlan(
        strategy=name,
        rows=g.group_size * views(g),
        canvas=canvas,
        resident=resident,
        reference=reference,
        activations=step.peak,
        peak=resident + max(step.peak, one.peak),
        step_flops=g.prompts_per_step * per_group,
        step_seconds=g.prompts_per_step * per_group / (flops * cluster.mfu),
    )


def grpo_table(spec: PipelineSpec, cluster: Cluster, plans: list[StrategyPlan]) -> list[str]:
    """The GRPO stage's lines of the plan (none without a `grpo:` section)."""
    if spec.grpo is None:
        return []
    g = spec.grpo
    lines = [
        "",
        f"GRPO (grpo:, one process): {g.prompts_per_step} prompts × {g.group_size} completions a step, "
        f"{g.completion_length} tokens in {g.sample_steps} sampler steps, estimator {g.estimator}, "
        f"μ = {g.inner_updates}{', reference loaded (β > 0)' if g.beta else ''}",
        "",
        "| strategy | rows per update × canvas | resident (policy + AdamW + reference) | update activations | peak "
        "| FLOPs per step | step |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        q = plan_grpo(spec, p, cluster)
        lines.append(
            f"| {q.strategy} | {q.rows} × {q.canvas} | {size(q.resident)} (reference {size(q.reference)}) "
            f"| {size(q.activations)} | {size(q.peak)} | {count(q.step_flops)} | {q.step_seconds:.3g} s |"
        )
    return lines
