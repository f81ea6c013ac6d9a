"""Bad arguments to the Python API and the commands' helpers get one clear error naming the function, the
argument, its value and the valid range, raised before any computation (they used to surface as broadcast
RuntimeErrors, ZeroDivisionErrors or silently wrong results)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dllm_common.config import ConfigError
from strategies import corruption as C
from strategies.dflash.blocks import _build_target_layer_ids
from strategies.options import validate_config
from strategies.sampling import SamplerConfig
from strategies.scdd.schedule import scdd_grid_times

IDS, LM = torch.randint(0, 10, (2, 8), generator=torch.Generator().manual_seed(0)), torch.ones(2, 8)


def _refused(call, *parts: str) -> str:
    """`call()` raises one ValueError whose message holds every part; returns the message."""
    with pytest.raises(ValueError) as err:
        call()
    msg = str(err.value)
    assert all(p in msg for p in parts), msg
    assert "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------- 1. per-row levels: shape and range


@pytest.mark.parametrize(
    "call, parts",
    [
        (
            lambda g: C.mask_at_level(IDS, LM, 3, torch.rand(3), g),
            ["mask_at_level: p must be", "[batch] = (2,)", "got shape (3,)"],
        ),
        (lambda g: C.mask_at_level(IDS, LM, 3, torch.rand(2, 1), g), ["mask_at_level: p", "got shape (2, 1)"]),
        (
            lambda g: C.mask_at_level(IDS, LM, 3, torch.tensor([1.5, -0.2]), g),
            ["mask_at_level: p must be a probability in [0, 1], got values from -0.2 to 1.5"],
        ),
        (
            lambda g: C.mask_at_level(IDS, LM, 3, torch.tensor([0.5, float("nan")]), g),
            ["mask_at_level: p must be a probability in [0, 1]", "nan"],
        ),
        (lambda g: C.mask_at_level(IDS, LM, 3, 2.0, g), ["mask_at_level: p must be a probability in [0, 1], got 2"]),
        (
            lambda g: C.corrupt_mix(
                IDS, LM, 3, 50, mask_prob=torch.full((3,), 0.3), uniform_prob=torch.full((3,), 0.3), generator=g
            ),
            ["corrupt_mix: mask_prob must be", "[batch] = (2,)", "got shape (3,)"],
        ),
        (
            lambda g: C.corrupt_mix(
                IDS, LM, 3, 50, mask_prob=torch.full((2,), 0.3), uniform_prob=torch.full((4,), 0.3), generator=g
            ),
            ["corrupt_mix: uniform_prob must be", "got shape (4,)"],
        ),
        (
            lambda g: C.corrupt_mix(
                IDS, LM, 3, 50, mask_prob=torch.full((2,), -0.3), uniform_prob=torch.full((2,), 0.3), generator=g
            ),
            ["corrupt_mix: mask_prob must be a probability in [0, 1], got -0.3"],
        ),
        (
            lambda g: C.corrupt_mix(
                IDS, LM, 3, 50, mask_prob=torch.full((2,), 0.2), uniform_prob=torch.tensor([0.1, -0.5]), generator=g
            ),
            ["corrupt_mix: uniform_prob must be a probability in [0, 1], got values from -0.5 to 0.1"],
        ),
    ],
    ids=["p-rows", "p-2d", "p-range", "p-nan", "p-scalar", "mix-rows", "uniform-rows", "mix-negative", "uniform-neg"],
)
def test_bad_levels_are_refused_by_name_before_any_draw(call, parts):
    g = torch.Generator().manual_seed(1)
    state = g.get_state()
    _refused(lambda: call(g), *parts)
    assert torch.equal(g.get_state(), state)  # refused before any computation: nothing drawn


def test_levels_of_every_accepted_shape_still_work():
    for p in (torch.full((2,), 0.5), torch.tensor([0.5]), torch.tensor(0.5), 0.5, torch.tensor([0.0, 1.0])):
        noisy, noise = C.mask_at_level(IDS, LM, 11, p, torch.Generator().manual_seed(0))
        assert noisy.shape == noise.shape == IDS.shape
    _, noise = C.mask_at_level(IDS, LM, 11, torch.tensor([0.0, 1.0]))
    assert not noise[0].any() and noise[1].all()
    for mp, up in ((torch.full((2,), 0.3), torch.full((2,), 0.3)), (torch.tensor([0.3]), 0.3), (0.0, 1.0)):
        z, n = C.corrupt_mix(IDS, LM, 11, 50, mask_prob=mp, uniform_prob=up, generator=torch.Generator())
        assert z.shape == n.shape == IDS.shape


# ---------------------------------------------------------------- 2. sizes, ratios and the SCDD grid


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: C.corrupt_blockwise(IDS, LM, 3, block_size=0),
            "corrupt_blockwise: block_size must be an integer >= 1, got 0",
        ),
        (
            lambda: C.corrupt_blockwise(IDS, LM, 3, block_size=-2),
            "corrupt_blockwise: block_size must be an integer >= 1, got -2",
        ),
        (
            lambda: C.corrupt_blockwise(IDS, LM, 3, block_size=2.5),
            "corrupt_blockwise: block_size must be an integer >= 1, got 2.5",
        ),
        (
            lambda: C.corrupt_blockwise(IDS, LM, 3, half_life_ratio=0),
            "corrupt_blockwise: half_life_ratio must be a finite number > 0, got 0",
        ),
        (
            lambda: C.corrupt_blockwise(IDS, LM, 3, block_size=4, half_life_ratio=-1.0),
            "corrupt_blockwise: half_life_ratio must be a finite number > 0, got -1.0",
        ),
        (
            lambda: C.corrupt_uniform_random(IDS, LM, 0),
            "corrupt_uniform_random: vocab_size must be an integer >= 1, got 0",
        ),
        (
            lambda: C.corrupt_uniform_random(IDS, LM, 50, block_size=0),
            "corrupt_uniform_random: block_size must be an integer >= 1, got 0",
        ),
        (lambda: scdd_grid_times(2, 0, 1e-3), "scdd_grid_times: num_timesteps must be an integer >= 2, got 0"),
        (lambda: scdd_grid_times(2, 1, 1e-3), "scdd_grid_times: num_timesteps must be an integer >= 2, got 1"),
        (
            lambda: scdd_grid_times(2, 10, 1.5),
            "scdd_grid_times: eps (the minimum noise level) must be in [0, 1), got 1.5",
        ),
        (lambda: scdd_grid_times(-1, 10, 0.0), "scdd_grid_times: batch must be an integer >= 0, got -1"),
        (
            lambda: C.corrupt_mix(IDS, LM, 1, 2, mask_prob=torch.zeros(2), uniform_prob=torch.zeros(2)),
            "corrupt_mix: vocab_size must be an integer >= 3, got 2",
        ),
        (
            lambda: _build_target_layer_ids(2.5, 1),
            "_build_target_layer_ids: num_target_layers must be an integer >= 1, got 2.5",
        ),
        (
            lambda: _build_target_layer_ids(12, 0),
            "_build_target_layer_ids: num_draft_layers must be an integer >= 1, got 0",
        ),
        (
            lambda: _build_target_layer_ids(12, 2.0),
            "_build_target_layer_ids: num_draft_layers must be an integer >= 1, got 2.0",
        ),
    ],
)
def test_bad_sizes_are_refused_by_name(call, message):
    _refused(call, message)


def test_good_sizes_still_work():
    assert C.corrupt_blockwise(IDS, LM, 11, block_size=3, half_life_ratio=0.5)[0].shape == IDS.shape
    assert C.corrupt_uniform_random(IDS, LM, 1, block_size=8)[0].max() <= 9
    assert scdd_grid_times(3, 2, 0.0).tolist() == [0.5, 0.5, 0.5]
    assert _build_target_layer_ids(12, 1) == [6]


# ---------------------------------------------------------------- 4. generate: context and checkpoint path


def _loaded(context=64):
    """A checkpoint stand-in: one token per whitespace-separated word."""

    def tokenizer(text, add_special_tokens=False):
        return {"input_ids": [7] * len(text.split())}

    return SimpleNamespace(
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context)), tokenizer=tokenizer, mask_id=5
    )


def test_prompt_plus_new_tokens_beyond_the_context_is_refused():
    from tasks.generate import Request, check_request, generate

    request = Request("w " * 34, "llada", SamplerConfig(max_new_tokens=48))
    expected = (
        "--prompt (34 tokens) + --max-new-tokens (48) = 82 positions, more than the model's context of 64; "
        "lower --max-new-tokens to at most 30"
    )
    assert _refused(lambda: check_request(_loaded(), request)) == expected
    assert _refused(lambda: generate(_loaded(), request, "cpu")) == expected  # the library path checks too
    full = Request("w " * 64, "llada", SamplerConfig(max_new_tokens=1))
    _refused(lambda: check_request(_loaded(), full), "--max-new-tokens (1) = 65 positions", "shorten --prompt")
    long = Request("w " * 70, "llada", SamplerConfig(max_new_tokens=1))
    _refused(lambda: check_request(_loaded(), long), "--prompt is 70 tokens, longer than the model's context of 64")
    infill = Request("w " * 50 + "[MASK] end", "llada", SamplerConfig(), infill=True)
    _refused(lambda: check_request(_loaded(), infill), "--prompt is 71 tokens with its [MASK] spans (20 tokens each)")
    assert len(check_request(_loaded(), Request("w " * 34, "llada", SamplerConfig(max_new_tokens=30)))) == 34
    lookup = Request("w " * 4, "llada", SamplerConfig(max_new_tokens=8, lookup_ngram=2))
    _refused(lambda: check_request(_loaded(), lookup), "--lookup-ngram applies to the speculative sampler", "'llada'")
    assert (
        len(check_request(_loaded(), Request("w " * 4, "speculative", SamplerConfig(max_new_tokens=8, lookup_ngram=2))))
        == 4
    )


def test_missing_checkpoint_path_says_it_does_not_exist(tmp_path):
    from tasks.generate import resolve_checkpoint

    missing = tmp_path / "no-such-run"
    with pytest.raises(FileNotFoundError) as err:
        resolve_checkpoint(str(missing), tmp_path)
    assert str(err.value).startswith(f"--checkpoint {missing}: the path does not exist"), str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a dllm-flow checkpoint"):  # exists, but holds no checkpoint
        resolve_checkpoint(str(tmp_path / "empty"), tmp_path)


# ---------------------------------------------------------------- 5. sampler settings name their flag


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"steps": 0}, "steps (--steps) must be at least 1; got 0"),
        ({"max_new_tokens": 0}, "max_new_tokens (--max-new-tokens) must be at least 1; got 0"),
        ({"top_p": 1.5}, "top_p (--top-p) must be in (0, 1] (1: no nucleus cut); got 1.5"),
        ({"top_k": -2}, "top_k (--top-k) must be ≥ 0 (0: all tokens); got -2"),
    ],
)
def test_sampler_settings_name_the_field_and_the_flag(kw, message):
    assert _refused(lambda: SamplerConfig(**kw)) == message


# ---------------------------------------------------------------- 6. a dllm key no strategy reads


def _spec(strategies, dllm):
    return {"pipeline": {"strategies": strategies}, "data": {"seq_len": 64}, "dllm": dllm}


def test_dllm_key_no_strategy_reads_is_an_unknown_key():
    with pytest.raises(ConfigError) as err:
        validate_config(_spec(["mdlm"], {"mode": "scdd"}))
    msg = str(err.value)
    assert msg.startswith("dllm: unknown key dllm.mode: no strategy reads it; the dllm.* keys are "), msg
    assert "num_timesteps" in msg and "block_size" in msg and "strategies that do" not in msg, msg
    with pytest.raises(ConfigError, match=r"dllm\.blok_size \(did you mean dllm\.block_size\?\)"):
        validate_config(_spec(["mdlm"], {"blok_size": 4}))


def test_dllm_key_another_strategy_reads_keeps_naming_that_strategy():
    with pytest.raises(ConfigError) as err:
        validate_config(_spec(["mdlm"], {"num_timesteps": 5}))
    msg = str(err.value)
    assert "dllm: ['num_timesteps'] set but no strategy of this pipeline (['mdlm']) reads it" in msg, msg
    assert "strategies that do: {'num_timesteps': ['scdd']}" in msg, msg


# ---------------------------------------------------------------- 7. a --workdir that is a file


def test_workdir_that_is_a_file_is_named_as_such(tmp_path):
    from tasks.common import check_workdir

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(FileExistsError) as err:
        check_workdir(blocker)
    assert str(err.value) == f"--workdir {blocker} is a file, not a directory; pass --workdir DIR with a directory path"
    with pytest.raises(FileExistsError, match=f"is not writable: {blocker} is a file, not a directory"):
        check_workdir(blocker / "sub")
    assert blocker.read_text() == "x"
    assert check_workdir(tmp_path / "new") == (tmp_path / "new").resolve()


# ---------------------------------------------------------------- 8. pretrain documents with no text


def _data_spec(path: Path, **data):
    from dllm_common.config import validate_config as validate_pipeline

    return validate_pipeline(
        {"data": {"seq_len": 32, "source": "jsonl", "path": str(path), **data}, "tokenizer": {"vocab_size": 300}}
    )


def test_pretrain_documents_with_empty_texts_are_named(tmp_path):
    from tasks.prepare_data import DataError, prepare_data

    empty = tmp_path / "e.jsonl"
    empty.write_text("\n".join(json.dumps({"text": ""}) for _ in range(6)))
    with pytest.raises(DataError) as err:
        prepare_data(_data_spec(empty), str(tmp_path / "w"))
    msg = str(err.value)
    assert msg.startswith(f"data.path {str(empty)!r} (data.source jsonl): the text of every document is empty"), msg
    assert "data.text_field 'text'" in msg and "data.shape" not in msg, msg
    short = tmp_path / "s.jsonl"
    short.write_text("\n".join(json.dumps({"text": "hi"}) for _ in range(6)))
    with pytest.raises(DataError) as err:
        prepare_data(_data_spec(short, val_fraction=0.5), str(tmp_path / "w"))
    msg = str(err.value)
    assert "fewer than one row of data.seq_len (32) tokens" in msg and "data.shape" not in msg, msg
    assert not list((tmp_path / "w").rglob("manifest.json"))  # nothing half-published
