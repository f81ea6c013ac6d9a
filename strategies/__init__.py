"""dLLM math and the strategy registry: one package per strategy, and the maths they share.

Each strategy lives in `strategies/<name>/` (options, samplers and registration in `options.py`, its class in
`strategy.py`, what only it computes beside them); `strategies.options.REGISTRY` lists them. The shared maths
sit in modules named for what they compute: `corruption` (noise kernels), `losses` (losses and bounds),
`posteriors` (reverse steps of the uniform kernel), `masks` (attention masks), `absorbing` (the absorbing
sampler), `sampling` (what every sampler shares). Pure of Prefect and MLflow; the math in `docs/strategies.md`.
"""

from strategies.base import CorruptedBatch, DLLMStrategy, Microbatch, SetupContext, StepContext
from strategies.block_diffusion.strategy import BlockDiffusionStrategy, build_response_window
from strategies.corruption import (
    corrupt_all_masked,
    corrupt_blockwise,
    corrupt_mix,
    corrupt_uniform,
    corrupt_uniform_random,
    gumbel_topk,
)
from strategies.dflash.blocks import (
    _build_target_layer_ids,
    create_dflash_block_mask,
    create_dflash_sdpa_mask,
    sample_anchor_blocks,
)
from strategies.dflash.draft import DFlashDraftModel, speculative_generate
from strategies.dflash.loss import DFlashDecayLoss
from strategies.dflash.strategy import DFlashStrategy
from strategies.hybrid.loss import HybridDiffusionLLMLoss
from strategies.hybrid.strategy import HybridStrategy
from strategies.idlm.loss import IDLMLoss
from strategies.idlm.strategy import IDLMStrategy
from strategies.losses import (
    BlockDiffusionCrossEntropyLoss,
    DLLMLossOutput,
    FlatCrossEntropyLoss,
    encoder_ar_loss,
    per_token_nll,
    uniform_diffusion_nelbo_terms,
)
from strategies.masks import build_block_diffusion_training_mask, create_idlm_block_mask, create_idlm_sdpa_mask
from strategies.mdlm.loss import MDLMCrossEntropyLoss
from strategies.mdlm.strategy import MDLMStrategy
from strategies.options import REGISTRY, SAMPLERS, Registration, SamplerInfo, register, registered
from strategies.registry import DLLM_STRATEGIES, AssembledStrategy, assemble_strategy, get_dllm_strategy, strategy_class
from strategies.scdd.loss import SCDDLoss
from strategies.scdd.schedule import SCDDSchedule, scdd_grid_times, scdd_schedule
from strategies.scdd.strategy import SCDDStrategy
from strategies.seeding import corruption_sample_seed

__all__ = [
    "AssembledStrategy",
    "assemble_strategy",
    "strategy_class",
    "BlockDiffusionCrossEntropyLoss",
    "FlatCrossEntropyLoss",
    "HybridDiffusionLLMLoss",
    "IDLMLoss",
    "SCDDLoss",
    "SCDDSchedule",
    "encoder_ar_loss",
    "scdd_schedule",
    "build_block_diffusion_training_mask",
    "create_idlm_block_mask",
    "create_idlm_sdpa_mask",
    "IDLMStrategy",
    "SCDDStrategy",
    "HybridStrategy",
    "BlockDiffusionStrategy",
    "build_response_window",
    "uniform_diffusion_nelbo_terms",
    "DLLM_STRATEGIES",
    "REGISTRY",
    "SAMPLERS",
    "Registration",
    "SamplerInfo",
    "register",
    "registered",
    "CorruptedBatch",
    "DLLMLossOutput",
    "DLLMStrategy",
    "MDLMCrossEntropyLoss",
    "MDLMStrategy",
    "Microbatch",
    "SetupContext",
    "StepContext",
    "corrupt_all_masked",
    "corrupt_blockwise",
    "corrupt_mix",
    "corrupt_uniform",
    "corrupt_uniform_random",
    "corruption_sample_seed",
    "gumbel_topk",
    "scdd_grid_times",
    "get_dllm_strategy",
    "per_token_nll",
    "DFlashDecayLoss",
    "DFlashDraftModel",
    "_build_target_layer_ids",
    "create_dflash_block_mask",
    "create_dflash_sdpa_mask",
    "sample_anchor_blocks",
    "speculative_generate",
    "DFlashStrategy",
]
