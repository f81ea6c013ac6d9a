"""MDLM's options and registration (torch-free: config validation reads them without the class)."""

from __future__ import annotations

from typing import Literal

from strategies.registration import ABSORBING, ABSORBING_SAMPLER, Registration, StrategyOptions


class MDLMOptions(StrategyOptions):
    """MDLM / LLaDA (docs/strategies.md §8.1)."""

    loss_weighting: Literal["elbo", "flat"] = "elbo"


SAMPLERS = {ABSORBING: ABSORBING_SAMPLER}

REGISTRATION = Registration(MDLMOptions, "strategies.mdlm.strategy:MDLMStrategy", SAMPLERS)
