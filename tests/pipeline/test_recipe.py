"""The recipe of docs/architecture.md ("How a strategy plugs in"), followed by a test: a small strategy defined
here (its options, its class, its evaluator with its sampler, and its registration) is registered at run time and
goes through the pipeline's stages — config validation, prepare_data, train, evaluate, report and `dllm-flow
generate` — with nothing in `flows/`, `tasks/` or `strategies/` edited for it. If a step of the recipe stops being
enough, this test fails."""

import json

import pytest
import torch
from pydantic import Field
from stagekit import through_the_stages
from torch import nn

from strategies import DLLM_STRATEGIES, SAMPLERS, DLLMStrategy, registered
from strategies.base import CorruptedBatch, TokenCounts
from strategies.base_evaluation import DLLMEvaluator, SampleRequest
from strategies.corruption import mask_at_level
from strategies.losses import DLLMLossOutput, nll_at
from strategies.options import validate_config
from strategies.registration import Registration, SamplerInfo, StrategyOptions
from strategies.registry import REGISTRY
from strategies.sampling import SampleResult, prompt_canvas, truncate

# ---------------------------------------------------------------- step 1: the options


class FixedRateOptions(StrategyOptions):
    """Mask a fixed share of the supervised tokens (besides `mask_token_id`, `eps`)."""

    mask_rate: float = Field(0.5, gt=0, le=1)


# ---------------------------------------------------------------- step 2: the samplers


@torch.no_grad()
def one_shot_fill(denoise, prompts, *, mask_token_id, pad_token_id, config, generator, device, on_block=None):
    """Every [MASK] of the continuation filled by one forward, each drawn at the sampler's temperature."""
    x, attn, starts, width = prompt_canvas(
        prompts, config.max_new_tokens, mask_token_id, pad_token_id, config.eos_token_id, device
    )
    logits = denoise(x, attn).float()
    logits[..., mask_token_id] = -torch.inf
    if config.temperature == 0:
        draws = logits.argmax(-1)
    else:
        probs = torch.softmax(truncate(logits, config.top_k, config.top_p) / config.temperature, dim=-1)
        draws = torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=generator).view(x.shape)
    x = torch.where(x == mask_token_id, draws, x)
    if on_block is not None:
        on_block(x)
    return SampleResult(x, starts, width, nfe=1.0)


SAMPLERS_OF_FIXED_RATE = {"one_shot": SamplerInfo("every [MASK] at once, one forward (recipe test)")}


# ---------------------------------------------------------------- step 3: the class


class MaskedFlatLoss(nn.Module):
    """Cross-entropy at the masked supervised tokens ÷ the step's global noise count."""

    def forward(self, logits, batch: CorruptedBatch, counts: TokenCounts, *, causal_logits=None):
        total = nll_at(logits, batch.noise_mask.bool() & batch.loss_mask.bool(), batch.clean_ids).sum()
        total = total / max(int(counts.diffusion or 1), 1)
        return DLLMLossOutput(total, total.detach())


class FixedRateStrategy(DLLMStrategy):
    """Fixed-rate masking, flat loss over the noise count, no likelihood; the one-shot sampler."""

    name = "fixed_rate"
    Options = FixedRateOptions
    sampler_name = "one_shot_fill"
    samplers = tuple(SAMPLERS_OF_FIXED_RATE)
    # likelihoods: none (the base class's empty tuple): evaluation reports samples only

    @property
    def normalization_mode(self) -> str:
        return "noise"

    def create_loss_fn(self, dllm_cfg=None) -> nn.Module:
        return MaskedFlatLoss()

    def apply_corruption(self, input_ids, loss_mask, mask_token_id, *, generator=None, **_):
        rate = self.options.mask_rate
        noisy, noise = mask_at_level(input_ids, loss_mask, mask_token_id, rate, generator)
        return noisy, noise, torch.full(input_ids.shape, rate, device=input_ids.device)


class FixedRateEvaluator(DLLMEvaluator):
    """Its evaluation hooks: the one-shot sampler over the base evaluator's bidirectional denoiser (kept apart
    from the class, so that editing the sampler re-runs evaluation and never training)."""

    def sample(self, model, request: SampleRequest):
        return one_shot_fill(self.denoiser(model), request.prompts, **request.keywords())


# ---------------------------------------------------------------- step 4: the registration

REGISTRATION = Registration(FixedRateOptions, FixedRateStrategy, SAMPLERS_OF_FIXED_RATE, evaluator=FixedRateEvaluator)


def _spec(tiny_spec, **dllm):
    raw = tiny_spec.model_dump(mode="json")
    raw["pipeline"]["strategies"] = ["fixed_rate"]
    raw["train"].update(steps=30, val_every=5)
    raw["dllm"] = dllm
    return validate_config(raw)


def test_a_strategy_defined_here_goes_through_the_stages(tiny_spec, tmp_path):
    from tasks.prepare_data import prepare_data

    with registered("fixed_rate", REGISTRATION):
        spec = _spec(tiny_spec, mask_rate=0.4)  # a shared dllm: key only this strategy declares
        assert "fixed_rate" in DLLM_STRATEGIES and "one_shot" in SAMPLERS
        data = prepare_data(spec, str(tmp_path))
        staged = through_the_stages(spec, "fixed_rate", data, tmp_path)
    from tasks.train import model_dir

    assert json.loads((model_dir(staged.trained) / "dllm.json").read_text())["options"]["mask_rate"] == 0.4
    # no likelihood: no likelihood columns, no likelihood plot; its sampler reads only the temperature and cuts
    assert "eval/nelbo" not in staged.report and "eval/ar_nll" not in staged.report
    assert "## Samples against real text (temperature 1.0, top-p 0.95)" in staged.report
    # gone again once the block ends: from the registry and from everything derived from it
    assert "fixed_rate" not in REGISTRY and "fixed_rate" not in DLLM_STRATEGIES and "one_shot" not in SAMPLERS
    with pytest.raises(Exception, match="pipeline.strategies: unknown strategy 'fixed_rate'"):
        _spec(tiny_spec)
