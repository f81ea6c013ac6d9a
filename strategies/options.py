"""Typed options of every strategy and the registry's one list of strategy names (torch-free).

Each strategy owns a frozen pydantic model: unknown keys are refused and every key has one default,
here. A pipeline's values reach a strategy by one route, resolved once (`resolve_options`):

    shared `dllm:` keys the strategy declares  <  its own section (`dflash:` for DFlash)
    <  `dllm.overrides.<strategy>`

A shared `dllm:` key that no strategy of the pipeline declares is an error, and so is an override
key that the named strategy does not declare. `dllm-flow validate` prints the resolved values:
exactly what training uses. See docs/architecture.md ("How a strategy plugs in").
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from dllm_common import config as pipeline_config
from dllm_common.config import ConfigError, PipelineSpec


class StrategyOptions(BaseModel):
    """What every strategy reads: the [MASK] id (None: the tokenizer's) and the minimum noise level."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return pipeline_config.refuse_boolean_number(cls, value, info)

    mask_token_id: int | None = Field(None, ge=0)
    eps: float = Field(1e-3, ge=0, lt=1)

    def check_against(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        """What the options alone cannot see: values that the rest of the pipeline config makes impossible
        (at config load, before any stage runs). `where(key)` names the key as the config wrote it."""
        if self.mask_token_id is None:
            return
        bounds = []  # (vocabulary size, where that size comes from)
        if self.config_vocab_known(spec):
            bounds.append(
                (
                    spec.tokenizer.vocab_size,
                    "tokenizer.vocab_size: the tokenizer trained from this config has at most that many tokens, "
                    "and the model's vocabulary is the tokenizer's",
                )
            )
        vocab = getattr(self, "vocab_size", None)
        if vocab is not None:
            bounds.append((vocab, where("vocab_size")))
        for size, source in sorted(bounds, key=lambda b: b[0]):
            if self.mask_token_id >= size:
                key = where("mask_token_id")
                raise ConfigError(
                    f"{key} ({self.mask_token_id}) is outside the vocabulary of {size} tokens ({source}); valid "
                    f"ids are 0..{size - 1}. Set {key} to an unused token id below {size}, or leave it unset to "
                    "use the tokenizer's [MASK] token"
                )

    def config_vocab_known(self, spec: PipelineSpec) -> bool:
        """The model's vocabulary is bounded by `tokenizer.vocab_size`: a tiny model built for a tokenizer
        trained from the config (a pretrained model or tokenizer is only known at run time)."""
        return spec.tokenizer.kind == "train_bpe" and spec.model.kind == "tiny"


def refuse_longer_than_rows(spec: PipelineSpec, key: str, value: int | None, hint: str) -> None:
    """A block (`key` names it) longer than a training row (`data.seq_len`) is one block over the whole row."""
    if value is not None and value > spec.data.seq_len:
        raise ConfigError(
            f"{key} ({value}) is larger than data.seq_len ({spec.data.seq_len}); a training row holds "
            f"{spec.data.seq_len} tokens, so the block could never be filled. Set {key} to at most "
            f"{spec.data.seq_len}{hint}, or raise data.seq_len"
        )


class MDLMOptions(StrategyOptions):
    """MDLM / LLaDA (docs/strategies.md §8.1)."""

    loss_weighting: Literal["elbo", "flat"] = "elbo"


class SCDDOptions(StrategyOptions):
    """SCDD (docs/strategies.md §8.2). `vocab_size` None: the model's."""

    vocab_size: int | None = Field(None, ge=3)
    num_timesteps: int = Field(1000, ge=2)
    uniform_ratio: float = Field(0.1, ge=0, lt=1)
    schedule_shape: float = Field(1.0, gt=0)
    schedule_peak: float = Field(0.5, gt=0, lt=1)
    chunk_size: int | None = Field(1024, ge=1)  # None: the loss over the whole vocabulary at once
    time_conditioning: bool = False  # the backbone reads the noise level t (as the SCDD reference's does)
    # training steps over which the uniform channel's share of the *input* noise ramps from 0 to uniform_ratio;
    # the loss keeps its coefficients, so from then on it is the exact bound (docs/strategies.md §8.2)
    uniform_warmup_steps: int = Field(0, ge=0)
    # "flat": each row's bound term rescaled to cross-entropy scale (≈ ×t), as MDLM's flat (§5.8)
    loss_weighting: Literal["elbo", "flat"] = "elbo"
    # the sampler's final pass and where its temperature acts; the reference: "argmax", "weights" (§11.5)
    noise_removal: Literal["posterior", "argmax"] = "posterior"
    tempering: Literal["draws", "weights"] = "draws"


class HybridOptions(StrategyOptions):
    """Hybrid diffusion + AR (docs/strategies.md §8.3). `block_size` None: one uniform level per row."""

    ar_loss_alpha: float = Field(1.0, ge=0)
    block_size: int | None = Field(None, ge=1)
    half_life_ratio: float = Field(0.25, gt=0)

    def check_against(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        super().check_against(spec, where)
        hint = " (or leave it unset for one noise level per row)"
        refuse_longer_than_rows(spec, where("block_size"), self.block_size, hint)


class IDLMOptions(StrategyOptions):
    """Introspective diffusion (docs/strategies.md §8.4)."""

    block_length: int = Field(1, ge=1)
    clean_loss_weight: float = Field(0.2, ge=0)
    auto_balance_clean_loss: bool = False

    def check_against(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        super().check_against(spec, where)
        refuse_longer_than_rows(spec, where("block_length"), self.block_length, "")


class DFlashOptions(StrategyOptions):
    """DFlash draft training (docs/strategies.md §8.5, §12.2); usually set in the `dflash:` section.
    `block_size` 0: the draft checkpoint's; `loss_decay_gamma` ≤ 0: the paper's γ for the block size."""

    block_size: int = Field(0, ge=0)
    loss_decay_gamma: float = 0.0
    loss_type: Literal["decay", "dpace"] = "decay"  # position weights: fixed exp decay, or D-PACE (§5.7)
    dpace_alpha: float = Field(0.5, ge=0, le=1)  # D-PACE's confidence floor α (§5.7)
    # 0: each prediction's label is the row's token; k > 0: the target's top-k next-token distribution there
    # (renormalized), EAGLE's distillation target; the cache_target stage stores it (docs/strategies.md §10.7)
    distill_top_k: int = Field(0, ge=0)
    # a new draft also reads, per block position, the token the context lookup proposes there and the matched
    # suffix's length, and learns when to copy it (docs/strategies.md §10.9); false: the draft of the paper
    copy_hint: bool = False
    num_blocks_per_sample: int = Field(1, ge=1)
    attention_backend: Literal["sdpa", "flex_attention"] = "sdpa"
    overlap_anchors: bool = True
    # packed pretraining rows: a block sees only its anchor's document and predicts only its tokens
    # (docs/strategies.md); false: context crosses document boundaries, as the reference's dLLM recipe does
    document_mask: bool = True
    use_fused_linear_ce: bool = True
    ce_chunk_size: int = Field(1024, ge=1)

    @field_validator("block_size")
    @classmethod
    def _block(cls, value: int) -> int:
        if value == 1:
            raise ValueError("dflash.block_size must be at least 2 (or 0 to read it from the draft checkpoint)")
        return value

    def check_against(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        super().check_against(spec, where)
        if not self.block_size:  # 0: the draft checkpoint's, known at run time
            return
        # an anchor block is kept only in a row with ≥ 2 × block_size supervised tokens
        # (strategies.dflash.sample_anchor_blocks): with a larger block, no block ever trains
        key, size, seq_len, regen = where("block_size"), self.block_size, spec.data.seq_len, spec.dflash.regenerate
        supervised, why = seq_len, f"data.seq_len ({seq_len}) tokens"
        if regen is not None and regen.prompt_len < seq_len:
            supervised = seq_len - regen.prompt_len
            why = f"data.seq_len ({seq_len}) − dflash.regenerate.prompt_len ({regen.prompt_len}) = {supervised}"
        if 2 * size > supervised:
            what = (
                f"is larger than data.seq_len ({seq_len})" if size > seq_len else "is too large for the training rows"
            )
            raise ConfigError(
                f"{key} ({size}) {what}: DFlash keeps an anchor block only in a row with at least 2 × {size} = "
                f"{2 * size} supervised tokens, and a row has {why}, so no block would ever train. Set {key} to "
                f"at most {supervised // 2}, or use longer rows"
            )

    def config_vocab_known(self, spec: PipelineSpec) -> bool:
        """The draft writes through the target's head: the target is built from the config's tokenizer only
        when the `pretrain_target` stage trains it (no `dflash.target_model_id`)."""
        return super().config_vocab_known(spec) and spec.dflash.target_model_id is None


class BlockDiffusionOptions(StrategyOptions):
    """Encoder + noised canvas (docs/strategies.md §8.6, §9). `vocab_size` None: the model's."""

    vocab_size: int | None = Field(None, ge=2)
    block_size: int = Field(256, ge=1)
    self_conditioning_p: float = Field(0.5, ge=0, le=1)
    encoder_loss_weight: float = Field(1.0, ge=0)
    # how a canvas token's own evidence enters the prediction (docs/strategies.md §5.4); "learned": the reference
    own_token_evidence: Literal["analytic", "learned"] = "analytic"

    def check_against(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        super().check_against(spec, where)
        # the default (256) may exceed short rows: one canvas block per row, as block_size = seq_len; a value
        # written in the config that is longer than a row is a mistake
        if "block_size" in self.model_fields_set:
            refuse_longer_than_rows(spec, where("block_size"), self.block_size, " (data.seq_len: one block per row)")


@dataclass(frozen=True)
class Registration:
    """One registered strategy: its options and where its class lives (imported on first use, so
    reading options never needs torch). `section`: a config section that holds its options too. `samples`:
    its evaluation draws samples with `eval:`'s sampler settings (a speculative draft's does not: the class's
    `evaluation`, which a test keeps in step)."""

    options: type[StrategyOptions]
    implementation: str  # "module:Class"
    section: str | None = None
    samples: bool = True

    def load(self) -> type:
        module, _, name = self.implementation.partition(":")
        return getattr(import_module(module), name)


# The one list of strategies: config validation, `DLLM_STRATEGIES` and `dllm-flow validate` read it.
REGISTRY: dict[str, Registration] = {
    "mdlm": Registration(MDLMOptions, "strategies.base:MDLMStrategy"),
    "scdd": Registration(SCDDOptions, "strategies.scdd_strategy:SCDDStrategy"),
    "hybrid": Registration(HybridOptions, "strategies.hybrid_strategy:HybridStrategy"),
    "idlm": Registration(IDLMOptions, "strategies.idlm_strategy:IDLMStrategy"),
    "dflash": Registration(DFlashOptions, "strategies.dflash_strategy:DFlashStrategy", section="dflash", samples=False),
    "block_diffusion": Registration(
        BlockDiffusionOptions, "strategies.block_diffusion_strategy:BlockDiffusionStrategy"
    ),
}


def registration(name: str) -> Registration:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"Unknown dllm.mode: {name!r}. Available: {sorted(REGISTRY)}") from None


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


def validate_config(raw: dict, source: str = "<dict>") -> PipelineSpec:
    """The pipeline config, schema and strategy options checked (what every entry point loads)."""
    spec = pipeline_config.validate_config(raw, source)
    check_spec(spec)
    return spec


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineSpec:
    raw = pipeline_config.apply_overrides(pipeline_config.read_yaml(path), overrides or [])
    return validate_config(raw, str(path))
