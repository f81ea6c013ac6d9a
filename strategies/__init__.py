"""dLLM math and the strategy registry: corruption kernels, losses, model adapters, samplers.

Pure of Prefect and MLflow; the math in `docs/strategies.md`.
"""

from strategies.base import CorruptedBatch, DLLMStrategy, MDLMStrategy, Microbatch, SetupContext, StepContext
from strategies.block_diffusion_strategy import BlockDiffusionStrategy, build_response_window
from strategies.corruption import (
    corrupt_all_masked,
    corrupt_blockwise,
    corrupt_mix,
    corrupt_uniform,
    corrupt_uniform_random,
    gumbel_topk,
    scdd_grid_times,
)
from strategies.dflash import (
    DFlashDecayLoss,
    _build_target_layer_ids,
    create_dflash_block_mask,
    create_dflash_sdpa_mask,
    sample_anchor_blocks,
)
from strategies.dflash_draft import DFlashDraftModel, speculative_generate
from strategies.dflash_strategy import DFlashStrategy
from strategies.hybrid_strategy import HybridStrategy
from strategies.idlm_strategy import IDLMStrategy
from strategies.losses import (
    BlockDiffusionCrossEntropyLoss,
    DLLMLossOutput,
    HybridDiffusionLLMLoss,
    IDLMLoss,
    MDLMCrossEntropyLoss,
    encoder_ar_loss,
    per_token_nll,
    uniform_diffusion_nelbo_terms,
)
from strategies.masks import build_block_diffusion_training_mask, create_idlm_block_mask, create_idlm_sdpa_mask
from strategies.registry import DLLM_STRATEGIES, AssembledStrategy, assemble_strategy, get_dllm_strategy, strategy_class
from strategies.scdd import SCDDLoss, SCDDSchedule, scdd_schedule
from strategies.scdd_strategy import SCDDStrategy
from strategies.seeding import corruption_sample_seed

__all__ = [
    "AssembledStrategy",
    "assemble_strategy",
    "strategy_class",
    "BlockDiffusionCrossEntropyLoss",
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
