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
from strategies.dflash.blocks import build_target_layer_ids
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
            lambda: build_target_layer_ids(2.5, 1),
            "build_target_layer_ids: num_target_layers must be an integer >= 1, got 2.5",
        ),
        (
            lambda: build_target_layer_ids(12, 0),
            "build_target_layer_ids: num_draft_layers must be an integer >= 1, got 0",
        ),
        (
            lambda: build_target_layer_ids(12, 2.0),
            "build_target_layer_ids: num_draft_layers must be an integer >= 1, got 2.0",
        ),
    ],
)
def test_bad_sizes_are_refused_by_name(call, message):
    _refused(call, message)


def test_good_sizes_still_work():
    assert C.corrupt_blockwise(IDS, LM, 11, block_size=3, half_life_ratio=0.5)[0].shape == IDS.shape
    assert C.corrupt_uniform_random(IDS, LM, 1, block_size=8)[0].max() <= 9
    assert scdd_grid_times(3, 2, 0.0).tolist() == [0.5, 0.5, 0.5]
    assert build_target_layer_ids(12, 1) == [6]


# ---------------------------------------------------------------- 4. generate: context and checkpoint path


def _loaded(context=64):
    """A checkpoint stand-in: one token per whitespace-separated word."""

    def tokenizer(text, add_special_tokens=False):
        return {"input_ids": [7] * len(text.split())}

    return SimpleNamespace(
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context)), tokenizer=tokenizer, mask_id=5
    )


def test_prompt_plus_new_tokens_beyond_the_context_is_refused():
    from tasks.commands.generate import Request, check_request, generate

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
    walk = Request("w " * 4, "llada", SamplerConfig(max_new_tokens=8, temperature=1.0, sampled_proposals="walk"))
    _refused(
        lambda: check_request(_loaded(), walk), "--sampled-proposals applies to the speculative sampler", "'llada'"
    )
    _refused(lambda: SamplerConfig(sampled_proposals="path"), "must be walk or backbone", "'path'")
    tree = Request("w " * 4, "llada", SamplerConfig(max_new_tokens=8, tree_branches=2))
    _refused(lambda: check_request(_loaded(), tree), "--tree-branches applies to the speculative sampler", "'llada'")
    _refused(lambda: SamplerConfig(tree_branches=-1), "tree_branches (--tree-branches) must be ≥ 0", "got -1")
    lone = Request("w " * 4, "speculative", SamplerConfig(max_new_tokens=8), redraft=torch.nn.Linear(1, 1))
    _refused(lambda: check_request(_loaded(), lone), "--redraft re-drafts tree branches", "--tree-branches K")
    assert (
        len(check_request(_loaded(), Request("w " * 4, "speculative", SamplerConfig(max_new_tokens=8, lookup_ngram=2))))
        == 4
    )


def test_eval_samples_beyond_the_context_are_refused_before_training_with_generates_wording(
    prepared, tiny_spec, tmp_path
):
    """The same rule and wording as `generate`'s, on the prompts tokenized as evaluation will (config load already
    refused what the config alone shows); run by the pipeline between prepare_data and the first training."""
    from transformers import LlamaConfig

    from dllm_common.config import ConfigError
    from tasks.evaluate import check_samples_fit
    from tasks.prepare_data import load_tokenizer

    data, _ = prepared
    tokenizer = load_tokenizer(f"{data.path}/tokenizer")
    prompt = tiny_spec.eval.prompts[0]
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert 1 < n < 20 and tiny_spec.data.seq_len == 32

    def spec_with(**changes):
        raw = tiny_spec.model_dump(mode="json")
        for key, value in changes.items():
            section, name = key.split("__")
            raw[section][name] = value
        return validate_config(raw)

    with pytest.raises(ConfigError) as err:
        check_samples_fit(spec_with(eval__sample_length=31), data)  # 1 + 31 fits the config's bound, n + 31 does not
    assert str(err.value) == (
        f"eval.prompts[0] {prompt!r} ({n} tokens) + eval.sample_length (31) = {n + 31} positions, more than the "
        f"model's context (data.seq_len, a tiny model's max_position_embeddings) of 32; lower eval.sample_length to "
        f"at most {32 - n} (evaluate[mdlm]'s samples)"
    )
    check_samples_fit(spec_with(eval__sample_length=32 - n), data)
    # a pretrained model: its own max_position_embeddings, read from its config before any weights
    model_dir = tmp_path / "pretrained"
    LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=24, hidden_size=32, num_attention_heads=2
    ).save_pretrained(model_dir)
    # (rows no longer than its 24 positions: config load refuses a data.seq_len the model does not hold)
    pretrained = spec_with(
        model__kind="pretrained", model__path=str(model_dir), data__seq_len=24, eval__sample_length=31
    )
    context_of = rf"more than the context of model\.path '{model_dir}' \(max_position_embeddings\) of 24"
    with pytest.raises(ConfigError, match=rf"{context_of}; lower eval\.sample_length to at most {24 - n}"):
        check_samples_fit(pretrained, data)
    # DFlash decodes its samples with the target: the embedded one is as long as the rows
    dflash = spec_with(pipeline__strategies=["dflash"], eval__sample_length=31)
    with pytest.raises(
        ConfigError, match=r"more than the embedded target's context \(data\.seq_len\) of 32.*evaluate\[dflash\]"
    ):
        check_samples_fit(dflash, data)


def test_missing_checkpoint_path_says_it_does_not_exist(tmp_path):
    from tasks.commands.generate import resolve_checkpoint

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
    from dllm_common.config import validate_schema as validate_pipeline

    return validate_pipeline(
        {
            "data": {"seq_len": 32, "source": "jsonl", "path": str(path), **data},
            "tokenizer": {"vocab_size": 300},
            "eval": {"sample_length": 8},
        }
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


def test_a_data_path_that_is_a_symlink_loop_or_leads_nowhere_says_so(tmp_path):
    from tasks.prepare_data import DataError, prepare_data

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "gone.jsonl")
    loop = (
        "is a symlink loop (following its links leads back to where they started; `ls -l` on each part of the path "
        "shows where it leads): point it at a .jsonl file"
    )
    for path, message in (
        (tmp_path / "a", f"data.path {str(tmp_path / 'a')!r} {loop}"),
        (tmp_path / "a" / "docs.jsonl", f"data.path {str(tmp_path / 'a' / 'docs.jsonl')!r} {loop}"),
        (
            tmp_path / "dangling.jsonl",
            f"data.path {str(tmp_path / 'dangling.jsonl')!r} is a symlink to {str(tmp_path / 'gone.jsonl')!r}, which "
            "does not exist: point it at a .jsonl file",
        ),
        (
            tmp_path / "none.jsonl",
            f"data.path {str(tmp_path / 'none.jsonl')!r} does not exist (expected a .jsonl file)",
        ),
    ):
        with pytest.raises(DataError) as err:
            prepare_data(_data_spec(path), str(tmp_path / "w"))
        assert str(err.value) == message
    assert not list((tmp_path / "w").rglob("manifest.json"))


# ---------------------------------------------------------------- 9. checkpoints at odds with themselves or their entry


def _checkpoint(prepared, dest: Path, rows: int | None = None):
    """A small mdlm checkpoint with the prepared tokenizer; `rows`: its embedding rows (default: the tokenizer's)."""
    from dllm_common.checkpoint import write_checkpoint
    from strategies.models import build_model, tiny_model_config
    from tasks.prepare_data import load_tokenizer

    data, _ = prepared
    tokenizer = load_tokenizer(f"{data.path}/tokenizer")
    lm = build_model(tiny_model_config("llama", rows or len(tokenizer), 32, 32, 1, 2, None, None, True), 0)
    mask = tokenizer.mask_token_id
    meta = {"strategy": "mdlm", "mask_token_id": mask, "options": {"mask_token_id": mask}, "seq_len": 32}
    return write_checkpoint(dest, lm, tokenizer, meta), tokenizer


def test_a_tokenizer_with_more_tokens_than_the_model_is_refused_at_load(prepared, tmp_path, capsys):
    from dllm_common.checkpoint import CorruptCheckpointError
    from flows.cli import main
    from tasks.commands.export import export_checkpoint
    from tasks.evaluation.trained_model import checkpoint_tokenizer, load_for_generation, load_trained_model

    data, _ = prepared
    n = 320
    ckpt, tokenizer = _checkpoint(prepared, tmp_path / "ckpt", rows=n - 8)
    assert len(tokenizer) == n and tokenizer.mask_token_id < n - 8
    expected = (
        f"checkpoint {ckpt}: its tokenizer has {n} tokens but the model's embedding has {n - 8} rows (config.json "
        f"vocab_size), so ids {n - 8}..{n - 1} have no embedding; the tokenizer files are not the ones this model was "
        "trained with: put those back (in a store entry, `dllm-flow run --verify` rebuilds it)"
    )
    for load in (
        lambda: load_for_generation(ckpt, "cpu"),  # generate, the lm-eval model
        lambda: checkpoint_tokenizer(ckpt, load_trained_model(ckpt, "cpu")),  # the evaluate stage
        lambda: export_checkpoint(str(ckpt), tmp_path / "out", tmp_path),
    ):
        with pytest.raises(CorruptCheckpointError) as err:
            load()
        assert str(err.value) == expected
    assert not (tmp_path / "out").exists()
    # the command, with a prompt holding the last token: `IndexError: index out of range in self` before (exit 1)
    capsys.readouterr()
    prompt = tokenizer.decode([n - 1])
    code = main(["generate", "--checkpoint", str(ckpt), "--prompt", prompt, "--steps", "2", "--max-new-tokens", "4"])
    assert code == 2 and capsys.readouterr().err == f"dllm-flow: error: {expected}\n"


def test_export_of_a_store_entry_checks_it_against_the_entrys_manifest(prepared, tmp_path):
    """Weights and digests.json both edited: the checkpoint agrees with itself, the store's manifest does not."""
    from dllm_common.checkpoint import CorruptCheckpointError, verify_checkpoint
    from dllm_common.store import Store, sha256_file
    from tasks.commands.export import export_checkpoint

    key = "0123456789abcdef01234567"
    with Store(tmp_path / "store").publish("train", key, {"stage": "train"}) as tmp:
        _checkpoint(prepared, tmp / "model")
    entry = tmp_path / "store" / "train" / key
    assert (export_checkpoint(str(entry), tmp_path / "intact", tmp_path) / "model.safetensors").is_file()
    weights, digests = entry / "model" / "model.safetensors", entry / "model" / "digests.json"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    table = json.loads(digests.read_text())
    digests.write_text(json.dumps({**table, "model.safetensors": sha256_file(weights)}, indent=2, sort_keys=True))
    verify_checkpoint(entry / "model")  # its own table agrees: only the manifest beside it can tell
    for ref in (entry, entry / "model"):
        with pytest.raises(CorruptCheckpointError) as err:
            export_checkpoint(str(ref), tmp_path / "out", tmp_path)
        assert str(err.value) == (
            f"refusing to export {ref}: {entry / 'model'} is not what its store entry train/{key} published "
            f"({entry / 'manifest.json'}): model/model.safetensors does not match its sha256; model/digests.json does "
            "not match its sha256. It was changed after it was published, its digests.json too: rerun the pipeline "
            "with `dllm-flow run --verify` (or `dllm-flow resume RUN_ID --verify`) to set the damaged entry aside and "
            "rebuild it"
        )
    assert (
        not (tmp_path / "out").exists() and sha256_file(weights) == json.loads(digests.read_text())["model.safetensors"]
    )


def test_a_dataset_two_concurrent_trainings_log_at_once_is_logged_once_more(tmp_path):
    """Two trainings on two workers log the pipeline's dataset together: the server's unique key refuses the
    second insert (PostgreSQL: UniqueViolation on dataset_pk). The tracker logs it again (the dataset now exists);
    any other error still raises."""
    from dllm_common.tracking import MlflowTracker

    class Client:
        def __init__(self, errors):
            self.errors, self.logged = list(errors), []

        def log_inputs(self, run_id, datasets):
            if self.errors:
                raise RuntimeError(self.errors.pop(0))
            self.logged.append((run_id, datasets[0].dataset.digest))

    raced = Client(['BAD_REQUEST: (psycopg.errors.UniqueViolation) duplicate key value violates "dataset_pk"'])
    MlflowTracker(raced, "r1").log_dataset(tmp_path, "rows", "d" * 40)
    assert raced.logged == [("r1", "d" * 36)]
    other = Client(["RESOURCE_DOES_NOT_EXIST: run r1"])
    with pytest.raises(RuntimeError, match="RESOURCE_DOES_NOT_EXIST"):
        MlflowTracker(other, "r1").log_dataset(tmp_path, "rows", "d" * 40)
    assert other.logged == []
