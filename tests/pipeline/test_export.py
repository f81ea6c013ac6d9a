"""`dllm-flow export`: a trained checkpoint becomes a Hugging Face folder that transformers loads as a
backbone and dllm-flow reloads and samples from, with a model card built from its evaluation."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from dllm_common.checkpoint import CorruptCheckpointError, verify_checkpoint, write_checkpoint
from dllm_common.config import flatten
from dllm_common.tracking import default_tracking_uri
from strategies.sampling import SamplerConfig
from tasks.commands.export import export_checkpoint, write_weights
from tasks.commands.generate import Request, check_sampler, generate, resolve_checkpoint
from tasks.commands.model_card import base_model_license
from tasks.evaluation.trained_model import load_for_generation
from tasks.train import model_dir

PROMPT = "To be, or not to be"


@pytest.fixture(scope="module")
def trained(prepared, tiny_spec, tmp_path_factory):
    """mdlm and hybrid trained a few steps and evaluated in one workdir (its store and MLflow database)."""
    from tasks.evaluate import evaluate
    from tasks.train import train

    data, _ = prepared
    workdir = tmp_path_factory.mktemp("export-work")
    spec = tiny_spec.model_copy(
        update={"train": tiny_spec.train.model_copy(update={"steps": 4, "val_every": 4, "checkpoint_every": 4})}
    )
    runs = {}
    for strategy in ("mdlm", "hybrid"):
        ref = train(spec, strategy, data, str(workdir))
        runs[strategy] = (ref, evaluate(spec, strategy, ref, data, str(workdir)))
    return runs, data, workdir


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _generate(ckpt: Path) -> tuple[str, float]:
    loaded = load_for_generation(ckpt, "cpu")
    sampler = check_sampler(loaded.meta["strategy"], "auto", False)
    config = SamplerConfig(steps=4, max_new_tokens=8, block_size=4)
    out = generate(loaded, Request(PROMPT, sampler, config, seed=0), "cpu")
    return out.text, out.nfe


def _hf_load(folder: Path):
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _assert_card_reports(card: str, evaluation, data) -> None:
    metrics = json.loads((Path(evaluation.path) / "metrics.json").read_text())
    assert metrics
    for name, value in metrics.items():
        shown = f"{value:.6g}" if isinstance(value, float) else str(value)
        assert f"| {name} | {shown} |" in card
    assert data.info["digest"] in card  # the full prepared-data digest
    repro = json.loads((Path(evaluation.path) / "repro_card.json").read_text())
    for field in ("checkpoint_digest", "data_key", "sampler.steps", "sampler.block_size", "eval.seed"):
        assert f"| {field} | {flatten(repro)[field]} |" in card
    samples = (Path(evaluation.path) / "samples.txt").read_text().strip()
    assert f"```text\n{samples}\n```" in card


def test_mdlm_export_loads_in_transformers_and_dllm_flow(trained, tmp_path):
    runs, data, workdir = trained
    ref, evaluation = runs["mdlm"]
    out = export_checkpoint(ref.path, tmp_path / "mdlm-export", workdir)
    assert out == tmp_path / "mdlm-export"
    listing = _listing(out)
    print("\nexported folder (mdlm):", *listing, sep="\n  ")
    hf_files = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert hf_files | {"dllm.json", "digests.json", "README.md"} <= set(listing)
    assert not (out / "model").exists()  # one set of files serves both loaders
    verify_checkpoint(out)

    # transformers: the backbone, tensor for tensor the checkpoint's
    src = model_dir(ref)
    hf = _hf_load(out)
    state = hf.state_dict()
    stored = load_file(str(src / "model.safetensors"))
    assert all(torch.equal(state[k], v) for k, v in stored.items())
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.mask_token_id == data.info["mask_token_id"]
    # the card's snippet (an all-visible 4-D mask) is dllm-flow's denoiser forward
    from strategies.models import model_logits
    from tasks.evaluation.trained_model import load_trained_model

    ids = torch.tensor([tok(PROMPT)["input_ids"] + [tok.mask_token_id] * 8])
    visible = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool)
    with torch.no_grad():
        ours = model_logits(load_trained_model(src, "cpu"), {"input_ids": ids})
        assert torch.allclose(hf(input_ids=ids, attention_mask=visible).logits, ours, atol=1e-5)

    # generation settings: the evaluation's sampler, the tokenizer's ids
    gen = GenerationConfig.from_pretrained(out)
    repro = json.loads((Path(evaluation.path) / "repro_card.json").read_text())
    assert (gen.dllm_sampler, gen.dllm_steps, gen.dllm_block_size) == (
        "llada",
        repro["sampler"]["steps"],
        repro["sampler"]["block_size"],
    )
    assert gen.eos_token_id == tok.eos_token_id and gen.mask_token_id == data.info["mask_token_id"]
    assert hf.generation_config.eos_token_id == tok.eos_token_id

    # dllm-flow: `generate --checkpoint OUT` rebuilds the strategy and samples what the source samples
    assert resolve_checkpoint(str(out), tmp_path) == out
    text, nfe = _generate(out)
    assert nfe >= 1 and (text, nfe) == _generate(src)
    meta = json.loads((out / "dllm.json").read_text())
    assert meta["strategy"] == "mdlm" and meta["options"] == ref.info["options"]
    assert meta["export"]["layout"] == "shared"

    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: dllm-flow\n")
    front = card.split("---")[1]
    assert all(f"- {tag}" in front for tag in ("dllm-flow", "diffusion-language-model", "mdlm"))
    _assert_card_reports(card, evaluation, data)
    assert ref.key in card and ref.mlflow_run_id in card and data.key in card
    assert '"lr": 0.003' in card  # the training config slice of the train manifest
    assert "dllm-flow generate --checkpoint mdlm-export" in card and "AutoModelForCausalLM" in card


def test_hybrid_export_splits_backbone_and_dllm_flow_checkpoint(trained, tmp_path):
    runs, data, workdir = trained
    ref, evaluation = runs["hybrid"]
    out = export_checkpoint(str(model_dir(ref)), tmp_path / "hybrid-export", workdir)
    listing = _listing(out)
    print("\nexported folder (hybrid):", *listing, sep="\n  ")
    assert {"config.json", "model.safetensors", "README.md", "generation_config.json", "tokenizer.json"} <= set(listing)
    assert "dllm.json" not in listing and "model/dllm.json" in listing

    stored = load_file(str(model_dir(ref) / "model.safetensors"))
    assert all(k.startswith("lm.") for k in stored)  # the wrapper's layout, which transformers cannot read
    state = _hf_load(out).state_dict()
    assert all(torch.equal(state[k.removeprefix("lm.")], v) for k, v in stored.items())
    assert "dllm_architecture" not in json.loads((out / "config.json").read_text())

    verify_checkpoint(out / "model")
    ckpt = resolve_checkpoint(str(out), tmp_path)
    assert ckpt == out / "model"
    assert _generate(ckpt) == _generate(model_dir(ref))
    card = (out / "README.md").read_text()
    _assert_card_reports(card, evaluation, data)
    assert "`model/` is the dllm-flow checkpoint" in card and "- hybrid" in card.split("---")[1]


def test_registry_export_without_the_store_takes_metrics_from_mlflow(trained, tmp_path):
    runs, data, workdir = trained
    ref, evaluation = runs["mdlm"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = export_checkpoint("models:/t-mdlm@latest", tmp_path / "reg", elsewhere, default_tracking_uri(workdir))
    card = (out / "README.md").read_text()
    assert f"From MLflow run {ref.mlflow_run_id}, artifacts eval/{evaluation.key[:12]}/" in card
    _assert_card_reports(card, evaluation, data)
    assert "the params of MLflow run" in card and "t-mdlm/1" in card
    assert list(elsewhere.iterdir()) == []  # no MLflow database created in the workdir
    assert _generate(out) == _generate(model_dir(ref))


def test_export_without_an_evaluation_says_so(trained, tmp_path):
    runs, _, _ = trained
    ref, _ = runs["mdlm"]
    loose = tmp_path / "loose"
    shutil.copytree(model_dir(ref), loose)  # outside any store, no MLflow database in reach
    empty = tmp_path / "empty"
    empty.mkdir()
    out = export_checkpoint(str(loose), tmp_path / "bare", empty)
    card = (out / "README.md").read_text()
    assert "No evaluation found for this checkpoint: this export carries no metrics." in card
    assert "| metric | value |" not in card and "no MLflow tracking store" in card
    assert GenerationConfig.from_pretrained(out).dllm_settings_from == "sampler defaults"
    _hf_load(out)


def test_export_never_overwrites_a_non_empty_folder(trained, tmp_path):
    runs, _, workdir = trained
    ref, _ = runs["mdlm"]
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists and is not empty; nothing was written"):
        export_checkpoint(ref.path, out, workdir)
    assert _listing(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no temporary folder left behind
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    assert "model.safetensors" in _listing(export_checkpoint(ref.path, empty, workdir))
    # published entries are immutable: no export into one, nor anywhere in the workdir's store
    for target in (Path(ref.path) / "hf", Path(workdir) / "store" / "exports"):
        with pytest.raises(ValueError, match="which is never written to; choose another output directory"):
            export_checkpoint(ref.path, target, workdir)
        assert not target.exists()


def test_a_corrupt_checkpoint_is_refused_and_nothing_is_written(trained, tmp_path):
    runs, _, workdir = trained
    ref, _ = runs["mdlm"]
    bad = tmp_path / "bad"
    shutil.copytree(model_dir(ref), bad)
    weights = bad / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"refusing to export .*model\.safetensors is corrupt"):
        export_checkpoint(str(bad), tmp_path / "new" / "out", workdir)
    assert not (tmp_path / "new").exists()


def test_sharded_export_writes_an_index_transformers_loads(trained, tmp_path):
    runs, _, workdir = trained
    ref, _ = runs["mdlm"]
    out = export_checkpoint(ref.path, tmp_path / "sharded", workdir, max_shard_size=40_000)
    listing = _listing(out)
    shards = [f for f in listing if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) > 1 and all(f"-of-{len(shards):05d}.safetensors" in f for f in shards)
    assert "model.safetensors" not in listing and "model.safetensors.index.json" in listing
    index = json.loads((out / "model.safetensors.index.json").read_text())
    stored = load_file(str(model_dir(ref) / "model.safetensors"))
    assert set(index["weight_map"]) == set(stored) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    state = _hf_load(out).state_dict()
    assert all(torch.equal(state[k], v) for k, v in stored.items())
    # dllm-flow reads one weights file: its checkpoint sits in model/
    assert resolve_checkpoint(str(out), tmp_path) == out / "model"
    assert _generate(out / "model") == _generate(model_dir(ref))


def test_write_weights_keeps_one_file_under_the_limit_and_ties_once(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    tensors = {"model.embed_tokens.weight": w, "lm_head.weight": w, "model.norm.weight": torch.ones(4)}
    assert write_weights(tmp_path, tensors) == ["model.safetensors"]
    assert set(load_file(str(tmp_path / "model.safetensors"))) == {"lm_head.weight", "model.norm.weight"}


def test_unmerged_lora_is_merged_into_the_exported_backbone(prepared, tmp_path):
    from strategies.models import add_lora, build_model, tiny_model_config
    from tasks.prepare_data import load_tokenizer

    data, _ = prepared
    tokenizer = load_tokenizer(f"{data.path}/tokenizer")
    lm = build_model(tiny_model_config("llama", len(tokenizer), 32, 32, 1, 2, None, None, True), 0)
    add_lora(lm, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    meta = {
        "strategy": "mdlm",
        "mask_token_id": tokenizer.mask_token_id,
        "options": {"eps": 0.001, "loss_weighting": "elbo", "mask_token_id": tokenizer.mask_token_id},
        "seq_len": 32,
        "peft": {"r": 4, "alpha": 8, "merged": False},
    }
    ckpt = write_checkpoint(tmp_path / "lora", lm, tokenizer, meta)
    ids = torch.randint(0, len(tokenizer), (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = lm.eval()(input_ids=ids).logits
    out = export_checkpoint(str(ckpt), tmp_path / "merged", tmp_path)
    assert "dllm_lora" not in json.loads((out / "config.json").read_text())
    assert not any("lora_" in k for k in load_file(str(out / "model.safetensors")))
    with torch.no_grad():
        assert torch.allclose(_hf_load(out)(input_ids=ids).logits, expected, atol=1e-5)
    assert json.loads((out / "dllm.json").read_text())["peft"]["merged"] is True
    assert "merged into the weights at export" in (out / "README.md").read_text()
    assert _generate(out) == _generate(ckpt)


def test_the_card_license_is_the_pretrained_base_models(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\ntags:\n- x\n---\n# base\n")
    pretrained = {"model": {"kind": "pretrained", "path": str(tmp_path)}}
    assert base_model_license(pretrained) == "apache-2.0"
    assert (
        base_model_license({"model.kind": "pretrained", "model.path": str(tmp_path)}) == "apache-2.0"
    )  # MLflow params
    assert base_model_license({"model": {"kind": "tiny", "path": None}}) is None
    assert base_model_license({"model": {"kind": "pretrained", "path": "org/hub-id"}}) is None


def test_a_prompt_longer_than_the_models_context_is_refused(trained):
    """One clear error instead of decoding past every position the model was built for."""
    runs, _, _ = trained
    ref, _ = runs["mdlm"]
    loaded = load_for_generation(model_dir(ref), "cpu")
    context = loaded.model.config.max_position_embeddings
    config = SamplerConfig(steps=4, max_new_tokens=8, block_size=4)
    with pytest.raises(ValueError, match=f"longer than the model's context of {context} positions; shorten it"):
        generate(loaded, Request("To be, or not to be " * context, "auto", config, seed=0), "cpu")
