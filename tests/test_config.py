"""Declarative config: every shipped YAML validates; bad input gets one clear message."""

import pytest
from conftest import ROOT

from dllm_common.config import ConfigError, PipelineSpec, apply_overrides, flatten, load_config, validate_config

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path):
    spec = load_config(path)
    assert spec.pipeline.strategies


def test_configs_folder_is_not_empty():
    assert {p.name for p in CONFIGS} >= {"quickstart.yaml", "smoke.yaml"}


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_unknown_key_names_path_value_and_allowed_keys():
    with pytest.raises(ConfigError) as err:
        validate_config({"train": {"stepz": 5}})
    msg = str(err.value)
    assert "train.stepz" in msg and "unknown key" in msg and "5" in msg and "'steps'" in msg


def test_unknown_top_level_section():
    with pytest.raises(ConfigError, match="trainer: unknown key.*'train'"):
        validate_config({"trainer": {}})


def test_wrong_type_names_path_and_value():
    with pytest.raises(ConfigError) as err:
        validate_config({"train": {"steps": "many"}})
    assert "train.steps" in str(err.value) and "'many'" in str(err.value)


def test_unknown_strategy_lists_allowed():
    with pytest.raises(ConfigError) as err:
        validate_config({"pipeline": {"strategies": ["mdlm", "gpt"]}})
    assert "'gpt'" in str(err.value) and "block_diffusion" in str(err.value)


def test_batch_must_divide():
    with pytest.raises(ConfigError, match="global_batch_size"):
        validate_config({"train": {"global_batch_size": 10, "micro_batch_size": 4}})


def test_overrides_are_yaml_typed_and_dotted(tmp_path):
    raw = apply_overrides({"train": {"steps": 3}}, ["train.steps=7", "eval.prompts=[a, b]", "tracking.uri=null"])
    spec = validate_config(raw)
    assert spec.train.steps == 7 and spec.eval.prompts == ("a", "b") and spec.tracking.uri is None


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["train.steps"])


def test_models_are_frozen():
    spec = PipelineSpec()
    with pytest.raises(Exception):
        spec.train.steps = 3


def test_flatten_gives_dotted_params():
    flat = flatten(PipelineSpec())
    assert flat["train.lr"] == PipelineSpec().train.lr and "dllm.eps" in flat


def test_per_strategy_dllm_overrides_merge_and_validate():
    spec = validate_config(
        {"dllm": {"block_size": 8, "ar_loss_alpha": 0.5, "overrides": {"block_diffusion": {"block_size": 16}}}}
    )
    assert spec.dllm.for_strategy("block_diffusion").block_size == 16
    assert spec.dllm.for_strategy("block_diffusion").mode == "block_diffusion"
    hybrid = spec.dllm.for_strategy("hybrid")
    assert hybrid.block_size == 8 and hybrid.ar_loss_alpha == 0.5 and hybrid.mode == "hybrid"
    for bad, message in [
        ({"nope": {}}, "unknown strategy 'nope'"),
        ({"hybrid": {"bogus": 1}}, r"dllm.overrides.hybrid: unknown key\(s\) \['bogus'\]"),
        ({"hybrid": {"block_size": 0}}, "dllm.overrides.hybrid.block_size: Input should be greater"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_config({"dllm": {"overrides": bad}})
