"""What a strategy package declares to be registered (torch-free): its options' base class, its samplers'
descriptions and the `Registration` that ties them to its class.

Each strategy package (`strategies/<name>/`) has an `options.py` that defines its options model, describes
its samplers (`SamplerInfo`) and builds its `REGISTRATION` from them; `strategies.registry.REGISTRY` lists the
registrations. None of this imports torch or the strategy's class: config validation reads it alone, and
the class is imported on first use (`Registration.load`). See docs/architecture.md ("How a strategy plugs in").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

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


# The `strategies.sampling.SamplerConfig` fields a user sets for a sampler (`eval:`, `eval.overrides`,
# `dllm-flow generate` flags); a sampler declares the ones it reads (`SamplerInfo.settings`).
TEMPERATURE_AND_CUTS = ("temperature", "top_k", "top_p")
USER_SETTINGS = (*TEMPERATURE_AND_CUTS, "remasking", "threshold", "lookup_ngram")
# The `SamplerConfig` fields that set how a denoising sampler spends its forwards (`dllm-flow generate --steps`,
# `--block-size`, `--cache`; evaluation's step budgets); a sampler declares the ones it reads
# (`SamplerInfo.decoding`): one with no K/V cache leaves out "cache", a speculative decoder all three.
DECODING_SETTINGS = ("steps", "block_size", "cache")


@dataclass(frozen=True)
class SamplerInfo:
    """What the pipeline needs to know of a sampler: what it does (`dllm-flow generate` lists it), whether it
    fills [MASK] spans anywhere in a prompt (`infill_sample`), its own default temperature (None: evaluation's
    open-ended one, docs/strategies.md §11.7), which user settings it reads (`settings`: the report names exactly
    these when it says how a strategy's samples were drawn; `generate` refuses a flag the sampler ignores) and
    which decoding settings it reads (`decoding`: `generate` shows only these; every other one it ignores)."""

    summary: str
    infills: bool = False
    default_temperature: float | None = None
    settings: tuple[str, ...] = TEMPERATURE_AND_CUTS
    decoding: tuple[str, ...] = DECODING_SETTINGS

    def __post_init__(self) -> None:
        for field_name, known in (("settings", USER_SETTINGS), ("decoding", DECODING_SETTINGS)):
            unknown = sorted(set(getattr(self, field_name)) - set(known))
            if unknown:
                raise ValueError(f"SamplerInfo.{field_name}: unknown setting(s) {unknown}; known: {list(known)}")


# The absorbing [MASK] sampler (`strategies.absorbing.absorbing_sample`) over a strategy's bidirectional
# denoiser: every masked strategy may offer it under this name.
ABSORBING = "llada"
ABSORBING_SAMPLER = SamplerInfo(
    "absorbing [MASK] sampler over the strategy's bidirectional denoiser",
    infills=True,
    settings=(*TEMPERATURE_AND_CUTS, "remasking", "threshold"),
)


# The evaluation hooks a strategy whose registration names none runs (the absorbing sampler and bound over a
# bidirectional denoiser). Spelled "module:Class", which the stage keys follow only on demand (docs/architecture.md,
# "Stage keys"): the training stages never hold it, the evaluation stages do.
BASE_EVALUATOR = "strategies.base_evaluation:DLLMEvaluator"


def load_object(ref: str | type) -> type:
    """A class given as itself or as "module:Class" (the module imported now)."""
    if isinstance(ref, type):
        return ref
    module, _, name = ref.partition(":")
    return getattr(import_module(module), name)


# the GRPO estimators a bidirectional masked-diffusion denoiser supports (d1's one-step, DiffuCoder's coupled, SPG's
# ELBO/EUBO)
MASKED_ESTIMATORS = ("one_step", "coupled", "elbo_eubo")


@dataclass(frozen=True)
class Registration:
    """One registered strategy: its options, its class, its samplers and its model shapes.

        `implementation`: the class, or where it lives as "module:Class" (imported on first use, so reading
        options never needs torch). `samplers`: name → `SamplerInfo`, the strategy's own first (what its `sample`
        runs and `dllm-flow generate --sampler auto` picks); the class's `samplers` must list the same names
        (`load` checks). `section`: a config section that holds its options too. `samples`: its evaluation draws
        samples with `eval:`'s sampler settings (a speculative draft's does not: the class's `evaluation`, which
        `load` checks too). `models`: the model shapes it trains, by the name a checkpoint records
        (`config.dllm_architecture`), as classes or "module:Class": a wrapper of a causal LM built as
        `Shape(lm, mask_token_id)`, or a module that recognizes its own checkpoint folder (`describes(path)`) and
        rebuilds itself from it (`from_config_dir`). `evaluator`: the strategy's evaluation hooks (its samplers,
    likelihood rows, denoiser and evaluation metrics: a `strategies.base_evaluation.DLLMEvaluator` subclass), as the
    class or "module:Class", loaded only when a hook is called; None: the base evaluator (`BASE_EVALUATOR`). They
    live apart from the class so that the training stages' keys never hold them (`modules`). `estimators`: the
    likelihood estimators GRPO may build its ratio from for this strategy (docs/post-training.md, "Likelihood
    estimators"): "one_step", "coupled" and "elbo_eubo" need a masked-diffusion denoiser, "exact_ar" the evaluator's
    `causal_logits`; none: the strategy is not post-trained."""

    options: type[StrategyOptions]
    implementation: str | type
    samplers: Mapping[str, SamplerInfo]
    section: str | None = None
    samples: bool = True
    models: Mapping[str, str | type] = field(default_factory=dict)
    evaluator: str | type | None = None
    estimators: tuple[str, ...] = MASKED_ESTIMATORS

    def __post_init__(self) -> None:
        if not self.samplers:
            raise ValueError("a Registration declares at least one sampler (name → SamplerInfo)")

    def modules(self, models_only: bool = False, evaluation: bool = False) -> tuple[str, ...]:
        """The modules this registration loads on demand — its class's and its model shapes' (`models_only`: the
        shapes'), and with `evaluation` its evaluator's — which the stages of the strategy key their code by
        (docs/architecture.md, "Stage keys"): a training stage by the first, an evaluation stage by all three."""
        refs = (*(() if models_only else (self.implementation,)), *self.models.values())
        if evaluation:
            refs = (*refs, self.evaluator_ref)
        return tuple(dict.fromkeys(r.partition(":")[0] if isinstance(r, str) else r.__module__ for r in refs))

    @property
    def evaluator_ref(self) -> str | type:
        """The evaluator class or where it lives (`BASE_EVALUATOR` where the registration names none)."""
        return BASE_EVALUATOR if self.evaluator is None else self.evaluator

    def implements(self, cls: type) -> bool:
        """Whether `cls` is this registration's class (named by "module:Class" or given as itself), without
        importing anything."""
        ref = self.implementation
        return cls is ref if isinstance(ref, type) else ref == f"{cls.__module__}:{cls.__qualname__}"

    def load(self) -> type:
        """The strategy class, checked against this registration (its options, samplers and evaluation)."""
        cls = load_object(self.implementation)
        where = getattr(cls, "__qualname__", repr(cls))
        if cls.Options is not self.options:
            raise TypeError(f"{where}.Options is {cls.Options.__name__}, its registration says {self.options.__name__}")
        if tuple(cls.samplers) != tuple(self.samplers):
            raise TypeError(
                f"{where}.samplers is {tuple(cls.samplers)}, its registration declares {tuple(self.samplers)}; "
                "set `samplers = tuple(<the package's sampler table>)` on the class"
            )
        if self.samples != (cls.evaluation == "diffusion"):
            raise TypeError(
                f"{where}.evaluation is {cls.evaluation!r} but its registration says samples={self.samples} "
                "(a 'diffusion' evaluation samples with eval: settings, a 'speculative' one does not)"
            )
        if cls.model_architecture is not None and cls.model_architecture not in self.models:
            raise TypeError(
                f"{where}.model_architecture is {cls.model_architecture!r}, a model shape its registration does not "
                f"declare (models: {sorted(self.models)})"
            )
        return cls
