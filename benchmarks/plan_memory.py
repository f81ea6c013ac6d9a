"""The plan's memory against a real training step on this CPU, for every strategy, model size and memory setting.

    python benchmarks/plan_memory.py [--sizes s,m,l] [--strategies mdlm,...] [--threads 2]

For each case the planner (`tasks.commands.plan`, fake tensors, nothing allocated) predicts the peak of one training
step, then the step really runs: the model built by the training code (`tasks.training.trainee.build_trainee`, weights
initialized), AdamW, one warm-up step (the optimizer's moments come into being), then the measured step
(`tasks.training.loop.train_step`: forward/backward of every micro-batch, clipping, the AdamW update) on the same rows
and noise the planner traced.

What is measured: CPU allocator events (`torch.profiler` with `profile_memory=True`: every allocation and free of
PyTorch's CPU allocator, with its size). Their running sum over the step, at its highest, is the step's peak above
its start; the memory held at its start is the bytes of the weights, buffers, AdamW moments and a frozen target
(counted from those tensors). The allocator sees what a fake run cannot (scratch inside kernels); the process's
resident size (RSS) would add Python, libraries and the allocator's freed-but-kept pages, which is noise at these
sizes, so RSS is not used. Prediction and measurement share no code: the prediction is a fake-tensor trace, the
measurement the allocator's own accounting of a real run.

Columns: total = held + step peak (what a device needs); step = the peak above the start (activations, gradients,
the update's scratch); ratio = predicted ÷ measured; the last column is the planned FLOPs of the step against
`torch.utils.flop_counter.FlopCounterMode` over the real warm-up step. Exits non-zero if a memory ratio is outside
1 ± `--tolerance` or the FLOPs differ by more than 1 % (a micro-batch after the first draws its own noise,
which can change how many positions a strategy selects; the planner traces the first).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# block_diffusion is transformers' DiffusionGemma (its default); `block_diffusion:stack` its shape over a causal LM
STRATEGIES = ("mdlm", "scdd", "hybrid", "idlm", "block_diffusion", "block_diffusion:stack", "dflash")
# (hidden, layers, heads, vocabulary, sequence, rows per micro-batch, micro-batches, precision); the planner traces a
# model deeper than 4 layers with 3 and extends the timeline to its depth
SIZES = {
    "s": (64, 2, 4, 4096, 128, 4, 1, "fp32"),
    "m": (128, 6, 4, 8192, 256, 4, 1, "fp32"),
    "l": (256, 8, 8, 16384, 256, 2, 2, "fp32"),
    "m-bf16": (128, 6, 4, 8192, 256, 4, 1, "bf16"),
    "l-bf16": (256, 8, 8, 16384, 256, 2, 2, "bf16"),
    "xs": (32, 5, 2, 1024, 64, 2, 1, "fp32"),  # the test suite's (tests/pipeline/test_plan.py)
}
DRAFT_LAYERS, TARGET_LAYERS = 1, 6


def word_tokenizer(vocab: int, dest: Path) -> Path:
    """A word-level tokenizer of exactly `vocab` entries (the model's vocabulary) with pad/eos/mask specials."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab - 1)}, "<mask>": vocab - 1}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<pad>")),
        pad_token="<pad>",
        eos_token="<eos>",
        mask_token="<mask>",
    )
    fast.save_pretrained(dest)
    return dest


def prepare(work: Path, size: str) -> None:
    """The tokenizer of a size's vocabulary, where the config names it and where the training reads it."""
    vocab = SIZES[size][3]
    if not (work / f"tokenizer-{vocab}").exists():
        word_tokenizer(vocab, work / f"tokenizer-{vocab}")
    word_tokenizer(vocab, work / "data" / "tokenizer")


def spec_for(name: str, size: str, fused: bool, ckpt: bool, work: Path, architecture: str = ""):
    from strategies.options import validate_config

    hidden, layers, heads, vocab, seq, rows, micro, precision = SIZES[size]
    raw = {
        "pipeline": {"strategies": [name]},
        "data": {"seq_len": seq},
        "tokenizer": {"kind": "pretrained", "path": str(work / f"tokenizer-{vocab}")},
        "model": {"hidden_size": hidden, "num_layers": layers, "num_heads": heads, "tie_embeddings": True},
        "train": {
            "global_batch_size": rows * micro,
            "micro_batch_size": rows,
            "fused_head": fused,
            "activation_checkpointing": ckpt,
            "precision": precision,
            "device": "cpu",
        },
        "dllm": {"mask_token_id": vocab - 1},
    }
    if architecture:
        raw["dllm"]["architecture"] = architecture
    if name == "dflash":
        raw["model"]["num_layers"] = DRAFT_LAYERS
        raw["dflash"] = {
            "target_model_id": str(work / f"target-{size}"),
            "block_size": 4,
            "num_blocks_per_sample": 4,
            "cache_dtype": "bf16",
        }
    return validate_config(raw)


def dflash_inputs(spec, size: str, work: Path) -> dict:
    """The stages a DFlash training reads: a small causal target (saved like a user's checkpoint) and its feature
    cache over the rows the step trains on."""
    import torch

    from strategies.dflash.blocks import build_target_layer_ids
    from strategies.dflash.features import write_feature_cache
    from strategies.models import build_model, tiny_model_config
    from tasks.commands.plan import synthetic_rows
    from tasks.common import StageRef

    hidden, _, heads, vocab, seq, rows, micro, _ = SIZES[size]
    target_dir, cache = work / f"target-{size}", work / f"features-{size}"
    if not (target_dir / "config.json").is_file():
        config = tiny_model_config("llama", vocab, seq, hidden, TARGET_LAYERS, heads, None, None, True)
        build_model(config, 0, dllm_attention="causal").save_pretrained(target_dir)
    if not (cache / "features" / "index.json").is_file():
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
        ids = synthetic_rows(spec, "dflash", rows * micro, vocab, spec.train.seed).input_ids
        layer_ids = build_target_layer_ids(TARGET_LAYERS, DRAFT_LAYERS)
        with torch.no_grad():
            write_feature_cache(target, {"train": ids}, layer_ids, cache / "features", dtype="bf16")
    info = {"model_path": str(target_dir), "num_layers": TARGET_LAYERS}
    return {
        "target": StageRef("target", size, str(target_dir), info=info),
        "features": StageRef("cache", size, str(cache)),
    }


def measure(spec, name: str, work: Path, inputs: dict) -> tuple[int, int, int]:
    """(bytes held at the measured step's start, its allocator peak above that start, the FLOPs of the warm-up step
    as PyTorch's own counter sees its operations: every micro-batch's forward and backward; the optimizer and the
    clipping have no matmuls)."""
    from torch.utils.flop_counter import FlopCounterMode

    from tasks.commands.plan import CPU_ATTENTION_FLOPS, synthetic_rows
    from tasks.common import StageRef
    from tasks.training.distributed import DistInfo
    from tasks.training.loop import LoopRun, LoopSettings, step_context, train_step
    from tasks.training.runtime import OptimSettings, make_optimizer
    from tasks.training.trainee import build_trainee

    data = StageRef("prepare_data", "plan", str(work / "data"))
    trainee = build_trainee(spec, name, data, "cpu", inputs)
    opt, sched = make_optimizer(trainee.model, OptimSettings.of(spec.train))
    run = LoopRun(trainee=trainee, stepper=trainee.model, opt=opt, sched=sched, train=None, val=None, device="cpu")
    settings = LoopSettings.of(spec.train, name)
    t = spec.train
    config = getattr(trainee.strategy, "target", trainee.model).config  # a DFlash draft's vocabulary: its target's
    vocab = config.get_text_config().vocab_size
    mbs = [
        synthetic_rows(spec, name, t.micro_batch_size, vocab, spec.train.seed)
        for _ in range(t.global_batch_size // t.micro_batch_size)
    ]
    ctx = step_context(trainee, 0, t.seed, trainee.model, DistInfo(), len(mbs))
    counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)
    with counter:  # the moments are made; the measured step repeats step 0's noise
        train_step(run, settings, ctx, mbs)
    held = held_bytes(trainee, opt)
    return held, allocator_peak(lambda: train_step(run, settings, ctx, mbs)), counter.get_total_flops()


def held_bytes(trainee, opt) -> int:
    """Bytes of what a training holds between steps: weights, buffers, AdamW's state, a frozen target."""
    import torch

    tensors = [*trainee.model.parameters(), *trainee.model.buffers()]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    target = getattr(trainee.strategy, "target", None)
    if target is not None:
        tensors += [*target.parameters(), *target.buffers()]
    return sum(x.numel() * x.element_size() for x in tensors)


def allocator_peak(fn) -> int:
    """The most bytes PyTorch's CPU allocator had handed out above its level when `fn` started, while it ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=_start)
    level = peak = 0
    for event in events:
        level += event.nbytes()
        peak = max(peak, level)
    return peak


def _start(event) -> int:
    return event.start_ns()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="s,l,m-bf16")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.15)
    args = ap.parse_args()
    import torch
    import transformers

    from strategies import strategy_class
    from tasks.commands.plan import Cluster, plan_strategy, size

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    cpu = Cluster(1, None, device="cpu")
    rows, worst, worst_flops, t0 = [], 0.0, 0.0, time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(
            "| strategy | size | settings | predicted total | measured total | ratio | predicted step | measured step "
            "| ratio | FLOPs/token planned ÷ counted |\n|---|---|---|---|---|---|---|---|---|---|",
            flush=True,
        )
        for size_name in args.sizes.split(","):
            prepare(work, size_name)
            for case in args.strategies.split(","):
                name, _, architecture = case.partition(":")
                cls = strategy_class(name)
                for fused in (True, False) if cls.trains == "denoiser" else (True,):
                    for ckpt in (False, True) if cls.supports_activation_checkpointing else (False,):
                        spec = spec_for(name, size_name, fused, ckpt, work, architecture)
                        inputs = dflash_inputs(spec, size_name, work) if cls.trains == "draft" else {}
                        p = plan_strategy(spec, name, cpu, variants=False)
                        held_pred = p.resident.weights + p.resident.optimizer + p.resident.frozen
                        held, step, counted = measure(spec, name, work, inputs)
                        total_ratio, step_ratio = p.peak / (held + step), (p.peak - held_pred) / step
                        tokens = spec.data.seq_len * spec.train.global_batch_size
                        flops_ratio = p.flops_per_token * tokens / counted
                        worst = max(worst, abs(total_ratio - 1), abs(step_ratio - 1))
                        worst_flops = max(worst_flops, abs(flops_ratio - 1))
                        settings = ("fused head" if fused else "full logits") + (", checkpointing" if ckpt else "")
                        if cls.trains == "draft":
                            settings = "draft, cached features"
                        print(
                            f"| {case} | {size_name} | {settings} | {size(p.peak)} | {size(held + step)} "
                            f"| {total_ratio:.3f} | {size(p.peak - held_pred)} | {size(step)} | {step_ratio:.3f} "
                            f"| {flops_ratio:.4f} |",
                            flush=True,
                        )
                        rows.append((total_ratio, step_ratio))
    ok = worst <= args.tolerance and worst_flops <= 0.01
    print(
        f"\n{len(rows)} cases in {time.time() - t0:.0f} s; largest memory deviation {worst:.1%} "
        f"({'within' if worst <= args.tolerance else 'OUTSIDE'} ±{args.tolerance:.0%}); largest FLOPs deviation "
        f"{worst_flops:.1e} (the planned count against FlopCounterMode over the real step)"
    )
    sys.exit(0 if ok and not math.isnan(worst) else 1)


if __name__ == "__main__":
    main()
