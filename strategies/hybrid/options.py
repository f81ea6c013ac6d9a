"""The hybrid's options, samplers and registration (torch-free: config validation reads them without the class)."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field

from dllm_common.config import PipelineSpec
from strategies.registration import (
    ABSORBING,
    ABSORBING_SAMPLER,
    MASKED_ESTIMATORS,
    TEMPERATURE_AND_CUTS,
    Registration,
    SamplerInfo,
    StrategyOptions,
    refuse_longer_than_rows,
)

HYBRID = "hybrid"  # the model shape a checkpoint records (`config.dllm_architecture`)


class HybridOptions(StrategyOptions):
    """Hybrid diffusion + AR (docs/strategies.md §8.3). `block_size` None: one uniform level per row."""

    ar_loss_alpha: float = Field(1.0, ge=0)
    block_size: int | None = Field(None, ge=1)
    half_life_ratio: float = Field(0.25, gt=0)

    def check_against(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        super().check_against(spec, where)
        hint = " (or leave it unset for one noise level per row)"
        refuse_longer_than_rows(spec, where("block_size"), self.block_size, hint)


SAMPLERS = {
    "hybrid": SamplerInfo(
        "blocks seeded by the causal branch, completed by diffusion (hybrid)",
        settings=(*TEMPERATURE_AND_CUTS, "remasking", "threshold"),
    ),
    ABSORBING: ABSORBING_SAMPLER,  # on the diffusion branch
}

REGISTRATION = Registration(
    HybridOptions,
    "strategies.hybrid.strategy:HybridStrategy",
    SAMPLERS,
    models={HYBRID: "strategies.hybrid.model:HybridLM"},
    evaluator="strategies.hybrid.evaluation:HybridEvaluator",
    estimators=(*MASKED_ESTIMATORS, "exact_ar"),  # the diffusion branch, or the causal branch exactly
)
