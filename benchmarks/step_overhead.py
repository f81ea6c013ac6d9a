"""Pipeline training step vs a bare PyTorch loop doing the same MDLM step, in one run.

Both sides use the same model init, the same batches and the same math (absorbing corruption,
bidirectional forward, Σ CE/p over corrupted ∧ supervised ÷ N_sup, clip, AdamW). The pipeline side
is `tasks.train.train_step` exactly as the training stage calls it (per-sample seeded corruption
through the strategy hooks). Blocks of steps alternate between the two to cancel machine drift;
the ratio of median step times is printed (goal ≤ 1.05).

    python benchmarks/step_overhead.py [--steps 30] [--batch 32] [--seq 128]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

from strategies import MDLMStrategy
from strategies.models import build_model, full_attention_mask, tiny_model_config
from strategies.options import validate_config
from tasks.training.distributed import DistInfo
from tasks.training.loop import LoopRun, LoopSettings, step_context, train_step
from tasks.training.runtime import OptimSettings, Split, Trainee, make_optimizer


def bare_step(model, opt, ids, loss_mask, mask_id, eps, gen, clip):
    t = torch.rand(ids.shape[0], generator=gen)
    p = (1 - eps) * t + eps
    noise = (torch.rand(ids.shape, generator=gen) < p[:, None]) & loss_mask.bool()
    noisy = torch.where(noise, torch.full_like(ids, mask_id), ids)
    logits = model(input_ids=noisy, attention_mask=full_attention_mask(noisy), use_cache=False).logits
    nll = F.cross_entropy(logits[noise], ids[noise], reduction="none") / p[:, None].expand_as(ids)[noise]
    loss = nll.sum() / loss_mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def pipeline_step(run: LoopRun, settings: LoopSettings, step: int, rows) -> None:
    """One step as `tasks.training.loop.train_loop` takes it (context, micro-batches, train_step)."""
    ctx = step_context(run.trainee, step, 0, run.stepper, DistInfo(), 1)
    train_step(run, settings, ctx, run.train.microbatches(rows, settings.micro_batch_size, "cpu"))


def pipeline_run(spec, model, split: Split, mask_id: int) -> tuple[LoopRun, LoopSettings]:
    """The pipeline's side: an MDLM trainee stepped through the training loop's own step."""
    strategy = MDLMStrategy()
    trainee = Trainee(
        model=model, tokenizer=None, strategy=strategy, loss_fn=strategy.create_loss_fn(), mask_token_id=mask_id
    )
    opt, sched = make_optimizer(model, OptimSettings.of(spec.train))
    run = LoopRun(trainee=trainee, stepper=model, opt=opt, sched=sched, train=split, val=split, device="cpu")
    return run, LoopSettings.of(spec.train, "benchmark")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    args = ap.parse_args()
    spec = validate_config(
        {
            "train": {
                "global_batch_size": args.batch,
                "micro_batch_size": args.batch,
                "lr": 3e-3,
                "warmup_steps": 0,
                "schedule": "constant",
            }
        }
    )
    cfg = tiny_model_config("llama", args.vocab, args.seq, 128, 4, 4, None, None, True)
    base = build_model(cfg, seed=0)
    mask_id = args.vocab - 1
    data = torch.randint(
        0, args.vocab - 1, (args.batch * (args.steps + 2), args.seq), generator=torch.Generator().manual_seed(0)
    )
    loss_mask = torch.ones(data.shape)
    attn = torch.ones(data.shape, dtype=torch.long)

    run, settings = pipeline_run(spec, copy.deepcopy(base), Split(data, loss_mask, attn), mask_id)
    bare_model = copy.deepcopy(base)
    bare_opt, _ = make_optimizer(bare_model, OptimSettings.of(spec.train))
    gen = torch.Generator().manual_seed(1)

    def batch(step):
        return torch.arange(step * args.batch, (step + 1) * args.batch)

    pipe_times, bare_times = [], []
    for warm in range(2):  # warm-up, not timed
        rows = batch(warm)
        pipeline_step(run, settings, warm, rows)
        bare_step(bare_model, bare_opt, data[rows], loss_mask[rows], mask_id, 1e-3, gen, 1.0)
    for start in range(2, args.steps + 2, args.block):
        for step in range(start, min(start + args.block, args.steps + 2)):
            rows = batch(step)
            t0 = time.perf_counter()
            pipeline_step(run, settings, step, rows)
            pipe_times.append(time.perf_counter() - t0)
        for step in range(start, min(start + args.block, args.steps + 2)):
            rows = batch(step)
            t0 = time.perf_counter()
            bare_step(bare_model, bare_opt, data[rows], loss_mask[rows], mask_id, 1e-3, gen, 1.0)
            bare_times.append(time.perf_counter() - t0)
    pipe, bare = statistics.median(pipe_times), statistics.median(bare_times)
    print(f"threads={torch.get_num_threads()} batch={args.batch} seq={args.seq} vocab={args.vocab} steps={args.steps}")
    print(f"pipeline step (median): {pipe * 1000:8.1f} ms")
    print(f"bare PyTorch step     : {bare * 1000:8.1f} ms")
    print(f"ratio pipeline/bare   : {pipe / bare:8.3f}   (goal <= 1.05)")


if __name__ == "__main__":
    main()
