"""Declarative config: every shipped YAML validates; bad input gets one clear message."""

import re

import pytest
from conftest import ROOT
from pydantic import ValidationError

from dllm_common.config import ConfigError, PipelineSpec, apply_overrides, flatten
from strategies.options import load_config, resolve_options, validate_config
from strategies.registry import REGISTRY

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


def test_silently_accepted_values_are_refused(tmp_path):
    """Values that used to be taken as something else (issue: one clear error for every bad input): an empty
    file, a boolean where a number goes (YAML's yes/no/true), a budget below one step."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("# only a comment\n")
    with pytest.raises(ConfigError, match="is empty; a pipeline needs at least its sections"):
        load_config(empty)
    for raw, where in (
        ({"train": {"steps": True}}, "train.steps"),
        ({"eval": {"top_p": False}}, "eval.top_p"),
        ({"data": {"max_val_rows": True}}, "data.max_val_rows"),
        ({"dllm": {"eps": True}}, "eps"),
        ({"pipeline": {"strategies": ["scdd"]}, "dllm": {"uniform_ratio": False}}, "uniform_ratio"),
    ):
        with pytest.raises(ConfigError) as err:
            validate_config(raw)
        assert f"{where}: Value error, expected a number, not a boolean" in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match=r"eval.nfe_budgets.0: Input should be greater than or equal to 1"):
        validate_config({"eval": {"nfe_budgets": [-3, 4]}})
    ok = validate_config(
        {
            "pipeline": {"strategies": ["scdd"]},
            "dllm": {"time_conditioning": True},
            "train": {"steps": 3, "warmup_steps": 3},
        }
    )
    assert ok.train.steps == 3 and ok.eval.greedy is True  # real booleans stay booleans


def test_unknown_strategy_lists_allowed():
    with pytest.raises(ConfigError) as err:
        validate_config({"pipeline": {"strategies": ["mdlm", "gpt"]}})
    assert "'gpt'" in str(err.value) and "block_diffusion" in str(err.value)


def test_batch_must_divide():
    with pytest.raises(ConfigError, match="global_batch_size"):
        validate_config({"train": {"global_batch_size": 10, "micro_batch_size": 4}})


def test_overrides_are_yaml_typed_and_dotted(tmp_path):
    raw = apply_overrides(
        {"train": {"steps": 3, "warmup_steps": 0}}, ["train.steps=7", "eval.prompts=[a, b]", "tracking.uri=null"]
    )
    spec = validate_config(raw)
    assert spec.train.steps == 7 and spec.eval.prompts == ("a", "b") and spec.tracking.uri is None


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["train.steps"])
    with pytest.raises(ConfigError, match=r"override 'eval.nfe_budgets=\[1,2': the value '\[1,2' is not valid YAML"):
        apply_overrides({}, ["eval.nfe_budgets=[1,2"])


def test_models_are_frozen():
    spec = PipelineSpec()
    with pytest.raises(ValidationError):
        spec.train.steps = 3


def test_flatten_gives_dotted_params():
    spec = validate_config({"dllm": {"eps": 0.01}})
    flat = flatten(spec)
    assert flat["train.lr"] == PipelineSpec().train.lr and flat["dllm.eps"] == 0.01


def test_per_strategy_dllm_overrides_merge_and_validate():
    spec = validate_config(
        {
            "pipeline": {"strategies": ["hybrid", "block_diffusion"]},
            "dllm": {"block_size": 8, "ar_loss_alpha": 0.5, "overrides": {"block_diffusion": {"block_size": 16}}},
        }
    )
    assert resolve_options(spec, "block_diffusion").block_size == 16
    hybrid = resolve_options(spec, "hybrid")
    assert hybrid.block_size == 8 and hybrid.ar_loss_alpha == 0.5
    for bad, message in [
        ({"nope": {}}, "unknown strategy 'nope'"),
        ({"hybrid": {"bogus": 1}}, r"dllm.overrides.hybrid\):\n  bogus: unknown key"),
        ({"hybrid": {"block_size": 0}}, r"dllm.overrides.hybrid\):\n  block_size: Input should be greater"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_config({"pipeline": {"strategies": ["hybrid"]}, "dllm": {"overrides": bad}})


def test_per_strategy_eval_sampler_overrides_apply_to_that_strategy_alone():
    spec = validate_config(
        {
            "pipeline": {"strategies": ["mdlm", "scdd"]},
            "eval": {"temperature": 0.9, "top_p": 0.8, "overrides": {"scdd": {"temperature": 1.3}}},
        }
    )
    scdd, mdlm = spec.eval.for_strategy("scdd"), spec.eval.for_strategy("mdlm")
    assert (scdd.temperature, scdd.top_p, scdd.remasking) == (1.3, 0.8, "low_confidence")  # unset keys: eval's
    assert (mdlm.temperature, mdlm.top_p) == (0.9, 0.8)
    assert set(scdd.overrides) == {"scdd"} and mdlm.overrides == {}  # only its own entry is kept (its record)
    assert scdd.for_strategy("scdd") == scdd  # applying twice changes nothing
    off = validate_config(
        {"pipeline": {"strategies": ["mdlm"]}, "eval": {"threshold": 0.9, "overrides": {"mdlm": {"threshold": None}}}}
    )
    assert off.eval.for_strategy("mdlm").threshold is None  # an explicit null turns a shared setting off
    # a saved config (run record, resume, MLflow params) reloads to the same entries, not to explicit nulls
    compare = load_config(ROOT / "configs" / "compare.yaml")
    reloaded = validate_config(compare.model_dump(mode="json"))
    assert reloaded.eval.overrides["scdd"].model_fields_set == {"temperature"}
    assert reloaded.eval.for_strategy("scdd") == compare.eval.for_strategy("scdd")
    assert (reloaded.eval.for_strategy("scdd").top_p, reloaded.eval.for_strategy("scdd").temperature) == (0.95, 1.3)
    for bad, message in [
        (
            {"idlm": {"temperature": 1.0}},
            r"eval.overrides.idlm: 'idlm' is not in pipeline.strategies \['mdlm', 'scdd'\]",
        ),
        ({"scdd": {"temperature": -1}}, r"eval.overrides.scdd.temperature: Input should be greater than or equal"),
        (
            {"scdd": {"steps": 8}},
            r"eval.overrides.scdd.steps: unknown key \(value 8\); allowed keys here: \['remasking'",
        ),
        ({"scdd": {"top_p": None}}, r"top_p: null is not a setting .*remove the key to keep eval.top_p"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_config({"pipeline": {"strategies": ["mdlm", "scdd"]}, "eval": {"overrides": bad}})
    with pytest.raises(ConfigError, match="eval.overrides.dflash: dflash is judged by speculative decoding"):
        validate_config({"pipeline": {"strategies": ["dflash"]}, "eval": {"overrides": {"dflash": {"top_k": 5}}}})


def test_registrations_know_which_strategies_sample_with_the_eval_settings():
    from strategies.assembly import strategy_class

    for name, reg in REGISTRY.items():
        assert reg.samples == (strategy_class(name).evaluation != "speculative"), name


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_each_strategy_owns_frozen_options_that_refuse_unknown_keys(name):
    options_cls = REGISTRY[name].options
    defaults = options_cls()
    assert defaults.eps == 1e-3 and defaults.mask_token_id is None
    with pytest.raises(ValidationError):
        defaults.eps = 0.5  # frozen
    with pytest.raises(Exception, match="extra"):
        options_cls.model_validate({"not_an_option": 1})


def test_a_shared_key_no_strategy_of_the_pipeline_reads_is_refused():
    with pytest.raises(ConfigError, match=r"dllm: \['block_length'\] set but no strategy .*'idlm'"):
        validate_config({"pipeline": {"strategies": ["mdlm"]}, "dllm": {"block_length": 2}})


def test_a_shared_key_reaches_only_the_strategies_that_declare_it():
    spec = validate_config({"pipeline": {"strategies": ["mdlm", "idlm"]}, "dllm": {"block_length": 3, "eps": 0.01}})
    assert resolve_options(spec, "idlm").block_length == 3 and resolve_options(spec, "idlm").eps == 0.01
    assert resolve_options(spec, "mdlm").eps == 0.01 and not hasattr(resolve_options(spec, "mdlm"), "block_length")


def test_dflash_options_come_from_its_section_over_the_shared_values():
    spec = validate_config(
        {
            "pipeline": {"strategies": ["dflash"]},
            "model": {"num_layers": 1},
            "dllm": {"mask_token_id": 5},
            "dflash": {"block_size": 8},
        }
    )
    opts = resolve_options(spec, "dflash")
    assert opts.block_size == 8 and opts.mask_token_id == 5 and opts.num_blocks_per_sample == 1
    with pytest.raises(ConfigError, match="block_sise: unknown key"):
        validate_config({"pipeline": {"strategies": ["dflash"]}, "dflash": {"block_sise": 8}})
    with pytest.raises(ConfigError, match="at least 2"):
        validate_config({"pipeline": {"strategies": ["dflash"]}, "dflash": {"block_size": 1}})
    with pytest.raises(ConfigError, match=r"dflash: \['block_size'\] set but 'dflash' is not in pipeline.strategies"):
        validate_config({"dflash": {"block_size": 8}})


def test_a_huge_name_or_override_is_echoed_as_its_start_and_length():
    """A 100,000-character strategy name (or override) is named by its start and its length, not echoed whole."""
    from strategies.options import load_config

    name = "x" * 100_000
    quickstart = ROOT / "configs" / "quickstart.yaml"
    for override, start in (
        (f"pipeline.strategies=[{name}]", "pipeline.strategies: unknown strategy 'xxx"),
        (f"eval.overrides={{{name}: {{temperature: 1}}}}", "override 'eval.overrides={xxx"),
        (f"eval.overrides.{name}.temperature=1", "eval.overrides.xxx"),
        (f"dllm.{name}=1", "dllm: unknown key dllm.xxx"),
        (f"data.{name}=1", "invalid config"),
        (f"pipeline.name={name}", "invalid config"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(quickstart, [override])
        message = str(err.value)
        assert message.startswith(start) and len(message) < 2000 and message.count("x" * 200) == 0, message[:400]
        assert re.search(r"… \(1000\d\d characters\)", message), message  # the name's or the override's length
