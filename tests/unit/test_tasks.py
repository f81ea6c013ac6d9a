"""The thin Prefect wrappers: `.fn` is the plain stage function and the cache key is the store key."""

import hashlib

from tasks.evaluate import evaluate, evaluate_task
from tasks.prepare_data import prepare_data, prepare_data_task, stage_of
from tasks.report import report, report_task
from tasks.train import train, train_task


def test_tasks_wrap_the_plain_stage_functions():
    assert prepare_data_task.fn is prepare_data and train_task.fn is train
    assert evaluate_task.fn is evaluate and report_task.fn is report


def test_cache_key_is_the_store_key_and_follows_the_config(tiny_spec, tmp_path):
    params = {"spec": tiny_spec, "workdir": str(tmp_path)}
    stage, key = stage_of(**params)
    where = hashlib.sha256(str((tmp_path / "store").resolve()).encode()).hexdigest()[:12]
    assert prepare_data_task.cache_key_fn(None, params) == f"{stage}/{key}/prefect-result-{where}"
    changed = tiny_spec.model_copy(update={"tokenizer": tiny_spec.tokenizer.model_copy(update={"vocab_size": 400})})
    assert not prepare_data_task.cache_key_fn(None, {**params, "spec": changed}).startswith(f"{stage}/{key}/")
    eval_only = tiny_spec.model_copy(update={"eval": tiny_spec.eval.model_copy(update={"t_samples": 5})})
    assert (
        prepare_data_task.cache_key_fn(None, {**params, "spec": eval_only}) == f"{stage}/{key}/prefect-result-{where}"
    )
    # a workdir at another path (moved, copied, mounted elsewhere) never gets the cached refs to the old files
    elsewhere = {**params, "workdir": str(tmp_path / "moved")}
    assert prepare_data_task.cache_key_fn(None, elsewhere).startswith(f"{stage}/{key}/prefect-result-")
    assert prepare_data_task.cache_key_fn(None, elsewhere) != prepare_data_task.cache_key_fn(None, params)


def test_a_strategy_with_an_invalid_normalization_mode_is_rejected(monkeypatch):
    """Spec §16: setup refuses a normalization mode other than 'supervised' / 'noise'."""
    import pytest

    from strategies import DLLM_STRATEGIES, MDLMStrategy, assemble_strategy

    class Broken(MDLMStrategy):
        @property
        def normalization_mode(self):
            return "tokens"

    monkeypatch.setitem(DLLM_STRATEGIES, "mdlm", Broken)
    with pytest.raises(ValueError, match="Invalid normalization_mode 'tokens'.*Must be 'supervised' or 'noise'"):
        assemble_strategy("mdlm", {}, None, None, mask_token_id=3)


def test_checkpoints_written_before_typed_options_still_rebuild_their_strategy():
    from strategies.options import DFlashOptions, MDLMOptions
    from tasks.evaluation.trained_model import checkpoint_options

    assert checkpoint_options({"options": {"eps": 0.02}}, MDLMOptions.model_fields) == {"eps": 0.02}
    legacy = {"dllm": {"mode": "mdlm", "eps": 0.01, "block_size": None, "loss_weighting": "flat"}}
    assert checkpoint_options(legacy, MDLMOptions.model_fields) == {"eps": 0.01, "loss_weighting": "flat"}
    draft = {
        "strategy": "dflash",
        "dllm": {"eps": 0.01, "block_size": None},
        "dflash": {"block_size": 8, "target_features": "cached"},
    }
    assert checkpoint_options(draft, DFlashOptions.model_fields) == {"eps": 0.01, "block_size": 8}


def test_an_eval_override_rekeys_only_the_strategy_it_names(tiny_spec, tmp_path):
    from strategies.options import validate_config
    from tasks.common import StageRef
    from tasks.evaluate import stage_of as eval_stage_of

    (tmp_path / "model").mkdir()  # the trained checkpoint's records its evaluation is keyed on
    (tmp_path / "model" / "digests.json").write_text("{}")
    (tmp_path / "model" / "dllm.json").write_text("{}")

    def keys(overrides):
        raw = tiny_spec.model_dump(mode="json")
        raw["pipeline"]["strategies"] = ["mdlm", "scdd"]
        raw["eval"]["overrides"] = overrides
        spec = validate_config(raw)
        data = StageRef("prepare_data", "d" * 24, str(tmp_path))
        return {
            s: eval_stage_of(spec, s, StageRef(f"train[{s}]", s * 3, str(tmp_path)), data, str(tmp_path))[1]
            for s in ("mdlm", "scdd")
        }

    plain, hot, hotter = keys({}), keys({"scdd": {"temperature": 1.3}}), keys({"scdd": {"temperature": 1.5}})
    assert plain["mdlm"] == hot["mdlm"] == hotter["mdlm"]  # mdlm's evaluation is reused
    assert len({plain["scdd"], hot["scdd"], hotter["scdd"]}) == 3
    same = keys({"scdd": {"temperature": tiny_spec.eval.temperature}})  # set to the shared value: same samples,
    assert same["scdd"] != plain["scdd"]  # but recorded as its own setting (card, report), so keyed apart
