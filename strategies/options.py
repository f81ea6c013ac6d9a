"""The registry's one list of strategies (`REGISTRY`) and the resolution of their options (torch-free).

Each strategy package declares its typed options, its samplers and its registration in its own
`options.py` (`strategies/<name>/options.py`); `REGISTRY` lists them, and everything else that names
strategies is derived from it: the strategy classes (`strategies.registry.DLLM_STRATEGIES`), the sampler
table (`SAMPLERS`), the model shapes (`model_shape`). `register` / `registered` add a strategy at run time
(a test, a notebook) without editing the package.

A pipeline's values reach a strategy by one route, resolved once (`resolve_options`):

    shared `dllm:` keys the strategy declares  <  its own section (`dflash:` for DFlash)
    <  `dllm.overrides.<strategy>`

A shared `dllm:` key that no strategy of the pipeline declares is an error, and so is an override
key that the named strategy does not declare. `dllm-flow validate` prints the resolved values:
exactly what training uses. See docs/architecture.md ("How a strategy plugs in").
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dllm_common import config as pipeline_config
from dllm_common.config import ConfigError, PipelineSpec
from strategies.block_diffusion import options as block_diffusion
from strategies.block_diffusion.options import BlockDiffusionOptions
from strategies.dflash import options as dflash
from strategies.dflash.options import DFlashOptions
from strategies.hybrid import options as hybrid
from strategies.hybrid.options import HybridOptions
from strategies.idlm import options as idlm
from strategies.idlm.options import IDLMOptions
from strategies.mdlm import options as mdlm
from strategies.mdlm.options import MDLMOptions
from strategies.model_files import check_model_folder, resolve_model_path
from strategies.registration import Registration, SamplerInfo, StrategyOptions, load_object
from strategies.scdd import options as scdd
from strategies.scdd.options import SCDDOptions

__all__ = [
    "REGISTRY",
    "SAMPLERS",
    "BlockDiffusionOptions",
    "DFlashOptions",
    "HybridOptions",
    "IDLMOptions",
    "MDLMOptions",
    "Registration",
    "SCDDOptions",
    "SamplerInfo",
    "StrategyOptions",
    "check_spec",
    "load_config",
    "model_shape",
    "model_shapes",
    "option_source",
    "register",
    "registered",
    "registration",
    "resolve_options",
    "validate_config",
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
            f"unknown strategy {name!r}: pipeline.strategies takes registered strategies, {sorted(REGISTRY)}"
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


def on_demand_modules(strategy: str) -> tuple[str, ...]:
    """The modules a stage of `strategy` may load through the registry: its class's and its model shapes'
    (`Registration.modules`), and every registered strategy's model shapes, since a checkpoint folder is offered
    to each shape that recognizes folders (`models.model_from_config_dir`). The stages of one strategy key their
    code by these (docs/architecture.md, "Stage keys")."""
    shapes = (reg.modules(models_only=True) for reg in REGISTRY.values())
    return tuple(dict.fromkeys([*registration(strategy).modules(), *(m for mods in shapes for m in mods)]))


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


def _section_values(spec: PipelineSpec, reg: Registration) -> dict[str, Any]:
    """The option keys set in the strategy's own section (e.g. `dflash.block_size`)."""
    if reg.section is None:
        return {}
    return dict(getattr(spec, reg.section).model_extra or {})


def _validated(reg: Registration, values: dict[str, Any], where: str) -> StrategyOptions:
    try:
        return reg.options.model_validate(values)
    except ValidationError as err:
        lines = [f"invalid strategy options ({where}):"]
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                lines.append(f"  {key}: unknown key; allowed: {sorted(reg.options.model_fields)}")
            else:
                lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
        raise ConfigError("\n".join(lines)) from None


def option_source(spec: PipelineSpec, name: str, key: str) -> str:
    """Where `key` of strategy `name` was set, as a dotted config key (the highest-precedence place that sets
    it; `dllm.<key>` when none does)."""
    reg = registration(name)
    if key in spec.dllm.overrides.get(name, {}):
        return f"dllm.overrides.{name}.{key}"
    if reg.section is not None and key in _section_values(spec, reg):
        return f"{reg.section}.{key}"
    return f"dllm.{key}"


def resolve_options(spec: PipelineSpec, name: str) -> StrategyOptions:
    """The options `name` trains with: shared `dllm:` keys it declares, its section, its overrides."""
    reg = registration(name)
    shared = {k: v for k, v in spec.dllm.shared().items() if k in reg.options.model_fields}
    values = {**shared, **_section_values(spec, reg), **spec.dllm.overrides.get(name, {})}
    return _validated(reg, values, f"strategy {name!r}")


def check_spec(spec: PipelineSpec) -> dict[str, StrategyOptions]:
    """Every strategy of the pipeline is registered and its options are valid; nothing set is unused.
    Returns each strategy's resolved options."""
    unknown = [n for n in spec.pipeline.strategies if n not in REGISTRY]
    if unknown:
        raise ConfigError(f"pipeline.strategies: unknown strategy {unknown[0]!r}; allowed: {sorted(REGISTRY)}")
    for name in spec.dllm.overrides:
        if name not in REGISTRY:
            raise ConfigError(f"dllm.overrides: unknown strategy {name!r}; allowed: {sorted(REGISTRY)}")
        if name not in spec.pipeline.strategies:  # nothing would read it: a typo or a strategy dropped from the list
            raise ConfigError(
                f"dllm.overrides.{name}: {name!r} is not in pipeline.strategies {list(spec.pipeline.strategies)}; "
                f"remove the entry or add the strategy"
            )
    for name in spec.eval.overrides:
        if name not in spec.pipeline.strategies:
            raise ConfigError(
                f"eval.overrides.{name}: {name!r} is not in pipeline.strategies {list(spec.pipeline.strategies)}; "
                f"remove the entry (--set eval.overrides={{}} drops them all) or add the strategy"
            )
        if not REGISTRY[name].samples:
            raise ConfigError(
                f"eval.overrides.{name}: {name} is judged by speculative decoding against its target, which reads "
                "no sampler settings; remove the entry"
            )
    known = sorted({k for r in REGISTRY.values() for k in r.options.model_fields})
    unknown = sorted(set(spec.dllm.shared()) - set(known))
    if unknown:  # no strategy at all reads it: a typo or a key of another tool, not a missing strategy
        named = [
            f"dllm.{k}" + "".join(f" (did you mean dllm.{m}?)" for m in difflib.get_close_matches(k, known, n=1))
            for k in unknown
        ]
        it = "it" if len(unknown) == 1 else "them"
        raise ConfigError(
            f"dllm: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(named)}: no strategy reads {it}; "
            f"the dllm.* keys are {', '.join(known)} (and dllm.overrides.<strategy>.<key>). Remove or rename {it}"
        )
    declared = {k for n in spec.pipeline.strategies for k in REGISTRY[n].options.model_fields}
    unused = sorted(set(spec.dllm.shared()) - declared)
    if unused:
        owners = {k: sorted(n for n, r in REGISTRY.items() if k in r.options.model_fields) for k in unused}
        raise ConfigError(
            f"dllm: {unused} set but no strategy of this pipeline ({list(spec.pipeline.strategies)}) reads "
            f"{'it' if len(unused) == 1 else 'them'}; strategies that do: {owners}. Remove the key or add "
            "the strategy"
        )
    for name, reg in REGISTRY.items():
        if reg.section and name not in spec.pipeline.strategies and _section_values(spec, reg):
            raise ConfigError(
                f"{reg.section}: {sorted(_section_values(spec, reg))} set but {name!r} is not in pipeline.strategies"
            )
    for name, values in spec.dllm.overrides.items():
        _validated(REGISTRY[name], values, f"dllm.overrides.{name}")
    resolved = {name: resolve_options(spec, name) for name in spec.pipeline.strategies}
    for name, options in resolved.items():
        options.check_against(spec, lambda key, name=name: option_source(spec, name, key))
    return resolved


def check_pretrained_paths(spec) -> None:
    """At config validation: the `model.path` folder a backbone-training strategy loads (not a DFlash draft's:
    that strategy's model.path is a draft by design) — its config; the weights are checked where they load
    (`models.load_pretrained`, before training), so a folder of config.json alone still plans."""
    m = spec.model
    if m.kind != "pretrained" or not m.path:
        return
    if any(registration(name).load().trains == "denoiser" for name in spec.pipeline.strategies):
        check_model_folder(m.path, resolve_model_path(m.path), m.gguf_file, weights=False)


def validate_config(raw: dict, source: str = "<dict>") -> PipelineSpec:
    """The pipeline config, schema and strategy options checked (what every entry point loads)."""
    spec = pipeline_config.validate_config(raw, source)
    check_spec(spec)
    check_pretrained_paths(spec)  # a local model.path folder: config.json, weights, not a DFlash draft
    return spec


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineSpec:
    raw = pipeline_config.apply_overrides(pipeline_config.read_yaml(path), overrides or [])
    return validate_config(raw, str(path))
