"""From a traced step to memory per rank and time per step (docs/planning.md): weights, gradients, AdamW and the
data-parallel working set by `train.parallel`, the step's activations, the FLOPs at an assumed utilization (times
each strategy's measured step cost ÷ its FLOPs, where `Cluster.step_cost` has one)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from dllm_common.config import ConfigError, PipelineSpec
from tasks.commands.plan.measured import StepCost
from tasks.commands.plan.model import Shape, decoder_layers
from tasks.commands.plan.step import Planner, Trace
from tasks.commands.plan.trace import GB, Untraceable, too_long, traceable_rows
from tasks.training.runtime import OptimSettings, make_optimizer

DEFAULT_MFU = 0.4
# dense peak FLOP/s of one H100/H200 SXM: bf16 tensor cores, and plain fp32 (PyTorch leaves TF32 off for matmuls)
DEFAULT_FLOPS = {"bf16": 989e12, "fp32": 67e12}
DEFAULT_GPU_MEMORY = 80 * GB
CONTEXT_RESERVE = 1.5 * 2**30  # what a CUDA process holds outside PyTorch's allocator (context, cuBLAS, NCCL)
FRAGMENTATION = 0.05  # the caching allocator's share lost to fragmentation


# ------------------------------------------------------------------ memory per rank and time per step


@dataclass(frozen=True)
class Cluster:
    """The hardware a plan is for: `gpus` data-parallel ranks of `memory` bytes and `flops` peak FLOP/s each,
    running the counted operations at `mfu` of that peak. `device` "cpu" plans a CPU training (the validation).
    `step_cost`: each strategy's measured step cost ÷ its counted FLOPs (`dllm-flow plan --step-cost`), which
    multiplies its time; without it every step costs its counted FLOPs."""

    gpus: int
    memory: float | None = DEFAULT_GPU_MEMORY
    flops: float | None = None  # None: DEFAULT_FLOPS of the training precision
    mfu: float = DEFAULT_MFU
    device: str = "cuda"
    step_cost: StepCost | None = field(default=None, compare=False)

    def cost_ratio(self, strategy: str) -> float:
        """What `strategy`'s step costs ÷ its counted FLOPs at `mfu`: measured, else 1."""
        return 1.0 if self.step_cost is None else self.step_cost.ratio(strategy)

    def usable(self) -> float | None:
        """Bytes a training may use: the memory less the allocator's fragmentation and the CUDA context."""
        if self.memory is None:
            return None
        return self.memory * (1 - FRAGMENTATION) - (CONTEXT_RESERVE if self.device == "cuda" else 0)


@dataclass(frozen=True)
class Layout:
    """How a global batch is split: `world` ranks, each `micro_batches` micro-batches of `rows` rows."""

    world: int
    parallel: str  # "single", "ddp" or "fsdp2"
    rows: int
    micro_batches: int


def micro_batch_for(spec: PipelineSpec, gpus: int) -> tuple[PipelineSpec, str | None]:
    """`spec` as it can be planned on `gpus` ranks: where `train.micro_batch_size` does not divide the rows each
    rank gets of the global batch (the config was written for another world size), the largest micro-batch that
    does, with one line that says so; else `spec` as it is (None). A global batch the ranks cannot share evenly is
    left to `layout`, which refuses it."""
    t = spec.train
    if gpus < 1 or t.global_batch_size % gpus:
        return spec, None
    per_rank = t.global_batch_size // gpus
    if per_rank % t.micro_batch_size == 0:
        return spec, None
    rows = max(r for r in range(1, min(t.micro_batch_size, per_rank) + 1) if per_rank % r == 0)
    changed = spec.model_copy(update={"train": t.model_copy(update={"micro_batch_size": rows})})
    return changed, (
        f"on {gpus} GPUs each rank gets {per_rank} of the global batch of {t.global_batch_size} rows, which "
        f"train.micro_batch_size ({t.micro_batch_size}) does not divide: planned with micro-batches of {rows} "
        "(the largest that does; --set train.micro_batch_size=N plans another)"
    )


def layout(spec: PipelineSpec, gpus: int) -> Layout:
    t = spec.train
    per_rank = t.global_batch_size // gpus
    if gpus < 1 or t.global_batch_size % gpus or per_rank % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of {gpus} GPUs × "
            f"train.micro_batch_size ({t.micro_batch_size}) to plan on {gpus} GPUs; change one of them"
        )
    return Layout(gpus, "single" if gpus == 1 else t.parallel, t.micro_batch_size, per_rank // t.micro_batch_size)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True, kw_only=True)
class Resident:
    """Bytes one rank holds besides the step's activations."""

    parameters: int  # of the trained module (all ranks together)
    trainable: int
    weights: int
    gradients: int
    optimizer: int  # AdamW's two moments
    frozen: int  # a frozen module beside it (the DFlash target), whole on every rank
    working: int  # DDP: the gradient buckets; FSDP2: the unsharded weights and gradients in flight
    update: int  # scratch of the optimizer step

    @classmethod
    def of(cls, model: nn.Module, frozen: nn.Module | None, lay: Layout, device: str, optimizer=None) -> Resident:
        """`optimizer`: the train stage's own (`make_optimizer`), whose parameter groups are what it updates and
        keeps moments for; None: every parameter that requires a gradient (what it selects)."""
        params = list(model.parameters())
        trained = [p for p in params if p.requires_grad]
        if optimizer is not None:
            trained = [p for group in optimizer.param_groups for p in group["params"]]
        weights, buffers = _nbytes(params), _nbytes(model.buffers())  # buffers (rotary tables) are never sharded
        grads = _nbytes(trained)
        largest = max((p.numel() * p.element_size() for p in trained), default=0)
        frozen_bytes = 0 if frozen is None else _nbytes(frozen.parameters()) + _nbytes(frozen.buffers())
        count, count_trained = sum(p.numel() for p in params), sum(p.numel() for p in trained)
        if lay.parallel == "fsdp2":
            # each rank keeps 1/N of every weight, gradient and moment; while a step runs it also holds the root
            # module's weights unsharded (not resharded between forward and backward) and their gradients until the
            # end of backward, two decoder layers' all-gathered weights (the current one and the prefetched one)
            # and one layer's unsharded gradients before they are reduce-scattered
            # a model whose layers two modules run (`shares_layers`) is one root unit (`shard_fsdp2`): all of it
            layers = [] if getattr(model, "shares_layers", False) else list(decoder_layers(model))
            layer_w = max((_nbytes(layer.parameters()) for layer in layers), default=0)
            layer_g = max((_nbytes(p for p in layer.parameters() if p.requires_grad) for layer in layers), default=0)
            root_w = weights - sum(_nbytes(layer.parameters()) for layer in layers)
            root_g = grads - sum(_nbytes(p for p in layer.parameters() if p.requires_grad) for layer in layers)
            shard = lambda n: math.ceil(n / lay.world)  # noqa: E731
            working = root_w + root_g + 2 * layer_w + layer_g
            update = shard(grads) if device == "cuda" else 2 * shard(largest)
            sharded = shard(weights) + buffers
            return cls(
                parameters=count,
                trainable=count_trained,
                weights=sharded,
                gradients=shard(grads),
                optimizer=2 * shard(grads),
                frozen=frozen_bytes,
                working=working,
                update=update,
            )
        # AdamW on CUDA updates every tensor at once (foreach): one temporary the size of the moments' square root;
        # on CPU one tensor at a time, with two temporaries of it
        update = grads if device == "cuda" else 2 * largest
        working = grads if lay.parallel == "ddp" else 0  # DDP's buckets are a second copy of the gradients
        return cls(
            parameters=count,
            trainable=count_trained,
            weights=weights + buffers,
            gradients=grads,
            optimizer=2 * grads,
            frozen=frozen_bytes,
            working=working,
            update=update,
        )


VARIANTS = ((True, False), (False, False), (True, True), (False, True))  # (fused head, activation checkpointing)


@dataclass(kw_only=True)
class StrategyPlan:
    """One strategy's plan: per rank, at the configured micro-batch unless noted."""

    strategy: str
    layout: Layout
    resident: Resident
    activations: dict[tuple[bool, bool], int | None]  # per (fused head, checkpointing); None: does not apply
    configured: tuple[bool, bool]
    step_activations: int  # the most of them over the step's micro-batches (each draws its own noise)
    peak: int  # per rank, configured settings
    per_row: int  # activation bytes per more row of micro-batch
    max_rows: int | None  # the largest micro-batch that fits (None: no memory given)
    flops_per_token: float
    step_seconds: float  # counted FLOPs ÷ (peak × mfu) × step_cost
    tokens_per_second: float
    step_cost: float = 1.0  # measured step cost ÷ counted FLOPs applied (1: assumed)
    notes: list[str] = field(default_factory=list)


def _phases(res: Resident, lay: Layout, activations: int, with_grads: int | None) -> tuple[int, int]:
    """A rank's most bytes during forward/backward and during the optimizer step. Weights, AdamW moments and a
    frozen module stay; FSDP2 keeps its gradient shards and adds its working set; replicated gradients are made
    during backward and, from a step's second micro-batch on, are all there from its start (`with_grads`: the
    whole step traced with them kept)."""
    base = res.weights + res.optimizer + res.frozen
    if lay.parallel == "fsdp2":
        return base + res.gradients + res.working + activations, base + res.gradients + res.update
    during = with_grads if with_grads is not None else activations + res.gradients
    return base + res.working + during, base + res.working + res.gradients + res.update


class _Settings:
    """The traces of one strategy's micro-batch at each memory setting (fused head, activation checkpointing), each
    traced once when first asked for; `activations`: their peaks, None where a setting does not apply."""

    def __init__(self, planner: Planner, rows: int):
        self.planner, self.rows = planner, rows
        self.activations: dict[tuple[bool, bool], int | None] = {}
        self.traces: dict[tuple[bool, bool], Trace | None] = {}

    def peak(self, fused: bool, ckpt: bool) -> int | None:
        if (fused, ckpt) not in self.activations:
            builder = self.planner.builder
            trace = self.planner.trace(Shape(fused, ckpt, self.rows)) if builder.supports(ckpt) else None
            applies = trace is not None and (builder.deferrable or not fused)  # else the same as full logits
            self.activations[(fused, ckpt)] = trace.peak if applies else None
            self.traces[(fused, ckpt)] = trace
        return self.activations[(fused, ckpt)]

    def configured(self, spec: PipelineSpec) -> tuple[tuple[bool, bool], list[str]]:
        """The setting `train:` asks for as it applies to this strategy and model, and a note for each switch that
        does not apply."""
        t = spec.train
        chosen = (t.fused_head, t.activation_checkpointing and self.planner.builder.supports(True))
        if self.peak(*chosen) is None:  # the model has no plain linear head to fuse
            chosen = (False, chosen[1])
            self.peak(*chosen)
        notes = []
        if chosen[1] != t.activation_checkpointing:
            notes.append("train.activation_checkpointing does not apply to it: planned without")
        if chosen[0] != t.fused_head:
            notes.append("its model has no plain linear LM head: planned with full logits")
        return chosen, notes


def _largest_micro_batch(usable: float | None, lay: Layout, during: int, update: int, more: int) -> int | None:
    """The most rows a micro-batch may have in `usable` bytes, each row `more` bytes of activations beyond the
    configured micro-batch's `during` (None: no memory given)."""
    if usable is None:
        return None
    if update > usable:
        return 0
    return max(0, lay.rows + math.floor((usable - during) / more) if more > 0 else lay.rows)


def plan_strategy(
    spec: PipelineSpec, name: str, cluster: Cluster, variants: bool = True, sizing: bool = True
) -> StrategyPlan:
    """Trace `name`'s step at the configured micro-batch (every memory setting with `variants`) and size it (the
    largest micro-batch that fits, with `sizing`)."""
    lay = layout(spec, cluster.gpus)
    if lay.rows > traceable_rows(spec):  # refused before any model is built or row drawn
        raise Untraceable(too_long(spec, lay.rows))
    unsized = sizing and lay.rows + 1 > traceable_rows(spec)  # sizing traces one more row
    sizing = sizing and not unsized
    planner = Planner(spec, name)
    model, frozen = planner.full_model()
    optimizer, _ = make_optimizer(model, OptimSettings.of(spec.train))  # the train stage's builder, state unbuilt
    res = Resident.of(model, frozen, lay, cluster.device, optimizer)
    del model, optimizer
    settings = _Settings(planner, lay.rows)
    chosen, notes = settings.configured(spec)
    for variant in VARIANTS if variants else ():
        settings.peak(*variant)
    if unsized:
        notes.append(f"largest micro-batch not sized: {too_long(spec, lay.rows + 1)}")
    # the whole step (every micro-batch draws its own noise, so how many positions a strategy selects varies)
    shape = Shape(*chosen, lay.rows)
    many = lay.micro_batches > 1
    step = planner.trace(shape, micro_batches=lay.micro_batches) if many else settings.traces[chosen]
    more = 0
    if sizing:  # one more row: what each row adds, which sizes the largest micro-batch
        more = max(0, planner.trace(Shape(*chosen, lay.rows + 1)).peak - settings.activations[chosen])
    with_grads = None
    if lay.parallel != "fsdp2":
        with_grads = planner.trace(shape, keep_grads=True, micro_batches=lay.micro_batches).peak
    during, update = _phases(res, lay, step.peak, with_grads)
    max_rows = _largest_micro_batch(cluster.usable(), lay, during, update, more) if sizing else None
    ratio = cluster.cost_ratio(name)
    seconds = step.flops / ((cluster.flops or DEFAULT_FLOPS[spec.train.precision]) * cluster.mfu) * ratio
    tokens = spec.data.seq_len
    return StrategyPlan(
        strategy=name,
        layout=lay,
        resident=res,
        activations=settings.activations,
        configured=chosen,
        step_activations=step.peak,
        peak=max(during, update),
        per_row=more,
        max_rows=max_rows,
        flops_per_token=step.flops / (tokens * lay.rows * lay.micro_batches),
        step_seconds=seconds,
        tokens_per_second=spec.train.global_batch_size * tokens / seconds,
        step_cost=ratio,
        notes=notes,
    )


def plan(spec: PipelineSpec, cluster: Cluster, variants: bool = True) -> list[StrategyPlan]:
    """A plan for every strategy of the pipeline."""
    return [plan_strategy(spec, name, cluster, variants) for name in spec.pipeline.strategies]
