"""One training step of a strategy traced under `dllm-flow plan`'s fake-tensor mode, through the loop's own
`run_step` on synthetic rows: the activations at the step's peak, and the FLOPs of every pass."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)

from dllm_common.config import PipelineSpec
from strategies import Microbatch, strategy_class
from tasks.commands.plan.model import Builder, Shape, decoder_layers
from tasks.commands.plan.trace import TRACED_LAYERS, Tracer, Untraceable, too_long
from tasks.training.distributed import DistInfo
from tasks.training.loop import run_step, step_context

# ------------------------------------------------------------------ one traced step


def synthetic_rows(spec: PipelineSpec, name: str, rows: int, vocab: int, seed: int = 0) -> Microbatch:
    """`rows` training rows of `data.seq_len` uniform random tokens (ids 2 … V − 2, clear of the usual special ids),
    supervised as the config's rows are: all of a pretraining row, all but a prompt otherwise (a dialogue row's
    first quarter, a regenerated row's `dflash.regenerate.prompt_len` tokens). Packed pretraining rows hold one
    document each."""
    length = spec.data.seq_len
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, max(vocab - 1, 3), (rows, length), generator=gen)
    loss_mask = torch.ones(rows, length)
    if strategy_class(name).training_data(spec) == "regenerated":
        loss_mask[:, : spec.dflash.regenerate.prompt_len] = 0
    elif spec.data.shape == "dialogue":
        loss_mask[:, : length // 4] = 0
    documents = torch.zeros(rows, length, dtype=torch.long) if spec.data.shape == "pretrain" else None
    return Microbatch(
        ids, loss_mask, torch.ones(rows, length, dtype=torch.long), torch.arange(rows), "train", documents
    )


@dataclass(frozen=True)
class Trace:
    """One micro-batch's forward and backward at the configured depth: the most bytes it had alive beyond what
    existed before it (activations, logits, the loss's scratch; the gradients too where they were kept) and the
    FLOPs of its matmuls and attention (every pass the strategy runs, recomputation included)."""

    peak: int
    flops: int


def _mark_layers(model: nn.Module, tracer: Tracer) -> list:
    """Hooks that start a timeline segment where a decoder layer's forward starts (recomputation included) and
    where its backward starts (the gradient of its output arrives)."""

    def on_forward(index):
        def hook(module, args, kwargs):
            tracer.mark(index)

        return hook

    def on_output(index):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: tracer.mark(index))

        return hook

    handles = []
    for index, layer in enumerate(decoder_layers(model)):
        handles.append(layer.register_forward_pre_hook(on_forward(index), with_kwargs=True))
        handles.append(layer.register_forward_hook(on_output(index), with_kwargs=True))
    return handles


def _drop_gradients(params) -> list:
    """Free each gradient as soon as it is accumulated (what FSDP2 does after reducing it to its shard)."""

    def drop(param):
        param.grad = None

    return [p.register_post_accumulate_grad_hook(drop) for p in params]


@contextlib.contextmanager
def _tracking(tracer: Tracer, handles: list) -> Iterator[None]:
    """Count what runs inside (the tracer's counters reset first); afterwards stop counting and remove `handles`."""
    tracer.reset()
    tracer.tracking = True
    try:
        yield
    finally:
        tracer.tracking = False
        for handle in handles:
            handle.remove()


class Planner:
    """The traces of one strategy of a pipeline, built from configs only."""

    def __init__(self, spec: PipelineSpec, name: str):
        self.spec, self.name, self.tracer = spec, name, Tracer()
        self.builder = Builder(spec, name, self.tracer)

    def trace(
        self, shape: Shape, keep_grads: bool = False, grads_present: bool = False, micro_batches: int = 1
    ) -> Trace:
        """One training step of `micro_batches` micro-batches of `shape.rows` rows (each draws its own noise, as in
        training), gradients freed as they are made unless `keep_grads`."""
        b = self.builder
        depth = b.depth
        # a step of several micro-batches is traced at full depth: what a layer allocates and the end of the
        # micro-batch frees all at once (bf16 autocast's weight casts) would be freed for 3 layers only, and the
        # extended level would drift up by the other layers' share with every micro-batch
        deep = depth is not None and depth > TRACED_LAYERS + 1
        layers = TRACED_LAYERS if deep and micro_batches == 1 else None
        trainee = b.build(shape.fused_head, shape.checkpointing, layers)
        model, tracer = trainee.model, self.tracer
        params = [p for p in model.parameters() if p.requires_grad]
        handles = _mark_layers(model, tracer)
        if not keep_grads:
            handles += _drop_gradients(params)
        if grads_present:
            with tracer:
                for p in params:
                    p.grad = torch.zeros_like(p)
        rows = [synthetic_rows(self.spec, self.name, shape.rows, b.vocab, self.spec.train.seed)] * micro_batches
        with _tracking(tracer, handles):
            with tracer, torch.random.fork_rng(devices=[]):
                steps = self.spec.train.steps  # step 0 of the run: a curriculum's first step (Domino: both losses)
                ctx = step_context(trainee, 0, self.spec.train.seed, model, DistInfo(), micro_batches, steps)
                try:
                    run_step(trainee, ctx, rows, True)
                except (DynamicOutputShapeException, DataDependentOutputException) as exc:
                    # a selection by a mask too large to have stayed real: its size is unknown to a fake tensor
                    why = f" (a data-dependent size in the trace: {exc.func})"
                    raise Untraceable(too_long(self.spec, shape.rows, why)) from None
            del ctx
            for p in params:  # what the step leaves is the gradients: theirs, not the step's
                p.grad = None
        end = tracer.now
        traced = len(decoder_layers(model))
        peak, flops = tracer.timeline.extend(end, depth if layers else traced, traced)
        return Trace(peak, flops)

    def trace_call(self, model: nn.Module, call) -> Trace:
        """`call()` — a forward (and backward) of `model` other than the training step, e.g. GRPO's update —
        traced as `trace` traces a step, `model` at the depth it was built (gradients freed as they are made)."""
        tracer = self.tracer
        handles = _mark_layers(model, tracer) + _drop_gradients([p for p in model.parameters() if p.requires_grad])
        with _tracking(tracer, handles), tracer, torch.random.fork_rng(devices=[]):
            call()
        end = tracer.now
        layers = len(decoder_layers(model))
        peak, flops = tracer.timeline.extend(end, layers, layers)
        return Trace(peak, flops)

    def full_model(self) -> tuple[nn.Module, nn.Module | None]:
        """The trained module at its configured depth (fake) and the frozen module beside it (a DFlash target)."""
        trainee = self.builder.build(self.spec.train.fused_head, False)
        return trainee.model, self.builder.frozen
