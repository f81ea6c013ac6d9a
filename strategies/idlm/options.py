"""I-DLM's options, samplers and registration (torch-free: config validation reads them without the class)."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field

from dllm_common.config import PipelineSpec
from strategies.registration import (
    ABSORBING_SAMPLER,
    Registration,
    SamplerInfo,
    StrategyOptions,
    refuse_longer_than_rows,
)


class IDLMOptions(StrategyOptions):
    """Introspective diffusion (docs/strategies.md §8.4)."""

    block_length: int = Field(1, ge=1)
    clean_loss_weight: float = Field(0.2, ge=0)
    auto_balance_clean_loss: bool = False

    def check_against(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        super().check_against(spec, where)
        refuse_longer_than_rows(spec, where("block_length"), self.block_length, "")


SAMPLERS = {
    # the absorbing sampler over the causal denoiser, reading row p from the model's row p − 1
    "idlm": SamplerInfo("absorbing sampler with logit shift 1 (idlm)", True, settings=ABSORBING_SAMPLER.settings),
    # `block_length` proposals per forward until the continuation is done: no step budget, no sampler blocks
    "isd": SamplerInfo(
        "introspective strided decoding: propose with the diffusion half, verify causally (idlm)", decoding=("cache",)
    ),
}

REGISTRATION = Registration(
    IDLMOptions,
    "strategies.idlm.strategy:IDLMStrategy",
    SAMPLERS,
    evaluator="strategies.idlm.evaluation:IDLMEvaluator",
    estimators=("exact_ar",),  # its clean half is an exact causal LM (JustGRPO's idea)
)
