"""DFlash through the stages: pretrain_target → cache_target → train[dflash] → evaluate, the cache's
key and reuse, the cross-process lock, cached vs online features, and the errors a user can fix."""

import dataclasses
import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from runkit import metric_history
from stagekit import dflash_spec, through_the_stages

from dllm_common.config import ConfigError
from strategies.options import validate_config
from tasks.data.tokenizer import load_tokenizer
from tasks.evaluate import evaluate
from tasks.speculative.cache_target import cache_target
from tasks.speculative.cache_target import stage_of as cache_stage_of
from tasks.speculative.target import target
from tasks.train import model_dir, train


@pytest.fixture(scope="module")
def dflash_run(prepared, tiny_spec, tmp_path_factory):
    """One chain of stages in a fresh workdir (the prepared data is shared with the other tests)."""
    data, _ = prepared
    workdir = str(tmp_path_factory.mktemp("dflash"))
    spec = dflash_spec(tiny_spec)
    tgt = target(spec, data, workdir)
    feats = cache_target(spec, tgt, data, workdir)
    trained = train(spec, "dflash", data, workdir, inputs={"target": tgt, "features": feats})
    return spec, data, workdir, tgt, feats, trained


def _history(workdir, run_id, key):
    return [v for _, v in metric_history(workdir, run_id, key)]


def test_pretrained_target_learns_and_is_a_frozen_causal_lm(dflash_run):
    spec, _, workdir, tgt, _, _ = dflash_run
    assert tgt.stage == "pretrain_target" and tgt.info["num_layers"] == 4 and tgt.info["hidden_size"] == 32
    val = _history(workdir, tgt.mlflow_run_id, "val/loss")
    assert len(val) == 3 and val[-1] < val[0] - 0.5
    from tasks.speculative.setup import load_target

    model = load_target(tgt.info["model_path"])
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_cache_holds_the_selected_layers_of_every_row_and_is_reused(dflash_run, tmp_path):
    spec, data, workdir, tgt, feats, _ = dflash_run
    from safetensors import safe_open

    from strategies.dflash.draft import target_features
    from tasks.rows import load_split
    from tasks.speculative.setup import load_target

    info = feats.info
    assert info["layer_ids"] == [2]  # one draft layer reads the middle of a 4-layer target
    assert info["rows"] == {"train": data.info["train_rows"], "val": data.info["val_rows"]}
    assert info["bytes"] > 0 and info["build_seconds"] > 0 and info["dtype"] == "bf16"
    index = json.loads((Path(feats.path) / "features" / "index.json").read_text())
    with safe_open(str(Path(feats.path) / "features" / index["splits"]["val"][0]["file"]), framework="pt") as f:
        stored = f.get_tensor("features")
    ids = load_split(data.path, "val")[0]
    fresh = target_features(load_target(tgt.info["model_path"]), ids, [2])[0]
    assert stored.dtype == torch.bfloat16 and stored.shape == (len(ids), ids.shape[1], 32)
    torch.testing.assert_close(stored.float(), fresh, atol=0.05, rtol=0.02)  # bf16 rounding
    # a second run, and a draft with other training settings, reuse the same target and cache
    other = spec.model_copy(update={"train": spec.train.model_copy(update={"lr": 1e-3})})
    assert target(other, data, workdir).reused
    again = cache_target(other, tgt, data, workdir)
    assert again.reused and again.key == feats.key
    # the key follows the layers and the dtype
    fp16 = _dflash_spec_from(spec, cache_dtype="fp16")
    assert cache_stage_of(fp16, tgt, data, workdir)[1] != feats.key


def _dflash_spec_from(spec, **dflash):
    raw = spec.model_dump(mode="json")
    raw["dflash"].update(dflash)
    return validate_config(raw)


def test_draft_trains_publishes_a_self_describing_checkpoint_and_evaluates(dflash_run, capsys):
    spec, data, workdir, tgt, _, trained = dflash_run
    val = _history(workdir, trained.mlflow_run_id, "val/loss")
    assert len(val) == 4 and val[-1] < val[0]
    acc = {k: _history(workdir, trained.mlflow_run_id, f"train/draft_acc{k}") for k in ("", "_k1", "_k2", "_k3")}
    assert all(len(v) == spec.train.steps and all(0 <= x <= 1 for x in v) for v in acc.values())
    ckpt = model_dir(trained)
    meta = json.loads((ckpt / "dllm.json").read_text())
    assert meta["target"]["path"] == tgt.info["model_path"] and meta["options"]["block_size"] == 4
    from dllm_common.checkpoint import load_weights_into
    from strategies.dflash.draft import DFlashDraftModel
    from strategies.models import model_from_config_dir

    draft = model_from_config_dir(ckpt)
    load_weights_into(draft, ckpt)  # digests verified, strict
    assert isinstance(draft, DFlashDraftModel) and not hasattr(draft, "embed_tokens")
    ev = evaluate(spec, "dflash", trained, data, workdir)
    m = ev.info["metrics"]
    assert m["dflash/exact_match"] == 1.0  # speculative output == target-only greedy, every prompt
    assert 1.0 <= m["dflash/tau"] <= 4.0 and 1.0 <= m["dflash/tau_sim"] <= 4.0
    assert {f"dflash/acc_k{k}" for k in (1, 2, 3)} <= set(m) and m["dflash/speedup"] > 0
    assert m["eval/ar_nll"] > 0 and m["eval/tokens_per_forward"] >= 1.0
    # `dllm-flow generate` rebuilds draft + target from the checkpoint: the text is the target's greedy text
    from strategies.dflash.decoding import greedy_generate
    from strategies.sampling import SamplerConfig
    from tasks.commands.generate import Request, check_sampler, generate
    from tasks.evaluation.trained_model import load_for_generation

    loaded = load_for_generation(ckpt, "cpu")
    model, tok, strat, mask, _ = loaded
    out = generate(loaded, Request("O", check_sampler("dflash", "auto", False), SamplerConfig(max_new_tokens=8)), "cpu")
    prompt = tok("O", add_special_tokens=False)["input_ids"]
    assert out.text == tok.decode(greedy_generate(strat.target, prompt, 8, tok.eos_token_id)) and out.nfe >= 1
    with pytest.raises(ValueError, match="does not fit a dflash checkpoint"):
        check_sampler("dflash", "llada", False)
    # the CLI verifying two tree branches re-drafted by a second draft (the same checkpoint): the same greedy text
    from flows.cli import main

    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(ckpt), "--prompt", "O", "--max-new-tokens", "8", "--workdir", workdir]
    assert main([*argv, "--tree-branches", "2", "--redraft", str(ckpt)]) == 0
    shown = capsys.readouterr()
    assert f"[Prompt 0] O\n{out.text}\n" in shown.out and "tree-branches 2" in shown.err
    assert "trained with dflash.loss_type decay, not variable_prefix" in shown.err  # a plain draft: warned
    assert main([*argv, "--redraft", str(ckpt)]) != 0  # no branches to re-draft: refused before loading
    assert "--redraft re-drafts tree branches: give --tree-branches K" in capsys.readouterr().err
    assert main([*argv, "--tree-branches", "2", "--redraft", str(Path(workdir) / "nowhere")]) != 0
    assert "--redraft " in (err := capsys.readouterr().err) and "the path does not exist" in err
    bench = json.loads((Path(ev.path) / "speculative.json").read_text())
    assert sum(int(k) * v for k, v in bench["histogram"].items()) / sum(bench["histogram"].values()) == pytest.approx(
        m["dflash/tau"]
    )


def test_the_draft_goes_through_the_stages_every_strategy_goes_through(dflash_run):
    """The stage test's train → evaluate → report → generate (tests/stagekit.py), with the target and its
    feature cache that the draft declares built first (the fixture)."""
    spec, data, workdir, tgt, feats, _ = dflash_run
    inputs = {"target": tgt, "features": feats}
    staged = through_the_stages(spec, "dflash", data, workdir, inputs, val_drop=0.0)
    assert staged.trained.reused and "## Speculative decoding (DFlash)" in staged.report


def test_a_copy_hint_draft_trains_evaluates_and_keeps_its_setting(dflash_run):
    """`dflash.copy_hint`: the draft is built with the hint input, trains, records it in its checkpoint and
    decodes to the target's greedy text; continuing that checkpoint without the hint is refused by name."""
    spec, data, workdir, tgt, feats, _ = dflash_run
    hinted = _dflash_spec_from(spec, copy_hint=True)
    trained = train(hinted, "dflash", data, workdir, inputs={"target": tgt, "features": feats})
    config = json.loads((model_dir(trained) / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dllm_copy_hint"] is True
    m = evaluate(hinted, "dflash", trained, data, workdir).info["metrics"]
    assert m["dflash/exact_match"] == 1.0 and 1.0 <= m["dflash/tau"] <= 4.0
    raw = spec.model_dump(mode="json")
    raw["model"] = {**raw["model"], "kind": "pretrained", "path": str(model_dir(trained))}
    with pytest.raises(ValueError, match="dflash.copy_hint is false but the draft checkpoint"):
        train(validate_config(raw), "dflash", data, workdir, inputs={"target": tgt, "features": feats})


def test_cached_and_online_features_train_the_same_draft(prepared, tiny_spec, tmp_path):
    """fp32 cache vs a target forward every step: the same loss curve and the same weights."""
    data, _ = prepared
    spec = dflash_spec(tiny_spec, cache_dtype="fp32")
    spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": 6, "val_every": 3})})
    wd = str(tmp_path)
    tgt = target(spec, data, wd)
    cached = train(spec, "dflash", data, wd, inputs={"target": tgt, "features": cache_target(spec, tgt, data, wd)})
    online_spec = _dflash_spec_from(spec, target_features="online")
    online = train(online_spec, "dflash", data, wd, inputs={"target": tgt})
    assert cached.key != online.key
    a, b = (_history(wd, r.mlflow_run_id, "train/loss") for r in (cached, online))
    assert len(a) == 6 and a == pytest.approx(b, rel=1e-5, abs=1e-6)


def _build_cache(args):
    spec_json, data, workdir, tgt = args
    from strategies.options import validate_config as _v
    from tasks.common import StageRef
    from tasks.speculative.cache_target import cache_target as _c

    ref = _c(_v(spec_json), StageRef(**tgt), StageRef(**data), workdir)
    return ref.reused


def test_two_workers_never_build_the_same_cache(dflash_run, tmp_path):
    """Two processes ask for the same cache at once: the lock lets one build it, the other reuses it."""
    spec, data, workdir, tgt, _, _ = dflash_run
    other = _dflash_spec_from(spec, cache_dtype="fp16")  # a key nobody built yet
    args = (other.model_dump(mode="json"), dataclasses.asdict(data), workdir, dataclasses.asdict(tgt))
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        reused = pool.map_async(_build_cache, [args, args]).get(timeout=600)  # a worker that dies never hangs the suite
    assert sorted(reused) == [False, True]
    stage, key = cache_stage_of(other, tgt, data, workdir)
    assert len(list((Path(workdir) / "store" / stage).glob(f"{key}*"))) == 2  # the entry and its lock file only


def test_errors_name_what_to_change(dflash_run, tiny_spec):
    spec, data, workdir, tgt, feats, _ = dflash_run
    with pytest.raises(ConfigError, match="dflash.block_size must be at least 2"):
        dflash_spec(tiny_spec, block_size=1)
    with pytest.raises(ConfigError, match="target_features"):
        dflash_spec(tiny_spec, target_features="disk")
    with pytest.raises(ValueError, match="needs its target stage"):
        train(spec, "dflash", data, workdir)
    wide = validate_config(
        {**spec.model_dump(mode="json"), "model": {**spec.model.model_dump(mode="json"), "hidden_size": 64}}
    )
    with pytest.raises(ValueError, match=r"model.hidden_size \(64\) must equal the target's hidden size \(32\)"):
        train(wide, "dflash", data, workdir, inputs={"target": tgt, "features": feats})
    with pytest.raises(ValueError, match="flex_attention' trains on CUDA only"):
        train(
            _dflash_spec_from(spec, attention_backend="flex_attention"),
            "dflash",
            data,
            workdir,
            inputs={"target": tgt, "features": feats},
        )
    # a layer past the embedded target's: refused at config load now, naming the key (issue 52)
    with pytest.raises(
        ValueError, match=r"dflash\.target_layer_ids \[7\]: \[7\] are not target layers; give layer ids in 0 … 3"
    ):
        cache_target(_dflash_spec_from(spec, target_layer_ids=[7]), tgt, data, workdir)
    with pytest.raises(FileNotFoundError, match="not a local directory and not in the Hugging Face cache"):
        target(_dflash_spec_from(spec, target_model_id="nobody/no-such-model"), data, workdir)


@pytest.mark.slow
def test_the_draft_trains_the_same_sharded_by_fsdp2_on_two_processes(prepared, tiny_spec, tmp_path):
    """FSDP2 over the draft (tasks/training/distributed.py shards each of its `layers`, then the whole draft; gloo, 2
    CPU processes): the same training losses and published weights as one process."""
    from test_distributed import _spec as layout
    from test_distributed import compare_published

    data, _ = prepared
    raw = dflash_spec(tiny_spec, target_layer_ids=[1, 2]).model_dump(mode="json")
    raw["model"].update(num_layers=2, num_heads=4, num_kv_heads=2)
    base = validate_config(raw)
    shared = str(tmp_path / "shared")
    tgt = target(base, data, shared)
    inputs = {"target": tgt, "features": cache_target(base, tgt, data, shared)}
    runs = {}
    for nproc, parallel in ((1, "ddp"), (2, "fsdp2")):
        spec = base.model_copy(update={"train": layout(base, nproc, parallel).train})
        runs[nproc] = train(spec, "dflash", data, str(tmp_path / str(nproc)), inputs=inputs)
    a = metric_history(tmp_path / "1", runs[1].mlflow_run_id, "train/loss")
    b = metric_history(tmp_path / "2", runs[2].mlflow_run_id, "train/loss")
    assert [s for s, _ in a] == [s for s, _ in b] and len(a) == 6
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-5
    weights = compare_published(runs[1], runs[2])
    print(f"\n[measured] dflash draft, FSDP2 on 2 processes: max |1 proc − fsdp2| of the weights = {weights:.2e}")
    assert weights < 1e-4


@pytest.mark.slow
def test_dflash_pipeline_runs_and_a_second_draft_reuses_target_and_cache(tmp_path, prefect_api):
    """`dllm-flow run configs/dflash.yaml` (shrunk): pretrain_target → regenerate → cache_target → train →
    evaluate → report; a rerun with another draft learning rate reuses the target, its text and the cache."""
    from runkit import cli

    shrink = [
        "--set",
        "data.max_documents=4",
        "--set",
        "data.max_train_rows=128",
        "--set",
        "data.max_val_rows=16",
        "--set",
        "data.seq_len=32",
        "--set",
        "tokenizer.vocab_size=320",
        "--set",
        "model.hidden_size=32",
        "--set",
        "model.num_heads=2",
        "--set",
        "dflash.pretrain.num_heads=2",
        "--set",
        "dflash.pretrain.num_layers=2",
        "--set",
        "dflash.pretrain.steps=10",
        "--set",
        "dflash.pretrain.warmup_steps=2",
        "--set",
        "train.steps=4",
        "--set",
        "train.warmup_steps=2",
        "--set",
        "train.global_batch_size=8",
        "--set",
        "train.micro_batch_size=8",
        "--set",
        "train.val_every=2",
        "--set",
        "train.val_rows=8",
        "--set",
        "eval.val_rows=8",
        "--set",
        "eval.num_samples=1",
        "--set",
        "eval.sample_length=4",
        "--set",
        "dflash.eval_prompts=2",
        "--set",
        "dflash.eval_prompt_len=4",
        "--set",
        "dflash.eval_max_new_tokens=4",
    ]

    def run(*extra):
        out = cli("run", "configs/dflash.yaml", *shrink, *extra, workdir=tmp_path, api=prefect_api)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        record = json.loads(sorted((tmp_path / "runs").glob("*.json"))[-1].read_text())
        return {s["name"]: s["status"] for s in record["stages"]}

    assert run() == {
        "prepare_data": "COMPLETED",
        "pretrain_target": "COMPLETED",
        "regenerate": "COMPLETED",
        "cache_target": "COMPLETED",
        "train[dflash]": "COMPLETED",
        "evaluate[dflash]": "COMPLETED",
        "report": "COMPLETED",
    }
    report = (tmp_path / "report.md").read_text()
    assert "## Speculative decoding (DFlash)" in report and "| dflash |" in report
    assert run("--set", "train.lr=1.0e-3") == {
        "prepare_data": "REUSED",
        "pretrain_target": "REUSED",
        "regenerate": "REUSED",
        "cache_target": "REUSED",
        "train[dflash]": "COMPLETED",
        "evaluate[dflash]": "COMPLETED",
        "report": "COMPLETED",
    }


def test_a_local_target_is_keyed_by_the_digest_of_its_weights(prepared, tiny_spec, tmp_path):
    from strategies.models import build_model, tiny_model_config
    from tasks.prepare_data import load_tokenizer
    from tasks.speculative.target import stage_of as target_stage_of

    data, _ = prepared
    vocab = len(load_tokenizer(f"{data.path}/tokenizer"))
    local = tmp_path / "my-target"
    build_model(tiny_model_config("qwen3", vocab, 32, 32, 4, 2, None, None, False), 0).save_pretrained(local)
    spec = dflash_spec(tiny_spec, target_model_id=str(local))
    wd = str(tmp_path / "w")
    ref = target(spec, data, wd)
    assert ref.stage == "target" and ref.info["model_path"] == str(local.resolve()) and ref.info["num_layers"] == 4
    feats = cache_target(spec, ref, data, wd)
    assert feats.info["layer_ids"] == [2] and target(spec, data, wd).reused
    build_model(tiny_model_config("qwen3", vocab, 32, 32, 4, 2, None, None, False), 1).save_pretrained(local)
    assert target_stage_of(spec, data, wd)[1] != ref.key  # new weights: a new target entry, hence a new cache


def test_regenerated_rows_are_the_targets_own_text_and_reproduce(dflash_run, tmp_path):
    """dflash.regenerate: prompts kept, continuations sampled by the target (greedy at T=0, seeded at
    T>0), only the continuation supervised, validation untouched; the draft trains on it."""
    from strategies.dflash.decoding import greedy_generate
    from tasks.rows import load_split
    from tasks.speculative.regenerate import regenerate
    from tasks.speculative.setup import load_target

    spec, data, workdir, tgt, _, _ = dflash_run
    greedy = _dflash_spec_from(spec, regenerate={"prompt_len": 8, "temperature": 0.0, "max_rows": 16})
    ref = regenerate(greedy, tgt, data, workdir)
    ids, loss, attn = load_split(ref.path, "train")
    orig = load_split(data.path, "train")[0]
    assert ids.shape == (16, orig.shape[1]) and torch.equal(ids[:, :8], orig[:16, :8])
    assert (
        loss[:, :8].sum() == 0 and loss[:, 8:].all() and ref.info["train_supervised_tokens"] == 16 * (ids.shape[1] - 8)
    )
    row0 = greedy_generate(load_target(tgt.info["model_path"]), orig[0, :8].tolist(), ids.shape[1] - 8)
    assert ids[0, 8:].tolist() == row0
    copied = sorted(p.name for p in Path(data.path).glob("val.*") if not p.name.startswith("val.doc_starts."))
    assert sorted(p.name for p in Path(ref.path).glob("val.*")) == copied  # regenerated rows have no documents
    torch.testing.assert_close(load_split(ref.path, "val")[0], load_split(data.path, "val")[0])
    sampled = _dflash_spec_from(spec, regenerate={"prompt_len": 8, "temperature": 1.0, "max_rows": 16})
    a = regenerate(sampled, tgt, data, workdir)
    b = regenerate(sampled, tgt, data, str(tmp_path))  # fresh store, same key: same rows
    assert a.key == b.key and torch.equal(load_split(a.path, "train")[0], load_split(b.path, "train")[0])
    assert not torch.equal(load_split(a.path, "train")[0], ids)
    feats = cache_target(sampled, tgt, a, workdir)
    assert feats.info["rows"]["train"] == 16
    short = sampled.model_copy(update={"train": sampled.train.model_copy(update={"steps": 2, "val_every": 2})})
    trained = train(short, "dflash", a, workdir, inputs={"target": tgt, "features": feats})
    assert json.loads((model_dir(trained) / "dllm.json").read_text())["step"] == 2


def test_chat_regeneration_renders_each_prompt_as_a_user_turn_and_supervises_the_reply(dflash_run, tmp_path):
    """dflash.regenerate.chat: a row is the prompt rendered as one user turn through the chat template (as served
    prompts are rendered) and the target's greedy reply through its end of turn; only the reply is supervised, what
    follows the end of turn is padding; the draft's checkpoint records that it trained on chat rows."""
    from strategies.dflash.decoding import greedy_generate
    from strategies.dflash.served_checks import chat_prompt
    from tasks.rows import load_split
    from tasks.speculative.regenerate import _sample_chat, regenerate
    from tasks.speculative.setup import load_target

    spec, data, workdir, tgt, _, _ = dflash_run
    chat = _dflash_spec_from(spec, regenerate={"prompt_len": 6, "temperature": 0.0, "max_rows": 8, "chat": True})
    assert chat.chat_rows and not spec.chat_rows
    ref = regenerate(chat, tgt, data, workdir)
    assert ref.info["chat"] is True
    ids, loss, attn = load_split(ref.path, "train")
    orig = load_split(data.path, "train")[0]
    tok = load_tokenizer(f"{data.path}/tokenizer")
    model, eos = load_target(tgt.info["model_path"]), tok.eos_token_id
    for r in range(8):
        prompt = chat_prompt(tok, tok.decode(orig[r, :6].tolist(), skip_special_tokens=True))
        reply = greedy_generate(model, prompt, ids.shape[1] - len(prompt))
        if eos in reply:
            reply = reply[: reply.index(eos) + 1]
        stop = len(prompt) + len(reply)
        assert ids[r, :stop].tolist() == prompt + reply
        assert loss[r, : len(prompt)].sum() == 0 and loss[r, len(prompt) : stop].all() and loss[r, stop:].sum() == 0
        assert attn[r, :stop].all() and attn[r, stop:].sum() == 0
    feats = cache_target(chat, tgt, ref, workdir)
    short = chat.model_copy(update={"train": chat.train.model_copy(update={"steps": 2, "val_every": 2})})
    trained = train(short, "dflash", ref, workdir, inputs={"target": tgt, "features": feats})
    assert json.loads((model_dir(trained) / "dllm.json").read_text())["chat"] is True
    rows = torch.arange(1)
    tight = len(chat_prompt(tok, tok.decode(orig[0, :6].tolist(), skip_special_tokens=True))) + 1
    with pytest.raises(ValueError, match="renders to .* tokens through the chat template.*raise data.seq_len"):
        _sample_chat(chat, tgt, tok, orig[:, :tight], rows)  # no room for a reply of 2 tokens or more
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*tokenizer.path the target's folder"):
        _sample_chat(chat, tgt, tok, orig, rows)


def test_a_dspark_draft_trains_with_a_tau_curve_evaluates_its_confidence_and_generates(dflash_run, capsys):
    """`dflash.draft_variant: dspark` through the stages: `dflash.eval_every` logs τ beside the loss at the steps it
    names (and the last); the checkpoint names DSpark with its heads; the evaluation reports the confidence head's
    calibration and the θ curve, every θ keeping the target's greedy text; `dllm-flow generate --confidence-threshold`
    decodes the same text, and refuses the flag for a plain DFlash draft."""
    spec, data, workdir, tgt, feats, plain = dflash_run
    steps = spec.train.steps
    dspark = _dflash_spec_from(
        spec,
        draft_variant="dspark",
        dspark_markov_rank=8,
        eval_every=max(steps // 3, 1),
        eval_every_prompts=2,
        eval_confidence_thresholds=[0.3, 0.7],
    )
    trained = train(dspark, "dflash", data, workdir, inputs={"target": tgt, "features": feats})
    curve = metric_history(workdir, trained.mlflow_run_id, "dflash/train_tau")
    every = max(steps // 3, 1)
    due = sorted({s for s in range(steps) if (s + 1) % every == 0} | {steps - 1})
    assert [s for s, _ in curve] == due and all(1.0 <= v <= 4.0 for _, v in curve)
    config = json.loads((model_dir(trained) / "config.json").read_text())
    assert config["architectures"] == ["DSparkSpeculator"] and config["dflash_config"]["markov_rank"] == 8
    ev = evaluate(dspark, "dflash", trained, data, workdir)
    m = ev.info["metrics"]
    assert m["dflash/exact_match"] == 1.0 and m["dflash/served_skipped"] == 5
    assert 0.0 <= m["dflash/confidence_ece"] <= 1.0 and m["dflash/confidence_judged"] > 0
    for theta in ("0.3", "0.7"):
        assert m[f"dflash/theta{theta}_exact_match"] == 1.0
        assert m[f"dflash/theta{theta}_verified_per_token"] <= 4.0
    bench = json.loads((Path(ev.path) / "speculative.json").read_text())
    rows = bench["confidence"]["rows"]
    assert [(r["rule"], r["theta"]) for r in rows] == [
        ("whole", 0.0),
        ("product", 0.3),
        ("product", 0.7),
        ("position", 0.3),
        ("position", 0.7),
    ]
    assert rows[0]["verified_ratio"] == 1.0 and all(r["exact_match"] == 1.0 for r in rows)
    from flows.cli import main

    capsys.readouterr()
    argv = ["generate", "--prompt", "O", "--max-new-tokens", "8", "--workdir", workdir]
    assert main([*argv, "--checkpoint", str(model_dir(trained))]) == 0
    whole = capsys.readouterr().out
    assert main([*argv, "--checkpoint", str(model_dir(trained)), "--confidence-threshold", "0.5"]) == 0
    cut = capsys.readouterr()
    assert cut.out == whole and "confidence-threshold 0.5, confidence-rule product" in cut.err
    rule = ["--confidence-threshold", "0.5", "--confidence-rule", "position"]
    assert main([*argv, "--checkpoint", str(model_dir(trained)), *rule]) == 0
    assert capsys.readouterr().out == whole
    assert main([*argv, "--checkpoint", str(model_dir(plain)), "--confidence-threshold", "0.5"]) != 0
    assert "a confidence threshold cuts a block by a DSpark draft's confidence head" in capsys.readouterr().err
    # `dllm-flow export`: the speculators layout speculators' DSpark reads, which imports back as the same draft
    from strategies.dflash.config import read_draft_config
    from strategies.dflash.draft import DFlashDraftModel
    from tasks.commands.export import export_checkpoint

    folder = export_checkpoint(str(model_dir(trained)), Path(workdir) / "dspark-export", workdir, fmt="speculators")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["sample_from_anchor"] is False
    # (a speculators config does not record the target's layer count)
    recorded = read_draft_config(model_dir(trained)).config
    assert read_draft_config(folder).config == dataclasses.replace(recorded, num_target_layers=None)
    ours, back = DFlashDraftModel.load(model_dir(trained)).state_dict(), DFlashDraftModel.load(folder).state_dict()
    assert ours.keys() == back.keys() and all(torch.equal(ours[k], back[k]) for k in ours)
    assert "speculators' own `DSparkDraftModel` loads it" in (folder / "README.md").read_text()
