"""SCDD's options, samplers and registration (torch-free: config validation reads them without the class)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from strategies.registration import (
    ABSORBING,
    ABSORBING_SAMPLER,
    TEMPERATURE_AND_CUTS,
    Registration,
    SamplerInfo,
    StrategyOptions,
)


class SCDDOptions(StrategyOptions):
    """SCDD (docs/strategies.md §8.2). `vocab_size` None: the model's."""

    vocab_size: int | None = Field(None, ge=3)
    num_timesteps: int = Field(1000, ge=2)
    uniform_ratio: float = Field(0.1, ge=0, lt=1)
    schedule_shape: float = Field(1.0, gt=0)
    schedule_peak: float = Field(0.5, gt=0, lt=1)
    chunk_size: int | None = Field(1024, ge=1)  # None: the loss over the whole vocabulary at once
    time_conditioning: bool = False  # the backbone reads the noise level t (as the SCDD reference's does)
    # training steps over which the uniform channel's share of the *input* noise ramps from 0 to uniform_ratio;
    # the loss keeps its coefficients, so from then on it is the exact bound (docs/strategies.md §8.2)
    uniform_warmup_steps: int = Field(0, ge=0)
    # "flat": each row's bound term rescaled to cross-entropy scale (≈ ×t), as MDLM's flat (§5.8)
    loss_weighting: Literal["elbo", "flat"] = "elbo"
    # the sampler's final pass and where its temperature acts; the reference: "argmax", "weights" (§11.5)
    noise_removal: Literal["posterior", "argmax"] = "posterior"
    tempering: Literal["draws", "weights"] = "draws"


SAMPLERS = {
    "scdd": SamplerInfo(
        "ancestral posterior sampler with the final noise-removal pass (scdd)",
        settings=(*TEMPERATURE_AND_CUTS, "remasking"),
        decoding=("steps",),  # the whole canvas at every step: no blocks, nothing cached (docs/decoding.md §2)
    ),
    ABSORBING: ABSORBING_SAMPLER,
}

REGISTRATION = Registration(
    SCDDOptions,
    "strategies.scdd.strategy:SCDDStrategy",
    SAMPLERS,
    evaluator="strategies.scdd.evaluation:SCDDEvaluator",
)
