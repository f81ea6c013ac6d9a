"""The registry: the one list of strategies (`REGISTRY`) and what is derived from it (torch-free).

Each strategy package declares its typed options, its samplers and its registration in its own
`options.py` (`strategies/<name>/options.py`); `REGISTRY` lists them, and everything else that names
strategies is derived from it: the strategy classes (`strategies.assembly.DLLM_STRATEGIES`), the sampler
table (`SAMPLERS`), the model shapes (`model_shape`), the code a strategy's stages load on demand
(`on_demand_modules`). `register` / `registered` add a strategy at run time (a test, a notebook) without
editing the package. How a pipeline's values reach a strategy is `strategies.options`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from dllm_common.config import shown
from strategies.block_diffusion import options as block_diffusion
from strategies.dflash import options as dflash
from strategies.hybrid import options as hybrid
from strategies.idlm import options as idlm
from strategies.mdlm import options as mdlm
from strategies.registration import BASE_EVALUATOR, Registration, SamplerInfo, load_object
from strategies.scdd import options as scdd

__all__ = [
    "REGISTRY",
    "SAMPLERS",
    "evaluation_api",
    "evaluator_class",
    "model_shape",
    "model_shapes",
    "on_demand_modules",
    "register",
    "registered",
    "registration",
]

# The one list of strategies: config validation, the strategy classes, the sampler table, the model shapes,
# `dllm-flow validate` and the stages all read it.
REGISTRY: dict[str, Registration] = {
    "mdlm": mdlm.REGISTRATION,
    "scdd": scdd.REGISTRATION,
    "hybrid": hybrid.REGISTRATION,
    "idlm": idlm.REGISTRATION,
    "dflash": dflash.REGISTRATION,
    "block_diffusion": block_diffusion.REGISTRATION,
}


def registration(name: str) -> Registration:
    """The registration of strategy `name`; an unknown name lists the registered ones."""
    if not isinstance(name, str):
        raise TypeError(f"a strategy name is a string (one of {sorted(REGISTRY)}), got {type(name).__name__} {name!r}")
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown strategy {shown(name)}: pipeline.strategies takes registered strategies, {sorted(REGISTRY)}"
        ) from None


def register(name: str, reg: Registration) -> Registration:
    """Add a strategy to `REGISTRY` at run time (a built-in one is listed there instead); a name already
    registered is refused. Everything derived from the registry sees it from now on."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a strategy name is an identifier (it names MLflow runs and store stages), got {name!r}")
    if not isinstance(reg, Registration):
        raise TypeError(f"register({name!r}, …) takes a Registration, got {type(reg).__name__}")
    if name in REGISTRY:
        raise ValueError(f"strategy {name!r} is already registered")
    candidate = {**REGISTRY, name: reg}
    _merged("sampler", _samplers_of(candidate))  # names that clash with another strategy's are refused here
    _merged("model shape", _models_of(candidate))
    REGISTRY[name] = reg
    return reg


@contextmanager
def registered(name: str, reg: Registration) -> Iterator[Registration]:
    """`register` for the duration of a `with` block: the strategy is removed again when it ends."""
    register(name, reg)
    try:
        yield reg
    finally:
        REGISTRY.pop(name, None)


def _merged(kind: str, declared: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """name → value over every registration's table of `kind`; one name declared twice must mean one thing."""
    table: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for strategy, entries in declared.items():
        for key, value in entries.items():
            if key in table and table[key] != value:
                raise ValueError(
                    f"{kind} {key!r} is declared by {owners[key]!r} and, differently, by {strategy!r}; "
                    "give one of them another name"
                )
            table.setdefault(key, value)
            owners.setdefault(key, strategy)
    return table


class SamplerTable(Mapping[str, SamplerInfo]):
    """Every registered strategy's samplers by name, derived from `REGISTRY` on each use (so a strategy
    registered at run time brings its samplers along). A name several strategies declare (the absorbing
    sampler, "llada") must carry one `SamplerInfo`."""

    def _table(self) -> dict[str, SamplerInfo]:
        return _merged("sampler", _samplers_of(REGISTRY))

    def __getitem__(self, name: str) -> SamplerInfo:
        table = self._table()
        if name not in table:
            raise KeyError(f"unknown sampler {name!r}; registered samplers: {sorted(table)}")
        return table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


SAMPLERS = SamplerTable()


def model_shapes() -> dict[str, type]:
    """Every model shape a registered strategy declares (`Registration.models`), by name, its class imported."""
    return {name: load_object(ref) for name, ref in _merged("model shape", _models_of(REGISTRY)).items()}


def on_demand_modules(strategy: str, evaluation: bool = False) -> tuple[str, ...]:
    """The modules a stage of `strategy` may load through the registry: its class's and its model shapes'
    (`Registration.modules`), and every registered strategy's model shapes, since a checkpoint folder is offered
    to each shape that recognizes folders (`models.model_from_config_dir`); with `evaluation` (a stage that runs
    evaluation hooks: samples, likelihood rows) its evaluator's too. The stages of one strategy key their code by
    these (docs/architecture.md, "Stage keys"), so editing a sampler re-runs evaluation and never training."""
    shapes = (reg.modules(models_only=True) for reg in REGISTRY.values())
    own = registration(strategy).modules(evaluation=evaluation)
    return tuple(dict.fromkeys([*own, *(m for mods in shapes for m in mods)]))


def evaluation_api() -> str:
    """The module every evaluator derives from (`strategies.base_evaluation`, where `SampleRequest` lives): a
    stage whose import closure holds it runs evaluation hooks, and is keyed by its strategy's evaluator."""
    return BASE_EVALUATOR.partition(":")[0]


def evaluator_class(cls: type) -> type:
    """The evaluator of strategy class `cls` (imported now): that of the registration of `cls` or of the nearest
    registered class it derives from (a test's subclass evaluates as its parent), else the base evaluator."""
    for klass in cls.__mro__:
        for reg in REGISTRY.values():
            if reg.implements(klass):
                return load_object(reg.evaluator_ref)
    return load_object(BASE_EVALUATOR)


def model_shape(name: str) -> type:
    """The class of model shape `name` (a checkpoint's `config.dllm_architecture`)."""
    refs = _merged("model shape", _models_of(REGISTRY))
    if name not in refs:
        raise ValueError(f"unknown model shape {name!r}; registered strategies declare {sorted(refs)}")
    return load_object(refs[name])


def _samplers_of(registry: Mapping[str, Registration]) -> dict[str, Mapping[str, SamplerInfo]]:
    return {name: reg.samplers for name, reg in registry.items()}


def _models_of(registry: Mapping[str, Registration]) -> dict[str, Mapping[str, str | type]]:
    return {name: reg.models for name, reg in registry.items()}
