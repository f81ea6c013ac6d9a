"""The one training loop: every strategy's `train` stage and the DFlash target's pretraining run it.

Read it top to bottom in `train_loop`: each step corrupts and forward/backwards every micro-batch
through the strategy's hooks, clips and steps; once in a while it validates, logs and checkpoints.
What the loop runs on is a `LoopRun` that the caller sets up (model, optimizer, data, tracker,
checkpointer); what it does is a `LoopSettings`.

Data order is a pure function of (seed, step) and corruption noise of (seed, step, sample)
(docs/strategies.md §3), so a resumed run continues exactly; under data parallelism rank r takes
rows r, r + N, … of the global batch, token counts are all-reduced and backward is scaled by N
(docs/strategies.md §7.2), which makes the applied gradient the global token mean.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from dllm_common import faults, interrupt
from dllm_common.config import TrainingDiverged
from strategies import StepContext
from strategies.base import global_sum
from tasks.training.distributed import DistInfo
from tasks.training.resume import Checkpointer
from tasks.training.runtime import DataOrder, Split, Trainee

VAL_SEED_OFFSET = 1_000_000_007  # validation noise: its own fixed stream, the same at every evaluation


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    steps: int
    global_batch_size: int
    micro_batch_size: int
    seed: int
    grad_clip: float
    log_every: int
    val_every: int
    val_rows: int
    checkpoint_every: int | None = None  # None: no checkpoints
    name: str = "train"  # the progress bar's label
    skip_nonfinite_steps: int = 0  # steps with a NaN/infinite loss or gradient norm skipped before stopping
    lr: float | None = None  # the configured peak LR and warm-up, named when a training diverges
    warmup_steps: int | None = None

    @classmethod
    def of(cls, train, name: str) -> LoopSettings:
        """From a `TrainConfig`."""
        return cls(
            steps=train.steps,
            global_batch_size=train.global_batch_size,
            micro_batch_size=train.micro_batch_size,
            seed=train.seed,
            grad_clip=train.grad_clip,
            log_every=train.log_every,
            val_every=train.val_every,
            val_rows=train.val_rows,
            checkpoint_every=train.checkpoint_every,
            name=name,
            skip_nonfinite_steps=train.skip_nonfinite_steps,
            lr=train.lr,
            warmup_steps=train.warmup_steps,
        )


@dataclass(kw_only=True)
class LoopRun:
    """What the loop runs on. `stepper` is the module the step calls (the DDP wrapper under DDP)."""

    trainee: Trainee
    stepper: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: object
    train: Split
    val: Split
    device: str
    dist: DistInfo = field(default_factory=DistInfo)
    tracker: object | None = None  # rank 0 only
    checkpointer: Checkpointer | None = None
    checkpoint_meta: dict = field(default_factory=dict)  # what every checkpoint records besides the step
    start: int = 0
    logged_upto: int = -1  # steps an earlier, crashed attempt already logged
    pending: list = field(default_factory=list)  # (step, metrics) an earlier attempt could not log (tracking down)
    skipped: int = 0  # steps skipped for a non-finite loss or gradient norm so far (`train.skip_nonfinite_steps`)


def step_context(
    trainee: Trainee, step: int, base_seed: int, model, dist: DistInfo, grad_acc: int, total_steps: int | None = None
) -> StepContext:
    """The step's context from values resolved once (the strategy's options); backward is scaled by N."""
    return StepContext(
        model=model,
        loss_fn=trainee.loss_fn,
        mask_token_id=trainee.mask_token_id,
        step=step,
        base_seed=base_seed,
        dp_rank=dist.rank,
        dp_size=dist.world,
        grad_acc_steps=grad_acc,
        loss_scale=float(dist.world),
        total_steps=total_steps,
        **trainee.strategy.corruption_values(),
    )


def run_step(trainee: Trainee, ctx: StepContext, mbs, is_train: bool) -> tuple[float, int, dict]:
    """pre_step over all micro-batches, then forward/backward each with step-level *global* counts.

    Returns the step's loss summed over micro-batches and data-parallel ranks (= the global token
    mean, since every term is local sum ÷ global count), the global supervised count, and the DFlash
    draft accuracies when the loss reports per-offset counts (docs/strategies.md §7.3)."""
    corrupted, n_noise, n_sup = trainee.strategy.pre_step(ctx, mbs)
    n_noise, n_sup = global_sum(n_noise), global_sum(n_sup)
    n_diff, n_ar = trainee.strategy.loss_denominators(corrupted, n_noise, n_sup)
    total, correct, count = 0.0, None, None
    for batch in corrupted:
        with trainee.forward_context():
            out = trainee.strategy.forward_backward(
                ctx, batch, num_diffusion_tokens=n_diff, num_ar_tokens=n_ar, is_train=is_train
            )
        total += float(out.total_loss.detach())
        if out.draft_correct_per_pos is not None:
            c, n = out.draft_correct_per_pos.detach().cpu(), out.draft_count_per_pos.detach().cpu()
            correct, count = (c, n) if correct is None else (correct + c, count + n)
    return global_sum(total), n_sup, draft_accuracy(correct, count)


def draft_accuracy(correct, count) -> dict:
    """Per-offset sums all-reduced over ranks → `draft_acc` = Σcorrect/Σcount and `draft_acc_k{k}`."""
    if correct is None:
        return {}
    c = [global_sum(float(x)) for x in correct.tolist()]
    n = [global_sum(float(x)) for x in count.tolist()]
    out = {"draft_acc": sum(c) / sum(n) if sum(n) else float("nan")}
    out.update({f"draft_acc_k{k}": ck / max(nk, 1.0) for k, (ck, nk) in enumerate(zip(c, n), start=1)})
    return out


def validation_loss(run: LoopRun, settings: LoopSettings) -> float:
    """Training loss on fixed validation rows with fixed noise (same realization at every evaluation).
    Under data parallelism each rank scores its strided share; the seeds match the one-process run."""
    val = run.val.head(settings.val_rows)
    rows = torch.arange(len(val.ids))[run.dist.rank :: run.dist.world]
    ctx = step_context(run.trainee, 0, settings.seed + VAL_SEED_OFFSET, run.trainee.model, run.dist, 1)
    ctx = replace(ctx, training=False)  # the full noise process, whatever the step's curriculum
    run.trainee.model.eval()
    with torch.no_grad():
        value, _, _ = run_step(run.trainee, ctx, val.microbatches(rows, settings.micro_batch_size, run.device), False)
    run.trainee.model.train()
    return value


def training_probe(run: LoopRun) -> dict:
    """The strategy's own metrics of the model as it stands (`DLLMStrategy.training_probe`), in eval mode."""
    model = run.trainee.model
    model.eval()
    with torch.no_grad():
        out = run.trainee.strategy.training_probe(model, run.val.ids, run.val.attention_mask)
    model.train()
    return out


def train_step(run: LoopRun, settings: LoopSettings, ctx: StepContext, mbs) -> dict:
    """One optimizer step: corrupt + forward/backward every micro-batch, clip, step, schedule.

    A NaN or infinite loss or gradient norm (the same value on every rank: the loss is all-reduced, the norm
    is taken over the all-reduced or sharded gradients) never reaches the weights: the step is skipped while
    `run.skipped` is below `settings.skip_nonfinite_steps` (`train/skipped_steps` counts them), else the
    training stops with `TrainingDiverged`."""
    loss, n_sup, draft = run_step(run.trainee, ctx, mbs, True)
    if faults.reached("train.loss"):  # the fault suite's diverging step
        loss = float("nan")
    # grads are already all-reduced by DDP
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.trainee.model.parameters(), settings.grad_clip))
    lr = run.sched.get_last_lr()[0]
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if not finite:
        what = f"the loss is {loss:g}" if not math.isfinite(loss) else f"the gradient norm is {grad_norm:g}"
        if run.skipped >= settings.skip_nonfinite_steps:
            raise TrainingDiverged(diverged_message(run, settings, ctx.step, what))
        run.skipped += 1
        if run.dist.is_main:
            print(
                f"[dllm-flow] {settings.name}: {what} at step {ctx.step + 1}; step skipped, no update "
                f"({run.skipped} of at most {settings.skip_nonfinite_steps}: train.skip_nonfinite_steps)",
                flush=True,
            )
    else:
        run.opt.step()
        if faults.reached("train.update"):  # the fault suite's update that spoils the weights
            _spoil(run.trainee.model)
    run.opt.zero_grad(set_to_none=True)
    run.sched.step()  # a skipped step keeps its place in the schedule: the LR stays a function of the step
    out = {
        "train/loss": loss,
        "train/lr": lr,
        "train/grad_norm": grad_norm,
        "train/supervised_tokens": n_sup,
        **{f"train/{k}": v for k, v in draft.items()},
    }
    if run.skipped:
        out["train/skipped_steps"] = run.skipped
    return out


def _spoil(model) -> None:
    with torch.no_grad():
        param = next(model.parameters())
        getattr(param, "to_local", lambda: param)().view(-1)[0] = float("nan")


def diverged_message(run: LoopRun, settings: LoopSettings, step: int, what: str, updated: bool = False) -> str:
    """One line: which step, which value, the setting most likely behind it, what was kept and how to go on.
    `updated`: the value comes after the step's own update (the weights), not before it (its loss)."""
    where = f"{settings.name}: {what} at step {step + 1} of {settings.steps}"
    if step == 0 and not updated:  # before any update: the weights are as initialized
        cause = (
            "before any weight update, so not the learning rate: the model's initial weights or the data give it "
            "(a pretrained checkpoint in a dtype that overflows, or rows with nothing supervised)"
        )
    else:
        lr = f"train.lr ({settings.lr:g})" if settings.lr is not None else "train.lr"
        warm = f" or raise train.warmup_steps ({settings.warmup_steps})" if settings.warmup_steps is not None else ""
        cause = f"the weights diverged: most likely {lr} is too high for this model; lower it{warm}"
    ckpt = run.checkpointer
    kept = (
        f"the step-{ckpt.saved_step} checkpoint is kept: `dllm-flow resume` continues from it (with "
        "`--set train.skip_nonfinite_steps=N` it skips up to N such steps instead of stopping)"
        if ckpt is not None and ckpt.saved_step
        else "no checkpoint was written before it, so a rerun starts over"
    )
    return f"{where}: {cause}. Nothing was published; {kept}"


def check_finite_weights(run: LoopRun, settings: LoopSettings, step: int) -> None:
    """Every rank's weights (its shards under FSDP2) are finite, agreed by every rank: nothing non-finite is ever
    checkpointed or published (the update of a step can turn the weights to NaN after the last loss that would
    have shown it)."""
    if not weights_finite(run.trainee.model):
        what = "the weights hold NaN or infinite values"
        raise TrainingDiverged(diverged_message(run, settings, step, what, updated=True))


def weights_finite(model) -> bool:
    """Whether every weight is finite, on every rank (a collective: each rank checks its own part)."""
    bad = 0
    for param in model.parameters():
        local = getattr(param, "to_local", lambda p=param: p)()  # an FSDP2 shard is a DTensor
        bad += int(not bool(torch.isfinite(local.detach()).all()))
    return global_sum(bad) == 0


class TrackingUnavailable(RuntimeError):
    """The tracking server stopped answering; the metrics not yet logged are kept."""


class MetricLog:
    """Metrics buffered per step, written in batches; steps a crashed attempt already logged are skipped.
    If the tracker fails, what was not logged stays buffered and `TrackingUnavailable` is raised."""

    def __init__(self, tracker, logged_upto: int, pending: list | None = None):
        self.tracker, self.logged_upto, self.buffer = tracker, logged_upto, [tuple(p) for p in pending or []]

    def add(self, step: int, metrics: dict) -> None:
        self.buffer.append((step, metrics))

    def flush(self) -> None:
        while self.buffer:
            step, metrics = self.buffer[0]
            if self.tracker is not None and step > self.logged_upto:
                try:
                    self.tracker.log_metrics(metrics, step=step)
                except Exception as exc:
                    raise TrackingUnavailable(f"{type(exc).__name__}: {str(exc)[:300]}") from None
            self.buffer.pop(0)


def flush_everywhere(log: MetricLog) -> None:
    """Flush (rank 0 holds the tracker); whether it failed is agreed by every rank, so that all of them stop at
    the same step and checkpoint together (`_tracking_lost`)."""
    try:
        log.flush()
        failed = None
    except TrackingUnavailable as exc:
        failed = exc
    if global_sum(0 if failed is None else 1) > 0:
        raise failed or TrackingUnavailable("the tracking server stopped answering on rank 0")


def _due(step: int, every: int | None) -> bool:
    return every is not None and (step + 1) % every == 0


def train_loop(run: LoopRun, settings: LoopSettings) -> float | None:
    """Steps `run.start … settings.steps − 1`; returns the last validation loss."""
    log = MetricLog(run.tracker, run.logged_upto, run.pending)
    run.trainee.model.train()
    bar = tqdm(
        range(run.start, settings.steps),
        initial=run.start,
        total=settings.steps,
        desc=settings.name,
        unit="step",
        dynamic_ncols=True,
        disable=not run.dist.is_main,
    )
    state = _LoopState(
        DataOrder(len(run.train.ids), settings.seed),
        settings.global_batch_size // run.dist.world // settings.micro_batch_size,
        settings.global_batch_size * run.train.ids.shape[1],
        log,
        bar,
    )
    with interrupt.cooperative():  # a signal stops the loop at the end of a step (docs/operations.md)
        for step in bar:
            try:
                _one_step(run, settings, step, state)
            except TrackingUnavailable as exc:
                _tracking_lost(run, settings, step, log, exc)
            if interrupt.requested():
                _stop(run, settings, step, log)
            if run.checkpointer is not None:
                run.checkpointer.poll()  # an asynchronous checkpoint, swapped in once written
    bar.close()
    log.flush()
    if run.checkpointer is not None:
        run.checkpointer.finish()
    check_finite_weights(run, settings, settings.steps - 1)  # what is published is finite too
    return state.val_loss


@dataclass
class _LoopState:
    """What the steps of one `train_loop` share."""

    order: DataOrder
    grad_acc: int
    tokens_per_step: int
    log: MetricLog
    bar: object
    val_loss: float | None = None


def _one_step(run: LoopRun, settings: LoopSettings, step: int, state: _LoopState) -> None:
    """One step of the loop: train, validate when due (the loss kept in `state`), log, checkpoint when due."""
    faults.reached("train.step")
    faults.reached(f"step:{settings.name}")  # one training's steps, e.g. step:train[scdd]
    t0 = time.perf_counter()
    ctx = step_context(run.trainee, step, settings.seed, run.stepper, run.dist, state.grad_acc, settings.steps)
    rows = state.order.rows(step, settings.global_batch_size)[run.dist.rank :: run.dist.world]
    metrics = train_step(run, settings, ctx, run.train.microbatches(rows, settings.micro_batch_size, run.device))
    metrics["train/tokens_per_s"] = tps = state.tokens_per_step / (time.perf_counter() - t0)
    if _due(step, settings.val_every) or step + 1 == settings.steps:
        state.val_loss = metrics["val/loss"] = validation_loss(run, settings)
    if run.trainee.strategy.probe_due(step, step + 1 == settings.steps):
        metrics.update(training_probe(run))
    state.log.add(step, metrics)
    state.bar.set_postfix(
        loss=f"{metrics['train/loss']:.3f}",
        val="-" if state.val_loss is None else f"{state.val_loss:.3f}",
        tok_s=f"{tps:,.0f}",
    )
    if _due(step, settings.log_every):
        flush_everywhere(state.log)
    if run.checkpointer is not None and _due(step, settings.checkpoint_every) and step + 1 < settings.steps:
        flush_everywhere(state.log)
        check_finite_weights(run, settings, step)  # a checkpoint is always one a training can go on from
        run.checkpointer.save(run.trainee.model, run.opt, run.sched, run.trainee.tokenizer, checkpoint_meta(run, step))


def checkpoint_meta(run: LoopRun, step: int) -> dict:
    """What the checkpoint after `step` records besides the model and optimizer state."""
    return {**run.checkpoint_meta, "step": step + 1, "skipped_steps": run.skipped}


def _tracking_lost(run: LoopRun, settings: LoopSettings, step: int, log: MetricLog, exc: Exception) -> None:
    """The tracking server is gone: checkpoint this step with the metrics it could not log (a resumed run logs
    them first), then fail the stage with one message saying how to go on."""
    done, ckpt = step + 1, run.checkpointer
    kept = "no checkpoint (train.checkpoint_every is not set): the stage restarts from step 0"
    if ckpt is not None and not weights_finite(run.trainee.model):
        kept = "no checkpoint of this step (its weights are not finite)"
    elif ckpt is not None:
        meta = {**checkpoint_meta(run, step), "pending_metrics": log.buffer}
        ckpt.save(run.trainee.model, run.opt, run.sched, run.trainee.tokenizer, meta)
        ckpt.finish()
        kept = f"checkpoint saved at step {done} with the {len(log.buffer)} steps of metrics not yet logged"
    raise RuntimeError(
        f"{settings.name}: the tracking server stopped answering at step {done} ({exc}); {kept}. Once it answers "
        "again, `dllm-flow resume` continues from there"
    ) from None


def _stop(run: LoopRun, settings: LoopSettings, step: int, log: MetricLog) -> None:
    """A signal came: flush the metrics, checkpoint this step if that fits in the time left, raise."""
    log.flush()
    done, ckpt = step + 1, run.checkpointer
    fits = ckpt is not None and done < settings.steps and ckpt.fits_in(interrupt.seconds_left(), run.trainee.model)
    if fits and weights_finite(run.trainee.model):
        ckpt.save(run.trainee.model, run.opt, run.sched, run.trainee.tokenizer, checkpoint_meta(run, step))
    if ckpt is not None:
        ckpt.finish()  # an asynchronous write still under way is completed before stopping
    saved = ckpt.saved_step if ckpt is not None else None
    kept = f"checkpoint at step {saved}" if saved else "no checkpoint: the stage restarts from step 0"
    interrupt.stop(f"{settings.name} stopped after step {done} of {settings.steps}; {kept}")
