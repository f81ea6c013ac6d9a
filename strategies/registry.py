"""The strategy registry: a literal dict from `dllm.mode` to strategy class."""

from __future__ import annotations

from strategies.base import DLLMStrategy, MDLMStrategy
from strategies.block_diffusion_strategy import BlockDiffusionStrategy
from strategies.dflash_strategy import DFlashStrategy
from strategies.hybrid_strategy import HybridStrategy
from strategies.idlm_strategy import IDLMStrategy
from strategies.scdd_strategy import SCDDStrategy

DLLM_STRATEGIES: dict[str, type[DLLMStrategy]] = {
    "mdlm": MDLMStrategy,
    "scdd": SCDDStrategy,
    "hybrid": HybridStrategy,
    "idlm": IDLMStrategy,
    "dflash": DFlashStrategy,
    "block_diffusion": BlockDiffusionStrategy,
}


def get_dllm_strategy(mode: str) -> DLLMStrategy:
    """Instantiate the strategy registered under `mode`; unknown names list the available ones."""
    try:
        return DLLM_STRATEGIES[mode]()
    except KeyError:
        raise ValueError(f"Unknown dllm.mode: {mode!r}. Available: {sorted(DLLM_STRATEGIES)}") from None
