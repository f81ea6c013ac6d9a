"""Block diffusion's options, samplers, model shape and registration (torch-free: config validation reads them
without the class)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field

from dllm_common.config import PipelineSpec
from strategies.registration import (
    TEMPERATURE_AND_CUTS,
    Registration,
    SamplerInfo,
    StrategyOptions,
    refuse_longer_than_rows,
)

BLOCK_DIFFUSION = "block_diffusion"  # the model shape a checkpoint records (`config.dllm_architecture`)


class BlockDiffusionOptions(StrategyOptions):
    """Encoder + noised canvas (docs/strategies.md §8.6, §9). `vocab_size` None: the model's."""

    vocab_size: int | None = Field(None, ge=2)
    block_size: int = Field(256, ge=1)
    self_conditioning_p: float = Field(0.5, ge=0, le=1)
    encoder_loss_weight: float = Field(1.0, ge=0)
    # how a canvas token's own evidence enters the prediction (docs/strategies.md §5.4); "learned": the reference
    own_token_evidence: Literal["analytic", "learned"] = "analytic"

    def check_against(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        super().check_against(spec, where)
        # the default (256) may exceed short rows: one canvas block per row, as block_size = seq_len; a value
        # written in the config that is longer than a row is a mistake
        if "block_size" in self.model_fields_set:
            refuse_longer_than_rows(spec, where("block_size"), self.block_size, " (data.seq_len: one block per row)")


SAMPLERS = {
    "canvas": SamplerInfo(
        "uniform-noise canvas decoding (block_diffusion)", settings=(*TEMPERATURE_AND_CUTS, "remasking")
    ),
}

REGISTRATION = Registration(
    BlockDiffusionOptions,
    "strategies.block_diffusion.strategy:BlockDiffusionStrategy",
    SAMPLERS,
    models={BLOCK_DIFFUSION: "strategies.block_diffusion.model:BlockDiffusionLM"},
)
