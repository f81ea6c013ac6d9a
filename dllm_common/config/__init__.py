"""The declarative pipeline config: YAML → typed, frozen models with every default in one place.

Unknown keys are rejected; every error names the dotted key path, the bad value and what is
allowed (see `ConfigError`). A pipeline file is read by `strategies.options.load_config`, which adds
the strategies' checks.

Its modules, each importing only those above it:

- `errors`: `ConfigError`, `TrainingDiverged` and `cut` / `shown` (a key / a value cut for an error line);
- `context`: context lengths read without loading a model (`MAX_SEQ_LEN`, `local_max_positions`,
  `context_overflow`);
- `sections`: what every section shares, and the pipeline, data, tokenizer, model, train, tracking and dllm
  sections;
- `evaluation`: the eval section (sampling settings per strategy, the scorer, lm-eval tasks);
- `dflash`: the dflash section (the draft's target, its features, regenerated rows);
- `posttrain`: the grpo section (reinforcement learning with verifiable rewards after training);
- `spec`: `PipelineSpec`, the whole pipeline, and the checks across its sections;
- `yaml_loading`: YAML read with its defences, `--set` overrides, `validate_schema` and its error messages;
- `digest`: `canonical_json`, `config_sha256` and `flatten`.

Every public name of these modules is importable from the package itself.
"""

from dllm_common.config.context import MAX_CHARS_PER_TOKEN, MAX_SEQ_LEN, context_overflow, local_max_positions
from dllm_common.config.dflash import DFlashConfig, PretrainTargetConfig, RegenerateConfig
from dllm_common.config.digest import canonical_json, config_sha256, flatten
from dllm_common.config.errors import ConfigError, TrainingDiverged, cut, shown
from dllm_common.config.evaluation import (
    OPEN_ENDED_TEMPERATURE,
    OPEN_ENDED_TOP_P,
    EvalConfig,
    LMEvalConfig,
    SamplerSettings,
    ScorerConfig,
)
from dllm_common.config.posttrain import GRPOConfig
from dllm_common.config.sections import (
    PIPELINE_NAME,
    ConfigSection,
    DataConfig,
    DLLMSection,
    ModelConfig,
    PeftConfig,
    PipelineConfig,
    TokenizerConfig,
    TrackingConfig,
    TrainConfig,
    refuse_boolean_number,
    refuse_long_warmup,
)
from dllm_common.config.spec import PipelineSpec
from dllm_common.config.yaml_loading import (
    ALIAS_EXPANSION_LIMIT,
    AliasExpansionError,
    DuplicateKeyError,
    UniqueKeyLoader,
    apply_overrides,
    load_yaml,
    parse_override,
    read_yaml,
    validate_schema,
)

__all__ = [
    "ALIAS_EXPANSION_LIMIT",
    "MAX_CHARS_PER_TOKEN",
    "MAX_SEQ_LEN",
    "OPEN_ENDED_TEMPERATURE",
    "OPEN_ENDED_TOP_P",
    "PIPELINE_NAME",
    "AliasExpansionError",
    "ConfigError",
    "ConfigSection",
    "DFlashConfig",
    "DLLMSection",
    "DataConfig",
    "DuplicateKeyError",
    "EvalConfig",
    "GRPOConfig",
    "LMEvalConfig",
    "ModelConfig",
    "PeftConfig",
    "PipelineConfig",
    "PipelineSpec",
    "PretrainTargetConfig",
    "RegenerateConfig",
    "SamplerSettings",
    "ScorerConfig",
    "TokenizerConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainingDiverged",
    "UniqueKeyLoader",
    "apply_overrides",
    "canonical_json",
    "config_sha256",
    "context_overflow",
    "flatten",
    "load_yaml",
    "local_max_positions",
    "parse_override",
    "read_yaml",
    "refuse_boolean_number",
    "refuse_long_warmup",
    "cut",
    "shown",
    "validate_schema",
]
