"""Know before you launch: memory per GPU and time per step of each strategy of a pipeline (docs/planning.md).

Nothing is allocated: the model is built by the train stage's own builders (`tasks.training.trainee`) from its
config (a tiny one from `model:`, a pretrained one from its `config.json` alone) under a fake-tensor mode, and one
training step of the strategy runs through the loop's own `run_step` on fake tensors. The step's small integer work
(noise draws, masks, token counts) runs for real, so every data-dependent branch takes the path training takes;
everything large is fake, and each fake tensor's bytes are counted while it is alive. What the step keeps alive at
its peak is the activation memory; the weights, gradients, AdamW state and the data-parallel working set follow from
the parameters and `train.parallel`.

    trace        `Tracer`: fake tensors, live bytes of every allocation, FLOPs of every matmul and attention
    layers       a deep model is traced with 3 decoder layers and its timeline extended to the full depth
                 (`_Timeline`): the middle layer's segments repeat once per missing layer
    memory       per rank: weights + gradients + AdamW (sharded by N under FSDP2) + working set + activations
    time         counted FLOPs ÷ (GPU peak × the assumed utilization), × the strategy's measured step cost ÷
                 its FLOPs where `--step-cost FILE` gives one (`measured`; else 1, and the plan says so)

The modules, in the order they build on each other: `trace` (the tracer, the timeline), `model` (the model built
fake by the train stage's builders), `step` (one traced step), `measured` (the step costs
`benchmarks/step_cost.py --json` wrote), `estimate` (memory per rank, time per step), `render` (what is printed,
the command line's quantities).
"""

from tasks.commands.plan.estimate import (
    CONTEXT_RESERVE,
    FRAGMENTATION,
    Cluster,
    Layout,
    Resident,
    StrategyPlan,
    layout,
    micro_batch_for,
    plan,
    plan_strategy,
)
from tasks.commands.plan.measured import StepCost, read_step_cost, step_cost_for
from tasks.commands.plan.model import Shape
from tasks.commands.plan.render import cluster_for, fit_warnings, quantity, render
from tasks.commands.plan.step import synthetic_rows
from tasks.commands.plan.trace import CPU_ATTENTION_FLOPS, Untraceable, size

__all__ = [
    "CONTEXT_RESERVE",
    "CPU_ATTENTION_FLOPS",
    "FRAGMENTATION",
    "Cluster",
    "Layout",
    "Resident",
    "Shape",
    "StepCost",
    "StrategyPlan",
    "Untraceable",
    "cluster_for",
    "fit_warnings",
    "layout",
    "micro_batch_for",
    "plan",
    "plan_strategy",
    "quantity",
    "read_step_cost",
    "render",
    "size",
    "step_cost_for",
    "synthetic_rows",
]
