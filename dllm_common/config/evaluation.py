"""The eval section: how the evaluate stage scores and samples, with each strategy's own sampling settings
(`SamplerSettings`), the scorer of generative perplexity and the lm-evaluation-harness tasks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_serializer, model_validator

from dllm_common.config.sections import ConfigSection


class ScorerConfig(ConfigSection):
    """Frozen causal LM that scores samples (generative perplexity); samples are retokenized for it."""

    path: str  # local dir, hub id (when the user has hub access) or `package:NAME`
    gguf_file: str | None = None  # converted once and kept in the stage store
    trust_remote_code: bool = False


class LMEvalConfig(ConfigSection):
    """lm-evaluation-harness tasks run by the evaluate stage on the trained model (docs/evaluation.md §4.10);
    needs the `lmeval` extra. Hub tasks need hub access; `include_path` adds a folder of local task YAMLs."""

    tasks: tuple[str, ...] = Field(min_length=1)  # task or group names, as `lm_eval --tasks` takes them
    include_path: str | None = None
    mc_samples: int = Field(32, ge=1)  # Monte-Carlo ELBO samples per request (diffusion strategies)
    limit: int | None = Field(None, ge=1)  # documents per task (None: all)
    batch_size: int = Field(8, ge=1)  # rows per forward
    num_fewshot: int | None = Field(None, ge=0)  # None: each task's own


# Open-ended sampling defaults (docs/strategies.md §11.7), chosen by measurement against the data row.
OPEN_ENDED_TEMPERATURE = 1.0
OPEN_ENDED_TOP_P = 0.95


class SamplerSettings(ConfigSection):
    """One strategy's own sampling settings for the report's samples (`eval.overrides.<strategy>`): the keys
    set here replace `eval:`'s for that strategy alone; the rest are `eval:`'s."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    remasking: Literal["low_confidence", "random"] | None = None
    threshold: float | None = Field(None, gt=0, le=1)

    @model_validator(mode="after")
    def _null_only_turns_threshold_off(self) -> SamplerSettings:
        nulls = sorted(k for k in self.model_fields_set if k != "threshold" and getattr(self, k) is None)
        if nulls:
            raise ValueError(
                f"{', '.join(nulls)}: null is not a setting (only threshold: null, which turns the shared one off); "
                f"remove the key to keep eval.{nulls[0]}"
            )
        return self

    def values(self) -> dict[str, Any]:
        """The keys this entry sets (unset ones stay `eval:`'s, also after a save and reload)."""
        return self.model_dump(mode="json", include=self.model_fields_set)


class EvalConfig(ConfigSection):
    val_rows: int = Field(128, ge=1)  # validation rows scored by the NELBO
    t_samples: int = Field(8, ge=1)  # stratified diffusion times per row
    batch_size: int = Field(32, ge=1)
    seed: int = 1234
    num_samples: int = Field(4, ge=0)
    sample_length: int = Field(48, ge=1)
    data_rows: int = Field(32, ge=1)  # held-out rows of the data row (docs/evaluation.md §4.4)
    sample_steps: int = Field(48, ge=1)
    sample_block_size: int = Field(16, ge=1)
    # how the report's samples are drawn (docs/strategies.md §11.7): the settings a user would pick for open-ended
    # text; `generate` defaults to the same. `greedy`: also decode at temperature 0 (the report's second table)
    temperature: float = Field(OPEN_ENDED_TEMPERATURE, ge=0)
    top_p: float = Field(OPEN_ENDED_TOP_P, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    greedy: bool = True
    threshold: float | None = Field(None, gt=0, le=1)  # confidence-threshold parallel decoding (absorbing samplers)
    prompts: tuple[str, ...] = ("To be, or not to be", "My lord,", "What say you", "O")
    task_problems: int = Field(64, ge=1)  # data.source task: held-out problems the accuracy is measured on
    # step budgets of the quality-vs-NFE curve; empty → sample_steps, ½ and ¼ of it
    nfe_budgets: tuple[Annotated[int, Field(ge=1)], ...] = ()
    scorer: ScorerConfig | None = None  # None → no eval/gen_ppl (eval/entropy is always reported)
    lm_eval: LMEvalConfig | None = None  # None → no lm-evaluation-harness tasks
    # per-strategy sampling settings, e.g. `{scdd: {temperature: 1.3}}` (docs/strategies.md §11.7): a sampler
    # whose open-ended settings differ from the shared ones; the report names every strategy's settings
    overrides: dict[str, SamplerSettings] = Field(default_factory=dict)

    @field_serializer("overrides")
    def _only_what_each_entry_sets(self, overrides: dict[str, SamplerSettings]) -> dict[str, dict[str, Any]]:
        # a saved config (run record, MLflow params, stage keys) reloads to the same entries, not to explicit nulls
        return {name: own.values() for name, own in overrides.items()}

    def for_strategy(self, name: str) -> EvalConfig:
        """These settings as `name` is evaluated: its `overrides` entry applied (and kept, alone, as the record of
        what it set), the other strategies' entries dropped. Validated again as a whole."""
        own = self.overrides.get(name)
        merged = {**self.model_dump(exclude={"overrides"}), **(own.values() if own is not None else {})}
        return EvalConfig.model_validate({**merged, "overrides": {name: own.values()} if own is not None else {}})

    def budgets(self) -> list[int]:
        raw = self.nfe_budgets or (self.sample_steps, self.sample_steps // 2, self.sample_steps // 4)
        out: list[int] = []
        for b in raw:
            if b >= 1 and b not in out:
                out.append(int(b))
        return out
