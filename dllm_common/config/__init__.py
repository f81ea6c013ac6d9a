"""The declarative pipeline config: YAML → typed, frozen models with every default in one place.

Unknown keys are rejected; every error names the dotted key path, the bad value and what is
allowed (see `ConfigError`). A pipeline file is read by `strategies.options.load_config`, which adds
the strategies' checks.
"""

from dllm_common.config.sections import (
    ALIAS_EXPANSION_LIMIT,
    MAX_CHARS_PER_TOKEN,
    MAX_SEQ_LEN,
    ConfigError,
    DataConfig,
    DLLMSection,
    EvalConfig,
    LMEvalConfig,
    PeftConfig,
    PipelineSpec,
    RegenerateConfig,
    ScorerConfig,
    TokenizerConfig,
    TrainConfig,
    TrainingDiverged,
    apply_overrides,
    canonical_json,
    config_sha256,
    context_overflow,
    flatten,
    parse_override,
    read_yaml,
    refuse_boolean_number,
    validate_schema,
)

__all__ = [
    "ALIAS_EXPANSION_LIMIT",
    "MAX_CHARS_PER_TOKEN",
    "MAX_SEQ_LEN",
    "ConfigError",
    "DLLMSection",
    "DataConfig",
    "EvalConfig",
    "LMEvalConfig",
    "PeftConfig",
    "PipelineSpec",
    "RegenerateConfig",
    "ScorerConfig",
    "TokenizerConfig",
    "TrainConfig",
    "TrainingDiverged",
    "apply_overrides",
    "canonical_json",
    "config_sha256",
    "context_overflow",
    "flatten",
    "parse_override",
    "read_yaml",
    "refuse_boolean_number",
    "validate_schema",
]
