"""Sampler cost at equal output length, in one run: NFE, tokens/forward and tokens/s of every strategy's
own sampler, and for the absorbing samplers the confidence-threshold mode against the fixed schedule.

Uses the trained checkpoints of a pipeline workdir (default `work/compare`, what `make compare`
writes): threshold mode only saves forwards when the denoiser is confident, so a random model would
say nothing. Without trained checkpoints it falls back to random-init embedded-default models and
says so (timings still valid, threshold savings not).

    python benchmarks/sampling.py [--workdir work/compare] [--length 64] [--steps 64] [--block 16]
                                  [--prompts 4] [--threshold 0.9] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from strategies.sampling import SamplerConfig, absorbing_sample
from tasks.scoring import mean_entropy

PROMPTS = ["To be, or not to be", "My lord,", "What say you", "O", "Now is the winter", "Friends, Romans"]


def trained_checkpoints(workdir: Path) -> list[Path]:
    return sorted(p for p in (workdir / "store" / "train").glob("*/model") if (p / "dllm.json").is_file())


def random_models():
    """Random-init embedded-default models (llama 128×4) for every strategy, when nothing is trained."""
    from dllm_common.config import TokenizerConfig
    from strategies import assemble_strategy, strategy_class
    from strategies.models import build_model, tiny_model_config, wrap_for_architecture
    from tasks.prepare_data import shakespeare_documents, train_tokenizer

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
    from tasks.checkpoints import load_for_generation

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="work/compare")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
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
            kw = dict(
                mask_token_id=mask, pad_token_id=tokenizer.pad_token_id or 0, config=config, generator=gen, device="cpu"
            )
            if own:
                return strategy.sample(model, prompts, **kw)
            return absorbing_sample(strategy.denoiser(model), prompts, **kw)

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


if __name__ == "__main__":
    main()
