"""The strategy classes by name, and the one way to build a strategy for a model.

`DLLM_STRATEGIES` is a view of `strategies.options.REGISTRY` (the one list of strategies).
`assemble_strategy` resolves everything a strategy needs once (the mask id, the values the model
decides) and returns the strategy, a freshly built loss and the mask id: nothing is patched into
a loss or a model afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from strategies.base import DLLMStrategy, SetupContext, check_mask_token_id
from strategies.options import REGISTRY, StrategyOptions, registration

DLLM_STRATEGIES: dict[str, type[DLLMStrategy]] = {name: reg.load() for name, reg in REGISTRY.items()}


def strategy_class(mode: str) -> type[DLLMStrategy]:
    """The class registered under `mode`; unknown names list the available ones."""
    if mode not in DLLM_STRATEGIES:
        registration(mode)  # raises the registry's error
        raise ValueError(f"Unknown dllm.mode: {mode!r}. Available: {sorted(DLLM_STRATEGIES)}")
    return DLLM_STRATEGIES[mode]


def get_dllm_strategy(mode: str, options: StrategyOptions | dict | None = None) -> DLLMStrategy:
    """Instantiate the strategy registered under `mode` (default options unless given)."""
    return strategy_class(mode)(options)


@dataclass(frozen=True)
class AssembledStrategy:
    strategy: DLLMStrategy
    loss_fn: nn.Module
    mask_token_id: int


def candidate_mask_token_id(options: StrategyOptions, tokenizer: Any, explicit: int | None = None) -> int | None:
    """The mask id before the strategy's checks: an explicit one (a checkpoint's), the options', the tokenizer's."""
    if explicit is not None:
        return int(explicit)
    if options.mask_token_id is not None:
        return int(options.mask_token_id)
    return getattr(tokenizer, "mask_token_id", None)


def assemble_strategy(
    name: str,
    options: StrategyOptions | dict | None,
    model: nn.Module,
    tokenizer: Any,
    *,
    mask_token_id: int | None = None,
    resources: dict | None = None,
) -> AssembledStrategy:
    """Strategy + loss + resolved mask id for a model/tokenizer pair (training, evaluation, generation).
    `resources`: runtime objects a strategy holds besides its options (DFlash: `target`, `features`)."""
    cls = strategy_class(name)
    resources = dict(resources or {})
    opts = cls.complete_options(cls.coerce_options(options), model)
    candidate = candidate_mask_token_id(opts, tokenizer, mask_token_id)
    provisional = cls(opts, **resources)
    if provisional.normalization_mode not in ("supervised", "noise"):
        raise ValueError(
            f"Invalid normalization_mode {provisional.normalization_mode!r} for strategy {name!r}. "
            "Must be 'supervised' or 'noise'."
        )
    resolved = provisional.setup_extra(SetupContext(model, tokenizer, candidate, extras=resources))
    mask = resolved if resolved is not None else candidate
    if mask is None:
        raise ValueError(
            "dllm.mask_token_id must be set in config, resolved by the tokenizer, or set by strategy.setup_extra()."
        )
    if name != "dflash":  # a DFlash draft's mask row is checked against its target (tasks/dflash_setup.py)
        check_mask_token_id(int(mask), model)
    final = opts.model_copy(update={"mask_token_id": int(mask)})
    strategy = cls(final, **resources)
    return AssembledStrategy(strategy, strategy.create_loss_fn(final), int(mask))
