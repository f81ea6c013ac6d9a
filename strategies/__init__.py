"""dLLM math and the strategy registry: one package per strategy, and the maths they share.

Each strategy lives in `strategies/<name>/` (options, samplers and registration in `options.py`, its class in
`strategy.py`, what only it computes beside them); `strategies.registry.REGISTRY` lists them. The shared maths
sit in modules named for what they compute: `corruption` (noise kernels), `losses` (losses and bounds),
`posteriors` (reverse steps of the uniform kernel), `masks` (attention masks), `absorbing` (the absorbing
sampler), `sampling` (what every sampler shares). Pure of Prefect and MLflow; the math in `docs/strategies.md`.

Importing the package loads the API — the strategy base types and the registry (`DLLMStrategy`,
`DLLM_STRATEGIES`, `get_dllm_strategy`, `strategy_class`, `assemble_strategy`, `register`) — and no strategy:
each strategy's class, losses and helpers below load on first use (`from strategies import MDLMStrategy`
works as before). So a stage that only needs `strategies.models` runs, and is keyed by, no strategy's code
(docs/architecture.md, "Stage keys").
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from strategies.assembly import DLLM_STRATEGIES, AssembledStrategy, assemble_strategy, get_dllm_strategy, strategy_class
from strategies.base import CorruptedBatch, DLLMStrategy, Microbatch, SetupContext, StepContext, TokenCounts
from strategies.registration import Registration, SamplerInfo
from strategies.registry import REGISTRY, SAMPLERS, register, registered

# name → "module:name" (a literal string each, which is how docs/architecture.md's stage keys see code loaded on
# demand), imported on first access (PEP 562 module __getattr__)
_ON_DEMAND = {
    "BlockDiffusionStrategy": "strategies.block_diffusion.strategy:BlockDiffusionStrategy",
    "build_response_window": "strategies.block_diffusion.strategy:build_response_window",
    "corrupt_all_masked": "strategies.corruption:corrupt_all_masked",
    "corrupt_blockwise": "strategies.corruption:corrupt_blockwise",
    "corrupt_mix": "strategies.corruption:corrupt_mix",
    "corrupt_uniform": "strategies.corruption:corrupt_uniform",
    "corrupt_uniform_random": "strategies.corruption:corrupt_uniform_random",
    "gumbel_topk": "strategies.corruption:gumbel_topk",
    "create_dflash_block_mask": "strategies.dflash.blocks:create_dflash_block_mask",
    "create_dflash_sdpa_mask": "strategies.dflash.blocks:create_dflash_sdpa_mask",
    "sample_anchor_blocks": "strategies.dflash.blocks:sample_anchor_blocks",
    "DFlashDraftModel": "strategies.dflash.draft:DFlashDraftModel",
    "speculative_generate": "strategies.dflash.decoding:speculative_generate",
    "DFlashDecayLoss": "strategies.dflash.loss:DFlashDecayLoss",
    "DFlashStrategy": "strategies.dflash.strategy:DFlashStrategy",
    "HybridDiffusionLLMLoss": "strategies.hybrid.loss:HybridDiffusionLLMLoss",
    "HybridStrategy": "strategies.hybrid.strategy:HybridStrategy",
    "IDLMLoss": "strategies.idlm.loss:IDLMLoss",
    "IDLMStrategy": "strategies.idlm.strategy:IDLMStrategy",
    "BlockDiffusionCrossEntropyLoss": "strategies.losses:BlockDiffusionCrossEntropyLoss",
    "DLLMLossOutput": "strategies.losses:DLLMLossOutput",
    "FlatCrossEntropyLoss": "strategies.losses:FlatCrossEntropyLoss",
    "encoder_ar_loss": "strategies.losses:encoder_ar_loss",
    "per_token_nll": "strategies.losses:per_token_nll",
    "uniform_diffusion_nelbo_terms": "strategies.losses:uniform_diffusion_nelbo_terms",
    "build_block_diffusion_training_mask": "strategies.masks:build_block_diffusion_training_mask",
    "create_idlm_block_mask": "strategies.masks:create_idlm_block_mask",
    "create_idlm_sdpa_mask": "strategies.masks:create_idlm_sdpa_mask",
    "MDLMCrossEntropyLoss": "strategies.mdlm.loss:MDLMCrossEntropyLoss",
    "MDLMStrategy": "strategies.mdlm.strategy:MDLMStrategy",
    "SCDDLoss": "strategies.scdd.loss:SCDDLoss",
    "SCDDSchedule": "strategies.scdd.schedule:SCDDSchedule",
    "scdd_grid_times": "strategies.scdd.schedule:scdd_grid_times",
    "scdd_schedule": "strategies.scdd.schedule:scdd_schedule",
    "SCDDStrategy": "strategies.scdd.strategy:SCDDStrategy",
    "corruption_sample_seed": "strategies.seeding:corruption_sample_seed",
}


def __getattr__(name: str) -> Any:
    where = _ON_DEMAND.get(name)
    if where is None:
        raise AttributeError(f"module 'strategies' has no attribute {name!r}")
    module, _, attr = where.partition(":")
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_ON_DEMAND})


__all__ = [
    "AssembledStrategy",
    "CorruptedBatch",
    "DLLMStrategy",
    "DLLM_STRATEGIES",
    "Microbatch",
    "REGISTRY",
    "Registration",
    "SAMPLERS",
    "SamplerInfo",
    "SetupContext",
    "StepContext",
    "TokenCounts",
    "assemble_strategy",
    "get_dllm_strategy",
    "register",
    "registered",
    "strategy_class",
    *_ON_DEMAND,
]
