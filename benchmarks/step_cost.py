"""What a training step of each strategy costs against the plain causal-LM step of the same backbone (issue 45).

For every registered strategy the pipeline's own step (`tasks.training.loop.train_step`: corruption, forward,
backward, clip, AdamW) and a causal-LM step of the same backbone, batch and precision (`strategies.causal`'s
objective through the same `train_step`) alternate, one after the other, so machine noise hits both; the median
of the per-pair ratios is printed beside what the strategy's method predicts and what the planner's FLOPs count
(`tasks.commands.plan`) predicts. `measured ÷ FLOPs` above ~1.1 is overhead the counted matmuls do not explain.
DFlash: the draft's step on cached target features (`CachedFeatures`, written once) against the target's own
causal step.

    python benchmarks/step_cost.py                       # CPU, tiny models, ~2-3 min on 2 cores
    python benchmarks/step_cost.py --explain             # + graph breaks of each compiled layer, attention paths
    python benchmarks/step_cost.py --device cuda --dtype bfloat16   # ~1 B parameters, seq 2048, MFU column
    python benchmarks/step_cost.py --device cuda --json cost.json   # + the file dllm-flow plan --step-cost reads

No timing is asserted: the script prints, a reader judges (docs/benchmarks.md, "step_cost.py").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from strategies.assembly import strategy_class  # noqa: E402
from strategies.causal import CausalLMObjective  # noqa: E402
from strategies.head import make_head_deferrable  # noqa: E402
from strategies.models import DLLMOutput, build_model  # noqa: E402
from strategies.options import resolve_options, validate_config  # noqa: E402
from strategies.registry import REGISTRY  # noqa: E402
from tasks.commands.plan import Cluster, plan_strategy, synthetic_rows, trace  # noqa: E402
from tasks.commands.plan.trace import Tracer  # noqa: E402
from tasks.training.distributed import DistInfo  # noqa: E402
from tasks.training.loop import LoopRun, LoopSettings, run_step, step_context, train_step  # noqa: E402
from tasks.training.runtime import OptimSettings, Split, Trainee, make_optimizer  # noqa: E402
from tasks.training.trainee import (  # noqa: E402
    TokenIds,
    assembled_denoiser,
    assembled_draft,
    compile_layers,
    denoiser_model,
    own_shape,
    tiny_config,
)

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}
CLOCK = time.perf_counter  # --clock cpu: time.process_time (the process's CPU time, all threads)
# sizes: (hidden, layers, heads, seq, batch, vocab, steps)
CPU = (128, 4, 4, 128, 8, 2048, 12)
GPU = (2048, 16, 16, 2048, 4, 32768, 12)


# ------------------------------------------------------------------ the config and the models


def make_spec(args, draft: bool = False) -> object:
    """The pipeline config of the run; `draft`: `model:` is a DFlash draft's (`--draft-layers`) and the target is
    `--layers` deep."""
    names = [n for n in REGISTRY if (strategy_class(n).trains == "draft") == draft]
    shape = {"block_size": args.dflash_block, "num_blocks_per_sample": args.dflash_blocks}  # blocks share a row's keys
    if getattr(args, "dflash_variant", "dflash") != "dflash":  # the draft's variant (docs/strategies.md §10.11-§10.17)
        shape["draft_variant"] = args.dflash_variant
    overrides = {n: shape for n in names if draft}
    return validate_config(
        {
            "pipeline": {"name": "step-cost", "strategies": names},
            "data": {"seq_len": args.seq, "shape": "pretrain"},
            "tokenizer": {"vocab_size": args.vocab},
            "model": {
                "hidden_size": args.hidden,
                "num_layers": args.draft_layers if draft else args.layers,
                "num_heads": args.heads,
                "attn_implementation": args.attn,
            },
            "train": {
                "global_batch_size": args.batch,
                "micro_batch_size": args.batch,
                "warmup_steps": 0,
                "schedule": "constant",
                "precision": "bf16" if args.dtype == "bfloat16" else "fp32",
                "fused_head": not args.no_fused_head,
                "compile": args.compile,
                "device": args.device,
            },
            "dllm": {"overrides": overrides},
            "dflash": {"pretrain": {"num_layers": args.layers, "num_heads": args.heads}},
        }
    )


class EncoderCausalLM(nn.Module):
    """A DiffusionGemma's encoder as a plain causal LM (its layers over the clean row, its capped head): the causal
    step of block_diffusion's backbone."""

    def __init__(self, gemma: nn.Module):
        super().__init__()
        self.gemma, self.config = gemma, gemma.config

    def forward(self, input_ids, attention_mask=None, **_):
        hidden = self.gemma.model.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return DLLMOutput(logits=self.gemma.canvas_logits(hidden))


def causal_backbone(spec, name: str, vocab: int) -> nn.Module:
    """The backbone `train[name]` trains as a plain causal LM: a DiffusionGemma's encoder (`EncoderCausalLM`, the
    model built by the train stage's `denoiser_model`), else the same tiny model with causal attention."""
    options = resolve_options(spec, name)
    if own_shape(name, options) is not None:
        return EncoderCausalLM(denoiser_model(spec, name, options, TokenIds(vocab)))
    return build_model(tiny_config(spec, vocab), spec.train.seed, dllm_attention="causal")


def with_head(spec, model: nn.Module) -> tuple[nn.Module, bool]:
    """The fused head and `train.compile` as the trainee gets them."""
    fused = spec.train.fused_head and make_head_deferrable(model, spec.train.head_chunk_rows)
    compiled(spec, model)
    return model, bool(fused)


def compiled(spec, model: nn.Module) -> None:
    """`train.compile` as the train stage applies it. `compile_layers` finds no `model.layers` in a DiffusionGemma
    (the train stage refuses train.compile for it): its encoder's and decoder's layers are compiled here instead,
    and the run says so."""
    if spec.train.compile:
        inner = getattr(model, "gemma", model)
        try:
            compile_layers(inner)
        except ValueError:
            text = getattr(getattr(inner, "model", None), "encoder", None)
            layers = [*text.language_model.layers, *inner.model.decoder.layers] if text is not None else []
            if not layers:
                raise
            print(f"[step_cost] train.compile refuses {type(inner).__name__}: its {len(layers)} layers compiled here")
            for layer in layers:
                layer.compile()


def causal_trainee(spec, model: nn.Module) -> Trainee:
    model, fused = with_head(spec, model.train().requires_grad_(True))
    objective = CausalLMObjective()
    return Trainee(
        model=model,
        tokenizer=None,
        strategy=objective,
        loss_fn=objective.create_loss_fn(),
        mask_token_id=None,
        precision=spec.train.precision,
        fused_head=fused,
    )


def denoiser_trainee(spec, name: str, vocab: int) -> Trainee:
    """`train[name]`'s trainee, built by the train stage's `assembled_denoiser` for a tokenizer of `vocab` ids."""
    options = resolve_options(spec, name)
    trainee = assembled_denoiser(spec, name, options, TokenIds.planned(options, vocab))
    compiled(spec, trainee.model)
    return trainee


def dflash_pair(spec, name: str, vocab: int, rows: torch.Tensor, device: str, work: Path):
    """(draft trainee on cached features, the target as a causal trainee): the target is built as
    `pretrain_target` builds it, its features written once over `rows` as `cache_target` writes them, the draft
    by the train stage's `assembled_draft`."""
    from strategies.dflash.features import CachedFeatures, write_feature_cache
    from tasks.common import StageRef
    from tasks.speculative.setup import layer_ids_for
    from tasks.speculative.target import new_target

    options = resolve_options(spec, name)
    target = new_target(spec, vocab).to(device).eval().requires_grad_(False)
    ref = StageRef("target", "bench", "", info={"num_layers": target.config.num_hidden_layers})
    write_feature_cache(
        target,
        {"train": rows},
        layer_ids_for(spec, ref),
        work,
        dtype=spec.dflash.cache_dtype,
        top_k=options.distill_top_k,
    )
    tokens = TokenIds.planned(options, vocab)
    trainee = assembled_draft(spec, name, target, ref, tokens, cache=CachedFeatures(work))
    if spec.train.compile:  # as draft_trainee does
        compile_layers(trainee.model)
    trainee.model.to(device)
    return trainee, causal_trainee(spec, new_target(spec, vocab))


# ------------------------------------------------------------------ FLOPs: the planner's count


def planned_flops(spec, name: str, device: str) -> tuple[float, float]:
    """FLOPs of one step of `name` as `dllm-flow plan` counts them (every matmul and attention, every pass), and
    the share of them that is causal attention (`causal_share`)."""
    with causal_share() as share:
        plan = plan_strategy(spec, name, Cluster(1, None, device=device), variants=False, sizing=False)
    return plan.flops_per_token * spec.data.seq_len * spec.train.global_batch_size, share()


@contextlib.contextmanager
def causal_share():
    """Within the block, the planner's counts are tallied: yields a function giving the share of the counted FLOPs
    that attention with `is_causal` set has. The planner counts that attention in full (L² scores), while the kernel
    skips the masked half, so a causal step does less attention than its count says."""
    original, tally = trace._count_flops, {"all": 0, "causal": 0}

    def counted(func, args, kwargs, out):
        n = original(func, args, kwargs, out)
        tally["all"] += n
        if n and "scaled_dot_product" in func.__name__:
            names = [a.name for a in func._schema.arguments]
            at = names.index("is_causal") if "is_causal" in names else len(args)
            flag = kwargs.get("is_causal", args[at] if at < len(args) else False)
            tally["causal"] += n if flag is True else 0
        return n

    trace._count_flops = counted
    try:
        yield lambda: tally["causal"] / max(tally["all"], 1)
    finally:
        trace._count_flops = original


def causal_flops(spec, name: str, vocab: int) -> tuple[float, float]:
    """FLOPs of the causal step of `name`'s backbone (the DFlash target for dflash), counted by the planner's
    tracer through the same `run_step` on fake weights, and their causal-attention share."""
    tracer = Tracer()
    with tracer, torch.random.fork_rng(devices=[]):
        if strategy_class(name).trains == "draft":
            from tasks.speculative.target import new_target

            model = new_target(spec, vocab)
        else:
            model = causal_backbone(spec, name, vocab)
        fused = bool(spec.train.fused_head and make_head_deferrable(model, spec.train.head_chunk_rows))
        trainee = Trainee(
            model=model,
            tokenizer=None,
            strategy=CausalLMObjective(),
            loss_fn=nn.Identity(),
            mask_token_id=None,
            precision=spec.train.precision,
            fused_head=fused,
        )
    rows = synthetic_rows(spec, "mdlm", spec.train.micro_batch_size, vocab, spec.train.seed)
    tracer.reset()
    tracer.tracking = True
    try:
        with tracer, torch.random.fork_rng(devices=[]), causal_share() as share:
            run_step(trainee, step_context(trainee, 0, spec.train.seed, model, DistInfo(), 1), [rows], True)
    finally:
        tracer.tracking = False
    return float(tracer.flops), share()


# ------------------------------------------------------------------ timing


class Side:
    """One trainee with its optimizer, stepped through the loop's `train_step`."""

    def __init__(self, spec, trainee: Trainee, rows: torch.Tensor, device: str):
        self.trainee, self.device = trainee, device
        self.params = sum(p.numel() for p in trainee.model.parameters() if p.requires_grad)
        opt, sched = make_optimizer(trainee.model, OptimSettings.of(spec.train))
        mask = torch.ones(rows.shape)
        self.split = Split(rows, mask, torch.ones(rows.shape, dtype=torch.long))
        self.run = LoopRun(
            trainee=trainee,
            stepper=trainee.model,
            opt=opt,
            sched=sched,
            train=self.split,
            val=self.split,
            device=device,
        )
        self.settings = LoopSettings.of(spec.train, "step-cost")
        self.batch = spec.train.global_batch_size

    def step(self, step: int) -> float:
        ctx = step_context(self.trainee, step, 0, self.trainee.model, DistInfo(), 1, self.settings.steps)
        rows = torch.arange(step * self.batch, (step + 1) * self.batch) % len(self.split.ids)
        mbs = self.split.microbatches(rows, self.batch, self.device)
        sync(self.device)
        t0 = CLOCK()
        train_step(self.run, self.settings, ctx, mbs)
        sync(self.device)
        return CLOCK() - t0


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(spec, name: str, args, work: Path) -> dict:
    vocab, device = args.vocab, args.device
    total = (args.steps + args.warmup) * args.batch
    rows = synthetic_rows(spec, name, total, vocab, spec.train.seed).input_ids
    if strategy_class(name).trains == "draft":
        trainee, base = dflash_pair(spec, name, vocab, rows, device, work / name)
    else:
        trainee = denoiser_trainee(spec, name, vocab)
        trainee.model.to(device)
        base = causal_trainee(spec, causal_backbone(spec, name, vocab))
    base.model.to(device)
    strat, causal = Side(spec, trainee, rows, device), Side(spec, base, rows, device)
    for step in range(args.warmup):
        strat.step(step), causal.step(step)
    pairs = []
    for step in range(args.warmup, args.warmup + args.steps):  # interleaved: noise hits both sides
        if step % 2:  # which side goes first alternates too
            a = strat.step(step)
            b = causal.step(step)
        else:
            b = causal.step(step)
            a = strat.step(step)
        pairs.append((a, b))
    out = {
        "strategy": strat_ms(pairs, 0),
        "causal": strat_ms(pairs, 1),
        "ratio": statistics.median(a / b for a, b in pairs),
        "params": strat.params,
        "causal_params": causal.params,
    }
    if args.explain:
        from step_cost_explain import explain_side  # benchmarks/: graph breaks and attention paths

        out["explain"] = explain_side(strat, args.warmup + args.steps)
        out["explain_causal"] = explain_side(causal, args.warmup + args.steps)
    del strat, causal, trainee, base
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def strat_ms(pairs, side: int) -> float:
    return statistics.median(p[side] for p in pairs) * 1000


# ------------------------------------------------------------------ the run


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="default: fp32 on CPU, bf16 on GPU")
    ap.add_argument("--strategies", nargs="*", default=None, help="default: every registered strategy")
    for flag in ("hidden", "layers", "heads", "seq", "batch", "vocab", "steps"):
        ap.add_argument(f"--{flag}", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--draft-layers", type=int, default=1, help="DFlash draft depth (its target is --layers deep)")
    ap.add_argument("--dflash-block", type=int, default=8)
    ap.add_argument("--dflash-blocks", type=int, default=1, help="dflash.num_blocks_per_sample")
    ap.add_argument(
        "--dflash-variant",
        default="dflash",
        choices=("dflash", "dflash2", "jetspec", "domino", "dspark"),
        help="dflash.draft_variant of the DFlash draft timed",
    )
    ap.add_argument(
        "--attn", default="sdpa", choices=("sdpa", "flex_attention", "eager"), help="model.attn_implementation"
    )
    ap.add_argument("--no-fused-head", action="store_true", help="full logits (train.fused_head: false)")
    ap.add_argument("--compile", action="store_true", help="train.compile: torch.compile each decoder layer")
    ap.add_argument("--no-flops", action="store_true", help="skip the planner's FLOPs count")
    ap.add_argument(
        "--explain",
        action="store_true",
        help="graph breaks (torch._dynamo.explain) and attention paths (eager layers: leave out --compile)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="cpu: the process's CPU time (all threads) instead of wall time, on a CPU shared with other work",
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by GPU name)")
    ap.add_argument("--json", metavar="FILE", help="also write what was measured (dllm-flow plan --step-cost FILE)")
    args = ap.parse_args()
    if args.json and args.no_flops:
        ap.error("--json writes measured ÷ FLOPs: leave out --no-flops")
    return args


def settle(args: argparse.Namespace) -> float | None:
    """Checks, the clock, the defaults of the device's table; returns the peak TFLOP/s the MFU columns use."""
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("step_cost: no CUDA device here (run without --device cuda for the CPU table)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if args.device == "cuda":
            sys.exit("step_cost: --clock cpu times CPU work; a GPU step is timed by the wall clock")
        global CLOCK
        CLOCK = time.process_time
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    defaults = GPU if args.device == "cuda" else CPU
    for flag, value in zip(("hidden", "layers", "heads", "seq", "batch", "vocab", "steps"), defaults):
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    if args.device == "cuda":
        gpu = torch.cuda.get_device_name(0)
        return args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in gpu), None)
    return args.peak_tflops  # the MFU columns of a CPU run against a given peak (their code path, on this machine)


def measure_all(names: list[str], args, spec, draft_spec) -> tuple[dict, dict, dict]:
    """(results, spec per strategy, failures): one strategy failing (a kernel, memory) must not hide the others."""
    results, spec_of, failures = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            t0 = time.time()
            spec_of[name] = draft_spec if strategy_class(name).trains == "draft" else spec
            try:
                res = measure(spec_of[name], name, args, Path(tmp))
            except Exception as exc:  # noqa: BLE001
                text = str(exc).strip()
                failures[name] = f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"
                print(f"[step_cost] {name}: FAILED, {failures[name]}", flush=True)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                continue
            if not args.no_flops:
                res["flops"], res["flops_causal_share"] = planned_flops(spec_of[name], name, args.device)
                res["causal_flops"], res["causal_causal_share"] = causal_flops(spec_of[name], name, args.vocab)
            results[name] = res
            print(f"[step_cost] {name}: {res['ratio']:.2f}x the causal step ({time.time() - t0:.0f} s)", flush=True)
    return results, spec_of, failures


def main() -> None:
    args = parse_args()
    peak = settle(args)
    spec, draft_spec = make_spec(args), make_spec(args, draft=True)
    print(
        f"[step_cost] {args.device} threads={torch.get_num_threads()} torch {torch.__version__} dtype={args.dtype} "
        f"hidden={args.hidden} layers={args.layers} heads={args.heads} seq={args.seq} batch={args.batch} "
        f"vocab={args.vocab} steps={args.steps} clock={args.clock} fused_head={spec.train.fused_head} "
        f"compile={spec.train.compile} attn={args.attn}",
        flush=True,
    )
    results, spec_of, failures = measure_all(args.strategies or list(REGISTRY), args, spec, draft_spec)
    from step_cost_table import print_table  # benchmarks/: the table and each method's expected ratio

    print_table(spec_of, results, args, peak)
    if args.json:
        from step_cost_json import write_run  # benchmarks/: the file dllm-flow plan --step-cost reads

        print(f"[step_cost] wrote {write_run(args.json, results, failures, args)}")
    for name, why in failures.items():
        print(f"- {name}: FAILED, {why}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
