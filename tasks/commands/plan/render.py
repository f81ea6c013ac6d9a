"""What `dllm-flow plan` prints, and the command line's quantities (GPU memory, FLOP/s, the warning before `run`)."""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from dllm_common.config import ConfigError, PipelineSpec
from strategies import strategy_class
from tasks.commands.plan.estimate import (
    CONTEXT_RESERVE,
    DEFAULT_FLOPS,
    DEFAULT_MFU,
    FRAGMENTATION,
    VARIANTS,
    Cluster,
    StrategyPlan,
    plan_strategy,
)
from tasks.commands.plan.measured import header_lines, step_cost_for
from tasks.commands.plan.posttrain import grpo_table
from tasks.commands.plan.trace import Untraceable, count, plural, size

# ------------------------------------------------------------------ what is printed


def _switches(fused: bool, ckpt: bool) -> str:
    return f"{'fused head' if fused else 'full logits'}{', checkpointing' if ckpt else ''}"


def render(spec: PipelineSpec, cluster: Cluster, plans: list[StrategyPlan], source: str = "") -> str:
    """The plan as printed: what it is for, then memory per GPU, activations per memory setting and compute, one
    table each, then the notes."""
    lines = _header(spec, cluster, plans, source) + _memory_table(cluster, plans)
    lines += _activation_table(plans) + _compute_table(spec, cluster, plans) + grpo_table(spec, cluster, plans)
    notes = _notes(spec, cluster, plans)
    return "\n".join(lines + ([""] + notes if notes else []))


def _header(spec: PipelineSpec, cluster: Cluster, plans: list[StrategyPlan], source: str) -> list[str]:
    t, lay = spec.train, plans[0].layout
    flops = cluster.flops or DEFAULT_FLOPS[t.precision]
    precision = "bf16 autocast (fp32 weights and AdamW)" if t.precision == "bf16" else "fp32"
    parallel = {"single": "one process", "ddp": "DDP", "fsdp2": "FSDP2"}[lay.parallel]
    memory = "memory not given" if cluster.memory is None else f"{size(cluster.memory)} each"
    return [
        f"dllm-flow plan{' ' + source if source else ''}: {model_name(spec)}, sequence {spec.data.seq_len}, "
        f"{precision}",
        f"{cluster.gpus} × {cluster.device.upper()} ({memory}), {parallel}; global batch {t.global_batch_size} = "
        f"{plural(lay.world, 'rank')} × {plural(lay.micro_batches, 'micro-batch')} × {plural(lay.rows, 'row')}",
        f"time at {cluster.mfu:.0%} of {count(flops)}FLOP/s per GPU (an assumed utilization of the counted FLOPs; "
        "benchmarks/gpu_check.py measures it)",
        *header_lines(cluster.step_cost, [p.strategy for p in plans], t.precision),
    ]


def _memory_table(cluster: Cluster, plans: list[StrategyPlan]) -> list[str]:
    lines = [
        "",
        "Memory per GPU at the configured settings (activations: the step's peak of activations, logits and loss "
        "scratch; peak: everything at the step's highest point, forward/backward or the optimizer update)",
        "",
        "| strategy | settings | trained params | weights | gradients | AdamW | frozen | working set | activations "
        "| peak | fits | largest micro-batch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    usable = cluster.usable()
    for p in plans:
        r = p.resident
        fits = "?" if usable is None else ("yes" if p.peak <= usable else "**no**")
        largest = "?" if p.max_rows is None else str(p.max_rows)
        lines.append(
            f"| {p.strategy} | {_switches(*p.configured)} | {count(r.trainable)} | {size(r.weights)} "
            f"| {size(r.gradients)} | {size(r.optimizer)} | {size(r.frozen) if r.frozen else '-'} "
            f"| {size(r.working) if r.working else '-'} | {size(p.step_activations)} | {size(p.peak)} "
            f"| {fits} | {largest} |"
        )
    return lines


def _activation_table(plans: list[StrategyPlan]) -> list[str]:
    lines = [
        "",
        f"Activations of one micro-batch of {plural(plans[0].layout.rows, 'row')}, per memory setting (n/a: the "
        "strategy or model has no such setting)",
        "",
        "| strategy | fused head | full logits | fused head + checkpointing | full logits + checkpointing |",
        "|---|---|---|---|---|",
    ]
    for p in plans:
        cells = " | ".join(size(p.activations.get(v)) for v in VARIANTS)
        lines.append(f"| {p.strategy} | {cells} |")
    return lines


def _compute_table(spec: PipelineSpec, cluster: Cluster, plans: list[StrategyPlan]) -> list[str]:
    lay = plans[0].layout
    measured = cluster.step_cost is not None  # a column of the ratio each step's time was multiplied by
    lines = [
        "",
        "Compute (FLOPs of every pass the strategy runs: forward, backward, recomputation, a frozen target's forward)",
        "",
        f"| strategy | FLOPs per token | per GPU per step |{' step cost ÷ FLOPs |' if measured else ''} step "
        "| tokens/s |",
        "|---|---|---|---|---|" + ("---|" if measured else ""),
    ]
    for p in plans:
        per_step = p.flops_per_token * spec.data.seq_len * lay.rows * lay.micro_batches
        ratio = ""
        if measured:
            ratio = f" {p.step_cost:.3g} |" if p.strategy in cluster.step_cost.ratios else " 1 (assumed) |"
        lines.append(
            f"| {p.strategy} | {count(p.flops_per_token)} | {count(per_step)} |{ratio} {p.step_seconds:.3g} s "
            f"| {p.tokens_per_second:,.0f} |"
        )
    return lines


def _notes(spec: PipelineSpec, cluster: Cluster, plans: list[StrategyPlan]) -> list[str]:
    notes = [f"- {p.strategy}: {note}" for p in plans for note in p.notes]
    usable = cluster.usable()
    if usable is not None:
        context = f" and {size(CONTEXT_RESERVE)} for the CUDA context" if cluster.device == "cuda" else ""
        notes.append(
            f"- fits: peak ≤ {size(usable)} usable ({size(cluster.memory)} less {FRAGMENTATION:.0%} for the "
            f"allocator's fragmentation{context})"
        )
    if spec.train.compile:
        notes.append("- train.compile is not modelled: compiled layers usually need less activation memory")
    return notes


def model_name(spec: PipelineSpec) -> str:
    m = spec.model
    if m.kind == "tiny":
        return f"tiny {m.family} (hidden {m.hidden_size}, {m.num_layers} layers)"
    return f"{m.path}{' (' + m.gguf_file + ')' if m.gguf_file else ''}"


# ------------------------------------------------------------------ the command line's quantities


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def quantity(text: str, what: str, suffix: str, example: str) -> float:
    """`80GB`, `80 GiB`, `8e10`, `989T`, `1.98PFLOPS` → a number; anything else is one clear error."""
    match = re.fullmatch(rf"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]i?)?\s*(?:{suffix})?\s*", text, re.IGNORECASE)
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(f"{what} {text!r} is not a positive amount; write it like {example}")
    return float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


def cluster_for(
    spec: PipelineSpec,
    gpus: int | None,
    memory: str | None,
    flops: str | None,
    mfu: float | None,
    step_cost: str | None = None,
) -> Cluster:
    """The cluster `dllm-flow plan` sizes for: `gpus` ranks (default: the config's world size) of `memory` bytes
    and `flops` peak FLOP/s each (default: an H100's at the training precision), at `mfu` of that peak, each
    strategy's step costing its counted FLOPs times its measured ratio in the `step_cost` file (else 1)."""
    if mfu is not None and not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu} must be in (0, 1]: the share of the GPU's peak FLOP/s a step runs at")
    if gpus is not None and gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be at least 1")
    cluster = Cluster(
        gpus or spec.train.world_size,
        None if memory is None else quantity(memory, "--gpu-memory", "b|bytes", "80GB"),
        None if flops is None else quantity(flops, "--gpu-flops", "flop/s|flops|flop", "989T"),
        DEFAULT_MFU if mfu is None else mfu,
    )
    return replace(cluster, step_cost=step_cost_for(step_cost, cluster.device))


def fit_warnings(spec: PipelineSpec, memory: str | None) -> list[str]:
    """One line per strategy that the plan says will not fit a training GPU of `memory` (else the visible CUDA
    device's; none without one), naming the setting to change."""
    if memory is not None:
        total = quantity(memory, "the GPU memory (--gpu-memory / $DLLM_FLOW_GPU_MEMORY)", "b|bytes", "80GB")
    elif torch.cuda.is_available():
        total = float(torch.cuda.get_device_properties(0).total_memory)
    else:
        return []
    cluster = Cluster(spec.train.world_size, total)
    lines = []
    for name in spec.pipeline.strategies:
        try:
            p = plan_strategy(spec, name, cluster, variants=False, sizing=False)
        except Untraceable as exc:  # a warning that cannot be computed holds the run back no more than none
            lines.append(f"train[{name}] is not planned: {exc}")
            continue
        if p.peak > cluster.usable():
            fix = _fix(spec, name, cluster, p)
            lines.append(
                f"train[{name}] needs about {size(p.peak)} per GPU by the plan (dllm-flow plan), more than the "
                f"{size(cluster.usable())} usable of {size(total)}: {fix}"
            )
    return lines


def _fix(spec: PipelineSpec, name: str, cluster: Cluster, failed: StrategyPlan) -> str:
    """The first of the usual memory settings that makes `name` fit, said as the key to set."""
    t, usable = spec.train, cluster.usable()

    def fits(**train) -> StrategyPlan | None:
        changed = spec.model_copy(update={"train": t.model_copy(update=train)})
        p = plan_strategy(changed, name, cluster, variants=False, sizing=False)
        return p if p.peak <= usable else None

    if not t.activation_checkpointing and strategy_class(name).supports_activation_checkpointing:
        if p := fits(activation_checkpointing=True):
            return f"set train.activation_checkpointing: true (plan: {size(p.peak)})"
    if not t.fused_head and (p := fits(fused_head=True)):
        return f"set train.fused_head: true (plan: {size(p.peak)})"
    per_rank = t.global_batch_size // cluster.gpus
    for rows in sorted((r for r in range(1, t.micro_batch_size) if per_rank % r == 0), reverse=True):
        if p := fits(micro_batch_size=rows):
            return f"lower train.micro_batch_size to {rows} (plan: {size(p.peak)})"
    if cluster.gpus > 1 and t.parallel == "ddp" and (p := fits(parallel="fsdp2")):
        return f"set train.parallel: fsdp2 (plan: {size(p.peak)})"
    return (
        "no single setting is enough (train.micro_batch_size, train.activation_checkpointing, train.fused_head, "
        "train.parallel): run `dllm-flow plan` on this config, and use more GPUs with train.parallel: fsdp2"
    )
