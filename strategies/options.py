"""A pipeline's config checked against the registered strategies, and each strategy's options resolved (torch-free).

A pipeline's values reach a strategy by one route, resolved once (`resolve_options`):

    shared `dllm:` keys the strategy declares  <  its own section (`dflash:` for DFlash)
    <  `dllm.overrides.<strategy>`

A shared `dllm:` key that no strategy of the pipeline declares is an error, and so is an override
key that the named strategy does not declare. `dllm-flow validate` prints the resolved values:
exactly what training uses (`printed_options`). `load_config` is the one way a pipeline file is read: YAML,
overrides, the schema (`dllm_common.config`), the strategies' options (the list of strategies is `strategies.registry`),
a local `model.path` folder and the lm-eval task names. See docs/architecture.md ("How a strategy plugs in").
"""

from __future__ import annotations

import copy
import difflib
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dllm_common import config as pipeline_config
from dllm_common.config import ConfigError, PipelineSpec, config_sha256, cut, shown
from dllm_common.harness_tasks import check_harness_tasks
from strategies.block_diffusion.options import BlockDiffusionOptions
from strategies.dflash.options import DFlashOptions
from strategies.hybrid.options import HybridOptions
from strategies.idlm.options import IDLMOptions
from strategies.mdlm.options import MDLMOptions
from strategies.model_files import check_model_folder, resolve_model_path
from strategies.registration import Registration, StrategyOptions
from strategies.registry import REGISTRY, registration
from strategies.scdd.options import SCDDOptions

__all__ = [
    "BlockDiffusionOptions",
    "DFlashOptions",
    "HybridOptions",
    "IDLMOptions",
    "MDLMOptions",
    "SCDDOptions",
    "check_spec",
    "load_config",
    "option_source",
    "printed_options",
    "resolve_options",
    "validate_config",
]


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
    """The options `name` trains with: shared `dllm:` keys it declares, its section, its overrides. Resolved once per
    config and strategy (the stage key, the training's parameters and its result all ask): the options are frozen,
    and a config that changes is another config."""
    reg = registration(name)
    memo = (config_sha256(spec), name, id(reg))
    if memo not in _RESOLVED:
        while len(_RESOLVED) >= 64:
            _RESOLVED.pop(next(iter(_RESOLVED)))
        shared = {k: v for k, v in spec.dllm.shared().items() if k in reg.options.model_fields}
        values = {**shared, **_section_values(spec, reg), **spec.dllm.overrides.get(name, {})}
        _RESOLVED[memo] = _validated(reg, values, f"strategy {name!r}")
    return _RESOLVED[memo]


_RESOLVED: dict[tuple[str, str, int], StrategyOptions] = {}


def _check_grpo(spec: PipelineSpec) -> None:
    """Each strategy of a pipeline with a `grpo:` section can compute the chosen likelihood estimate."""
    if spec.grpo is None:
        return
    if spec.train.nnodes > 1:
        raise ConfigError(
            f"grpo: train.nnodes is {spec.train.nnodes}, but the grpo stage runs on one node's processes "
            "(train.nproc_per_node): train on several nodes without the grpo section, then run the same config with "
            "the section and train.nnodes: 1 (the layout is not in the train stage's key, so the trained model is "
            'reused; docs/post-training.md, "The GRPO stage")'
        )
    if spec.train.parallel == "fsdp2" and spec.train.world_size > 1:
        if spec.grpo.prompts_per_step % spec.train.world_size:
            raise ConfigError(
                f"grpo.prompts_per_step ({spec.grpo.prompts_per_step}) must be a multiple of the processes "
                f"(train.nproc_per_node: {spec.train.nproc_per_node}) under train.parallel: fsdp2, whose ranks run "
                "every update's forwards and backwards together; change one, or use train.parallel: ddp"
            )
        if spec.grpo.peft is not None:
            raise ConfigError(
                "grpo.peft under train.parallel: fsdp2: the adapter-off reference switches adapters inside sharded "
                "units, which is not supported; use train.parallel: ddp (LoRA's memory need is small) or drop grpo.peft"
            )
    for name in spec.pipeline.strategies:
        supported = REGISTRY[name].estimators
        if spec.grpo.estimator not in supported:
            raise ConfigError(
                f"grpo.estimator: {name} cannot compute the {spec.grpo.estimator!r} estimate; "
                + (f"it supports {', '.join(supported)}" if supported else f"{name} is not post-trained by grpo")
                + ' (docs/post-training.md, "Likelihood estimators")'
            )


def check_spec(spec: PipelineSpec) -> dict[str, StrategyOptions]:
    """Every strategy of the pipeline is registered and its options are valid; nothing set is unused.
    Returns each strategy's resolved options."""
    unknown = [n for n in spec.pipeline.strategies if n not in REGISTRY]
    if unknown:
        raise ConfigError(f"pipeline.strategies: unknown strategy {shown(unknown[0])}; allowed: {sorted(REGISTRY)}")
    for name in spec.dllm.overrides:
        if name not in REGISTRY:
            raise ConfigError(f"dllm.overrides: unknown strategy {shown(name)}; allowed: {sorted(REGISTRY)}")
        if name not in spec.pipeline.strategies:  # nothing would read it: a typo or a strategy dropped from the list
            raise ConfigError(
                f"dllm.overrides.{name}: {name!r} is not in pipeline.strategies {list(spec.pipeline.strategies)}; "
                f"remove the entry or add the strategy"
            )
    for name in spec.eval.overrides:
        if name not in spec.pipeline.strategies:
            raise ConfigError(
                f"eval.overrides.{cut(name)}: {'it' if len(name) > 60 else repr(name)} is not in pipeline.strategies "
                f"{list(spec.pipeline.strategies)}; "
                f"remove the entry (--set eval.overrides={{}} drops them all) or add the strategy"
            )
        if not REGISTRY[name].samples:
            raise ConfigError(
                f"eval.overrides.{name}: {name} is judged by speculative decoding against its target, which reads "
                "no sampler settings; remove the entry"
            )
    _check_grpo(spec)
    known = sorted({k for r in REGISTRY.values() for k in r.options.model_fields})
    unknown = sorted(set(spec.dllm.shared()) - set(known))
    if unknown:  # no strategy at all reads it: a typo or a key of another tool, not a missing strategy
        named = [
            f"dllm.{cut(k)}" + "".join(f" (did you mean dllm.{m}?)" for m in difflib.get_close_matches(k, known, n=1))
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


def printed_options(spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    """Each strategy's options as `dllm-flow validate` prints them: checked (`check_spec`) and resolved, exactly as
    training uses them, as JSON values. A strategy that never reads a [MASK] id (its class's `uses_mask_token` is
    False: uniform noise, block_diffusion) gets no `mask_token_id`, which would only look like a setting it uses."""
    printed = {}
    for name, options in check_spec(spec).items():
        values = options.model_dump(mode="json")
        if not registration(name).load().uses_mask_token:
            values.pop("mask_token_id", None)
        printed[name] = values
    return printed


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
    spec = pipeline_config.validate_schema(raw, source)
    check_spec(spec)
    check_pretrained_paths(spec)  # a local model.path folder: config.json, weights, not a DFlash draft
    return spec


def _strategy_list(raw: dict) -> list[str] | None:
    pipeline = raw.get("pipeline")
    listed = pipeline.get("strategies") if isinstance(pipeline, dict) else None
    return listed if isinstance(listed, list) and all(isinstance(n, str) for n in listed) else None


def narrow_strategies(file_raw: dict, raw: dict) -> tuple[dict, list[str]]:
    """`raw` (the file with its overrides applied) without the settings that only the strategies the overrides
    dropped from the file's own `pipeline.strategies` read, and the dotted keys set aside. Rerunning one row of a
    comparison (`--set 'pipeline.strategies=[mdlm]'`) is not a typo: the file's `eval.overrides.<dropped>`,
    `dllm.overrides.<dropped>`, the dropped strategies' own sections and the shared `dllm:` keys no remaining
    strategy reads are set aside (docs/configuration.md, "Running some of a config's strategies"). A key that no
    registered strategy reads, or an override for a strategy the file never listed, is still refused."""
    listed, kept = _strategy_list(file_raw), _strategy_list(raw)
    if listed is None or kept is None or listed == kept:
        return raw, []
    dropped = [n for n in dict.fromkeys(listed) if n not in kept and n in REGISTRY]
    if not dropped:
        return raw, []
    out = copy.deepcopy(raw)
    ignored: list[str] = []

    def drop(section: dict, key: str, dotted: str) -> None:
        if isinstance(section, dict) and key in section:
            del section[key]
            ignored.append(dotted)

    def at(tree: dict, keys: tuple[str, ...]) -> Any:
        for key in keys:
            if not isinstance(tree, dict) or key not in tree:
                return _ABSENT
            tree = tree[key]
        return tree

    def in_file(*keys: str) -> bool:  # only what the file set: a value given on the command line is checked as ever
        return at(file_raw, keys) is not _ABSENT and at(file_raw, keys) == at(raw, keys)

    kept_reads = {k for n in kept if n in REGISTRY for k in REGISTRY[n].options.model_fields}
    dropped_reads = {k for n in dropped for k in REGISTRY[n].options.model_fields}
    dllm = out.get("dllm")
    if isinstance(dllm, dict):
        for key in [k for k in dllm if k != "overrides" and k in dropped_reads and k not in kept_reads]:
            if in_file("dllm", key):
                drop(dllm, key, f"dllm.{key}")
        for name in dropped:
            if in_file("dllm", "overrides", name):
                drop(dllm.get("overrides"), name, f"dllm.overrides.{name}")
    for name in dropped:
        evaluation = out.get("eval")
        if isinstance(evaluation, dict) and in_file("eval", "overrides", name):
            drop(evaluation.get("overrides"), name, f"eval.overrides.{name}")
        section = REGISTRY[name].section
        if (
            section is not None
            and in_file(section)
            and not any(REGISTRY[n].section == section for n in kept if n in REGISTRY)
        ):
            drop(out, section, section)
    return out, ignored


_ABSENT = object()


def load_config(path: str | Path, overrides: list[str] | None = None, note: bool = True) -> PipelineSpec:
    """The pipeline file at `path` with `overrides` (`key=value`) applied, checked as a whole: the schema, every
    strategy's options, a local model.path folder, and the lm-eval task names (`eval.lm_eval`), so a name the
    harness does not know fails here, not after training. The one loader every entry point uses. Overrides that
    narrow the file's own strategy list set aside what only the dropped strategies read, with one note on stderr
    (`narrow_strategies`; `note=False` leaves it out)."""
    file_raw = pipeline_config.read_yaml(path)
    raw, ignored = narrow_strategies(file_raw, pipeline_config.apply_overrides(file_raw, overrides or []))
    spec = validate_config(raw, str(path))
    if ignored and note:  # `note=False`: a second load of what the command already loaded (the run's flow)
        print(
            f"dllm-flow: note: pipeline.strategies narrowed to {list(spec.pipeline.strategies)}: ignoring "
            f"{', '.join(ignored)} (read only by the strategies dropped from {path})",
            file=sys.stderr,
            flush=True,
        )
    check_harness_tasks(spec.eval.lm_eval)
    return spec
