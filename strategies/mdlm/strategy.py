"""`mdlm` strategy (docs/strategies.md §8.1): MDLM / LLaDA masked diffusion with the absorbing [MASK] kernel."""

from __future__ import annotations

from torch import nn

from strategies.base import DLLMStrategy
from strategies.corruption import corrupt_uniform
from strategies.mdlm.loss import MDLMCrossEntropyLoss
from strategies.mdlm.options import SAMPLERS, MDLMOptions
from strategies.registration import StrategyOptions


class MDLMStrategy(DLLMStrategy):
    """MDLM / LLaDA masked diffusion (docs/strategies.md §8.1): absorbing [MASK] kernel, 1/p-weighted CE.
    The base class's defaults (noisy ids in, the forward/backward, the absorbing bound and sampler) are MDLM's."""

    name = "mdlm"
    Options = MDLMOptions
    likelihoods = ("nelbo",)
    samplers = tuple(SAMPLERS)

    def create_loss_fn(self, dllm_cfg: StrategyOptions | dict | None = None) -> nn.Module:
        options = self.options if dllm_cfg is None else self.coerce_options(dllm_cfg)
        return MDLMCrossEntropyLoss(weighting=options.loss_weighting)

    def apply_corruption(
        self, input_ids, loss_mask, mask_token_id, *, eps, block_size, half_life_ratio, generator=None
    ):
        return corrupt_uniform(input_ids, loss_mask, mask_token_id, eps=eps, generator=generator)
