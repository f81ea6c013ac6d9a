"""Model metadata agrees with the tokenizer: every published and exported folder's config.json (and
generation_config.json where it has one) names the tokenizer's own BOS/EOS/PAD ids (null where it has none) and
the [MASK] id of a strategy that writes one, read back with transformers; a [MASK] id that is also EOS or PAD is
refused in one line as early as it is known, and trained with under `tokenizer.allow_mask_alias`
(docs/strategies.md §7.1)."""

import json
from pathlib import Path

import pytest
from conftest import denoiser_strategies
from stagekit import dflash_spec
from transformers import AutoConfig, AutoTokenizer

from dllm_common.config import ConfigError, validate_schema
from strategies import strategy_class
from tasks.commands.export import export_checkpoint
from tasks.train import model_dir, train

IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _short(spec, steps: int = 2):
    raw = spec.model_dump(mode="json")
    raw["train"].update(steps=steps, val_every=steps, checkpoint_every=steps, warmup_steps=1)
    return validate_schema(raw)


def _agrees(folder: Path, mask: int | None) -> dict:
    """Assert config.json (raw, and as transformers reads it, its text config too) and generation_config.json
    name the tokenizer's ids; returns config.json."""
    folder = Path(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    for key in IDS:
        assert key in raw and raw[key] == getattr(tok, key), (key, raw.get(key), getattr(tok, key))
    config = AutoConfig.from_pretrained(folder)
    for cfg in (config, config.get_text_config()):
        assert [getattr(cfg, k) for k in IDS] == [getattr(tok, k) for k in IDS], type(cfg).__name__
    assert config.eos_token_id == tok.eos_token_id != tok.mask_token_id
    if mask is None:
        assert "mask_token_id" not in raw
    else:
        assert (
            mask == tok.mask_token_id
            and raw.get("mask_token_id", raw.get("dflash_config", {}).get("mask_token_id")) == mask
        )
    generation = folder / "generation_config.json"
    if generation.is_file():
        settings = json.loads(generation.read_text())
        assert {k: settings.get(k) for k in IDS} == {k: getattr(tok, k) for k in IDS}
    return raw


@pytest.fixture(scope="module")
def published(prepared, tiny_spec, tmp_path_factory):
    """Each denoiser strategy trained 2 steps and published in one workdir."""
    data, _ = prepared
    workdir = tmp_path_factory.mktemp("metadata")
    spec = _short(tiny_spec)
    return {name: train(spec, name, data, str(workdir)) for name in denoiser_strategies()}, workdir


@pytest.mark.parametrize("strategy", denoiser_strategies())
def test_a_published_model_names_its_tokenizers_ids(published, strategy):
    refs, _ = published
    tok = AutoTokenizer.from_pretrained(model_dir(refs[strategy]))
    mask = tok.mask_token_id if strategy_class(strategy).uses_mask_token else None
    raw = _agrees(model_dir(refs[strategy]), mask)
    assert (
        raw["bos_token_id"] is None and raw["eos_token_id"] == 1 and raw["pad_token_id"] == 0
    )  # tokenizer trained here


@pytest.mark.parametrize("strategy", ["mdlm", "hybrid", "block_diffusion"])
def test_an_exported_model_names_its_tokenizers_ids(published, strategy, tmp_path):
    refs, workdir = published
    out = Path(export_checkpoint(str(model_dir(refs[strategy])), tmp_path / "out", workdir))
    tok = AutoTokenizer.from_pretrained(out)
    mask = tok.mask_token_id if strategy_class(strategy).uses_mask_token else None
    _agrees(out, mask)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    if (out / "model" / "config.json").is_file():  # the dllm-flow checkpoint beside a wrapped backbone
        _agrees(out / "model", mask)


def test_the_dflash_target_a_draft_and_its_exports_name_the_tokenizers_ids(prepared, tiny_spec, tmp_path):
    from tasks.speculative.target import target as target_stage

    data, _ = prepared
    raw = dflash_spec(tiny_spec, target_layer_ids=[1, 2], target_features="online").model_dump(mode="json")
    raw["train"].update(steps=2, val_every=2, checkpoint_every=2, warmup_steps=1)
    raw["dflash"]["pretrain"].update(steps=4, val_every=2, warmup_steps=1)
    spec = validate_schema(raw)
    tgt = target_stage(spec, data, str(tmp_path))
    _agrees(Path(tgt.info["model_path"]), None)
    trained = train(spec, "dflash", data, str(tmp_path), inputs={"target": tgt})
    tok = AutoTokenizer.from_pretrained(model_dir(trained))
    _agrees(model_dir(trained), tok.mask_token_id)
    for fmt in ("zlab", "speculators"):
        out = Path(export_checkpoint(str(model_dir(trained)), tmp_path / fmt, tmp_path, fmt=fmt))
        if fmt == "zlab":
            _agrees(out, tok.mask_token_id)
        else:  # the speculators layout nests the decoder's config
            layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
            assert {k: layer[k] for k in IDS} == {k: getattr(tok, k) for k in IDS}
            assert json.loads((out / "config.json").read_text())["mask_token_id"] == tok.mask_token_id


# ---------------------------------------------------------------- a [MASK] id that is EOS or PAD


def _raw(tiny_spec, **sections):
    raw = tiny_spec.model_dump(mode="json")
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


@pytest.mark.parametrize(
    ("dllm", "key", "what"),
    [
        ({"mask_token_id": 1}, "dllm.mask_token_id is 1", "EOS"),
        ({"mask_token_id": 0}, "dllm.mask_token_id is 0", "PAD"),
        ({"overrides": {"mdlm": {"mask_token_id": 1}}}, "dllm.overrides.mdlm.mask_token_id is 1", "EOS"),
    ],
)
def test_an_explicit_mask_id_on_eos_or_pad_is_refused_at_config_load(tiny_spec, dllm, key, what):
    with pytest.raises(ConfigError) as err:
        validate_schema(_raw(tiny_spec, dllm=dllm))
    problem = str(err.value).splitlines()[1:]
    assert len(problem) == 1 and problem[0].strip().startswith(key), str(err.value)
    assert f"tokenizer's {what} token id" in problem[0] and "tokenizer.allow_mask_alias: true" in problem[0]
    validate_schema(_raw(tiny_spec, dllm=dllm, tokenizer={"allow_mask_alias": True}))
    validate_schema(_raw(tiny_spec, dllm={"mask_token_id": 5}))  # a special id of its own


@pytest.fixture(scope="module")
def aliased_tokenizer(prepared, tmp_path_factory):
    """The prepared tokenizer with its mask token set to its EOS token, saved as a local pretrained tokenizer."""
    data, _ = prepared
    tok = AutoTokenizer.from_pretrained(Path(data.path) / "tokenizer")
    tok.mask_token = tok.eos_token
    folder = tmp_path_factory.mktemp("aliased") / "tokenizer"
    tok.save_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder).mask_token_id == tok.eos_token_id
    return folder


def test_a_local_tokenizer_whose_mask_is_eos_is_refused_at_config_load(tiny_spec, aliased_tokenizer):
    tokenizer = {"kind": "pretrained", "path": str(aliased_tokenizer)}
    with pytest.raises(
        ConfigError, match=r"the mask token of tokenizer.path .* is 1, which is also the tokenizer's EOS"
    ):
        validate_schema(_raw(tiny_spec, tokenizer=tokenizer))
    validate_schema(_raw(tiny_spec, tokenizer={**tokenizer, "allow_mask_alias": True}))
    validate_schema(_raw(tiny_spec, tokenizer=tokenizer, dllm={"mask_token_id": 5}))  # its own id instead


def test_a_mask_alias_seen_only_in_the_prepared_tokenizer_is_refused_before_any_row(
    tiny_spec, aliased_tokenizer, tmp_path
):
    from tasks.prepare_data import prepare_data
    from tasks.training.trainee import build_trainee

    allowed = validate_schema(
        _raw(tiny_spec, tokenizer={"kind": "pretrained", "path": str(aliased_tokenizer), "allow_mask_alias": True})
    )
    # what config load cannot see (e.g. a hub tokenizer): the same config without the opt-in, unvalidated
    refused = allowed.model_copy(update={"tokenizer": allowed.tokenizer.model_copy(update={"allow_mask_alias": False})})
    with pytest.raises(
        ConfigError, match=r"^the tokenizer's mask token id \(mdlm\) is 1, which is also the tokenizer's EOS"
    ):
        prepare_data(refused, str(tmp_path / "refused"))
    assert not list((tmp_path / "refused" / "store").glob("prepare_data/*/train.*"))
    data = prepare_data(allowed, str(tmp_path / "allowed"))  # the opt-in: prepared and built for training
    with pytest.raises(ConfigError, match=r"^the mask token id train\[mdlm\] resolves is 1, which is also"):
        build_trainee(refused, "mdlm", data, "cpu")
    assert build_trainee(allowed, "mdlm", data, "cpu").mask_token_id == 1
