"""The strategy classes by name, and the one way to build a strategy for a model.

`DLLM_STRATEGIES` is a view of `strategies.registry.REGISTRY` (the one list of strategies): a class is
imported and checked against its registration on first use, and a strategy registered at run time
(`strategies.registry.register`) appears in it. `assemble_strategy` resolves everything a strategy needs
once (the mask id, the values the model decides) and returns the strategy, a freshly built loss and the
mask id: nothing is patched into a loss or a model afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from strategies.base import DLLMStrategy, SetupContext
from strategies.registration import StrategyOptions
from strategies.registry import REGISTRY, registration


class StrategyClasses(MutableMapping[str, type[DLLMStrategy]]):
    """name → strategy class for every registered strategy, following `REGISTRY`; each class is imported on
    first use (`Registration.load`, which checks it against its registration). Setting an entry puts another
    class in the place of a name (a test's stand-in); deleting it restores the registered one."""

    def __init__(self) -> None:
        self._loaded: dict[str, tuple[object, type[DLLMStrategy]]] = {}  # name → (registration, class)
        self._replaced: dict[str, type[DLLMStrategy]] = {}

    def __getitem__(self, name: str) -> type[DLLMStrategy]:
        if name in self._replaced:
            return self._replaced[name]
        reg = REGISTRY[name]
        loaded = self._loaded.get(name)
        if loaded is None or loaded[0] is not reg:  # first use, or the name was registered anew
            loaded = self._loaded[name] = (reg, reg.load())
        return loaded[1]

    def __setitem__(self, name: str, cls: type[DLLMStrategy]) -> None:
        self._replaced.pop(name, None)
        if name not in REGISTRY or self[name] is not cls:  # putting the registered class back is no stand-in
            self._replaced[name] = cls

    def __delitem__(self, name: str) -> None:
        del self._replaced[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*REGISTRY, *self._replaced]))

    def __len__(self) -> int:
        return len(set(REGISTRY) | set(self._replaced))

    def __contains__(self, name: object) -> bool:
        return name in REGISTRY or name in self._replaced


DLLM_STRATEGIES = StrategyClasses()


def strategy_class(name: str) -> type[DLLMStrategy]:
    """The class registered under `name`; an unknown name lists the registered ones."""
    if not isinstance(name, str) or name not in DLLM_STRATEGIES:
        registration(name)  # raises: a TypeError for a name that is not a string, else a ValueError listing them
    return DLLM_STRATEGIES[name]


def get_dllm_strategy(name: str, options: StrategyOptions | dict | None = None) -> DLLMStrategy:
    """Instantiate the strategy registered under `name` (default options unless given)."""
    return strategy_class(name)(options)


@dataclass(frozen=True)
class AssembledStrategy:
    strategy: DLLMStrategy
    loss_fn: nn.Module
    mask_token_id: int | None  # None only for a strategy that uses no [MASK] token and was given none


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
    `resources`: runtime objects a strategy holds besides its options (DFlash: `target`, `features`).

    A strategy that uses a [MASK] token (`uses_mask_token`) must end up with one (config, tokenizer or
    `setup_extra`), checked against the model (`check_mask_token`). One that uses none keeps whatever id
    was given or the tokenizer has (it is recorded, never read), and None when there is none."""
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
    if cls.uses_mask_token:
        if mask is None:
            raise ValueError(
                "dllm.mask_token_id must be set in config, resolved by the tokenizer, or set by strategy.setup_extra()."
            )
        provisional.check_mask_token(int(mask), model)
    mask = None if mask is None else int(mask)
    final = opts.model_copy(update={"mask_token_id": mask})
    strategy = cls(final, **resources)
    return AssembledStrategy(strategy, strategy.create_loss_fn(final), mask)
