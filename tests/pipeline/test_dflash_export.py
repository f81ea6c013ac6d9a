"""DFlash drafts in the layouts serving engines load (docs/strategies.md §10.10): a draft trained through the
stages is exported as the z-lab / SpecForge folder and as the speculators folder; speculators' own
`DFlashDraftModel` (an implementation that is not dllm-flow's) loads both and computes the same block hidden
states and logits for the same target features, positions and document mask (so it does for a random draft
shaped unlike the defaults); the folders import back (evaluated
with `train.steps: 0`, or trained on) and export again to the same bytes; a copy-hint draft is refused by name;
an imported draft is checked against its target."""

import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from stagekit import dflash_spec

from dllm_common.checkpoint import write_checkpoint
from strategies.dflash.config import (
    DFlashDraftConfig,
    default_layer_ids,
    draft_keys,
    parse_draft_config,
    read_draft_config,
)
from strategies.dflash.decoding import greedy_generate
from strategies.dflash.draft import DFlashDraftModel, draft_block_hidden, target_features
from strategies.dflash.serving_layout import write_serving_layout
from strategies.options import validate_config
from tasks.commands.export import export_checkpoint
from tasks.evaluate import evaluate
from tasks.speculative.export import FORMATS
from tasks.speculative.setup import check_draft_fits_target, draft_source, load_target
from tasks.speculative.target import target as target_stage
from tasks.train import model_dir, train

BLOCK = 4
# what says where a folder came from (lineage: stage keys, run ids, the evaluation its sampler settings came from)
RECORDS = {"dllm.json", "digests.json", "README.md", "generation_config.json"}


def _spec(tiny_spec, **changes):
    """A 2-layer GQA draft (4 query heads, 2 key/value heads) reading target layers 1 and 2, online features."""
    raw = dflash_spec(tiny_spec, target_layer_ids=[1, 2], target_features="online").model_dump(mode="json")
    raw["model"].update(num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48)
    raw["train"].update(steps=6, val_every=3)
    for key, value in changes.items():
        section, name = key.split("__")
        raw[section][name] = value
    return validate_config(raw)


def _imported(spec, folder, steps=0, **dflash):
    """`spec` continuing the draft at `folder` (`model.kind: pretrained`); `steps` 0: published as it is."""
    raw = spec.model_dump(mode="json")
    raw["model"].update(kind="pretrained", path=str(folder))
    raw["train"].update(steps=steps, val_every=max(steps, 1))
    raw["dflash"] = {**{k: v for k, v in raw["dflash"].items() if k != "target_layer_ids"}, **dflash}
    return validate_config(raw)


@pytest.fixture(scope="module")
def exported(prepared, tiny_spec, tmp_path_factory):
    """Target → train[dflash] (6 steps) → evaluate, and the checkpoint exported in both serving layouts."""
    data, _ = prepared
    workdir = tmp_path_factory.mktemp("dflash-export")
    spec = _spec(tiny_spec)
    tgt = target_stage(spec, data, str(workdir))
    trained = train(spec, "dflash", data, str(workdir), inputs={"target": tgt})
    metrics = evaluate(spec, "dflash", trained, data, str(workdir)).info["metrics"]
    ckpt = model_dir(trained)
    folders = {fmt: export_checkpoint(str(ckpt), workdir / fmt, workdir, fmt=fmt) for fmt in ("zlab", "speculators")}
    return spec, data, str(workdir), tgt, ckpt, metrics, folders


def test_the_export_is_the_engines_layout(exported):
    """config.json carries the z-lab fields (or speculators'), the weights exactly the engines' names, the card
    the target, layer ids, mask token and the serve commands with the right draft-token counts."""
    spec, _, _, tgt, ckpt, _, folders = exported
    zlab = json.loads((folders["zlab"] / "config.json").read_text())
    print("\nexported config.json (zlab):\n" + (folders["zlab"] / "config.json").read_text())
    print("files:", *sorted(p.name for p in folders["zlab"].iterdir()), sep="\n  ")
    assert zlab["architectures"] == ["DFlashDraftModel"] and zlab["model_type"] == "qwen3"
    assert zlab["block_size"] == BLOCK and zlab["num_target_layers"] == 4 and zlab["hidden_size"] == 32
    mask = json.loads((ckpt / "dllm.json").read_text())["mask_token_id"]
    assert zlab["dflash_config"] == {"mask_token_id": mask, "target_layer_ids": [1, 2]}
    assert (zlab["num_attention_heads"], zlab["num_key_value_heads"], zlab["head_dim"]) == (4, 2, 8)
    assert zlab["layer_types"] == ["full_attention"] * 2 and "dllm_copy_hint" not in zlab
    assert (folders["zlab"] / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()  # as trained
    cfg = read_draft_config(folders["zlab"]).config
    from safetensors import safe_open

    for folder in folders.values():
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            assert sorted(f.keys()) == draft_keys(cfg) and f.metadata() == {"format": "pt"}
            assert not any(k.startswith("model.") for k in f.keys())
    specs = json.loads((folders["speculators"] / "config.json").read_text())
    assert specs["speculators_model_type"] == "dflash" and specs["aux_hidden_state_layer_ids"] == [2, 3]
    assert specs["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    assert specs["speculators_config"]["verifier"]["name_or_path"] == tgt.info["model_path"]
    assert specs["sliding_window_non_causal"] is True and specs["draft_vocab_size"] == zlab["vocab_size"]
    unknown = replace(cfg, num_target_layers=None)  # a speculators config does not record the target's layer count
    assert read_draft_config(folders["speculators"]) == (unknown, "speculators", tgt.info["model_path"])
    card = (folders["zlab"] / "README.md").read_text()
    for text in (
        tgt.info["model_path"],
        "| target layer ids (0-based; hidden_states[id + 1]) | [1, 2] |",
        f"| mask token id | {cfg.mask_token_id} |",
        "--speculative-algorithm DFLASH",
        f"--speculative-draft-model-path zlab --speculative-num-draft-tokens {BLOCK}",
        f'"num_speculative_tokens": {BLOCK - 1}',
    ):
        assert text in card, text
    assert "vllm serve speculators  #" in (folders["speculators"] / "README.md").read_text()


# speculators (and hs-connectors) need Python 3.11+; the Makefile installs them only there
NEEDS_SPECULATORS = pytest.mark.skipif(sys.version_info < (3, 11), reason="the speculators package needs Python 3.11+")


def _speculators_model(folder: Path, layout: str, target_dir: str, scratch: Path, monkeypatch):
    """speculators' DFlashDraftModel from an exported folder, offline, eager attention on CPU."""
    from speculators.models.attention import create_float_mask
    from speculators.models.dflash import DFlashDraftModel as SpeculatorsDFlash
    from speculators.models.dflash import DFlashSpeculatorConfig

    if layout == "zlab":  # converted on load into a temporary folder: keep it inside the test's
        monkeypatch.setattr(tempfile, "tempdir", str(scratch))
        model = SpeculatorsDFlash.from_pretrained(str(folder), verifier=target_dir)
    else:
        config = DFlashSpeculatorConfig.from_pretrained(str(folder))
        config.transformer_layer_config._attn_implementation = "eager"
        config.speculators_config.verifier.name_or_path = target_dir  # the verifier the export named, given here
        model = SpeculatorsDFlash.from_pretrained(str(folder), config=config)
    model.config.transformer_layer_config._attn_implementation = "eager"  # its default flex needs torch.compile
    model._attn_impl = "eager"
    model._create_mask_fn = lambda *a, **kw: create_float_mask(*a, **kw, dtype=torch.float32)
    return model.eval()


def _both_sides(draft, target, folders, verifier: Path, scratch: Path, monkeypatch, ids, docs, anchors) -> dict:
    """max |Δ hidden| and max |Δ logits| between dllm-flow's `draft` and speculators' model of each folder, for
    the blocks at `anchors` of row `ids` [1, L] with documents `docs` (the target's features and head)."""
    cfg, length = draft.config, ids.shape[1]
    block = torch.full((1, anchors.shape[1] * cfg.block_size), cfg.mask_token_id)
    block[0, :: cfg.block_size] = ids[0, anchors[0]]
    with torch.no_grad():
        feats, _, _ = target_features(target, ids, cfg.target_layer_ids)
        states = target(ids, output_hidden_states=True).hidden_states
        keep = torch.ones_like(anchors, dtype=torch.bool)
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        ours = draft_block_hidden(draft, cfg.block_size, embed, feats, anchors, keep, block, document_ids=docs)
        crossing = draft_block_hidden(draft, cfg.block_size, embed, feats, anchors, keep, block)
    assert (crossing - ours).abs().max() > 1e-3  # the documents matter here: a missing document mask would show
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, anchors[0]] = 1  # exactly these anchors (speculators draws all of them, then sorts)
    found = {}
    for layout, folder in folders.items():
        model = _speculators_model(folder, layout, str(verifier), scratch, monkeypatch)
        with torch.no_grad():
            hidden, logits, *_ = model._backbone_forward(
                hidden_states=feats,
                input_ids=ids,
                loss_mask=loss_mask,
                verifier_last_hidden_states=states[-1],
                document_ids=docs,
                position_ids=torch.arange(length)[None],
                max_anchors=anchors.shape[1],
            )
            found[layout] = ((hidden - ours).abs().max().item(), (logits - head(ours)).abs().max().item())
        print(f"\n[measured] speculators {layout}: max |Δ hidden| = {found[layout][0]:.2e}, max |Δ logits| = "
              f"{found[layout][1]:.2e} (fp32)")  # fmt: skip
    return found


@NEEDS_SPECULATORS
def test_speculators_computes_what_dllm_flow_computes(exported, tmp_path, monkeypatch):
    """Both exported folders, loaded by speculators (the target folder as verifier), give the block hidden states
    and logits of dllm-flow's trained draft for the same target features, positions and anchors, on a row of
    two documents (speculators' own document mask): max |Δ| ≤ 1e-5 in fp32."""
    _, data, _, tgt, ckpt, _, folders = exported
    from tasks.evaluation.trained_model import load_trained_model
    from tasks.rows import load_split

    target = load_target(tgt.info["model_path"])
    ids = load_split(data.path, "val")[0][:1].long()
    length = ids.shape[1]
    docs = torch.tensor([[0] * 12 + [1] * (length - 12)])
    anchors = torch.tensor([[3, 9, 11, 12, 17, 22, length - BLOCK - 1]])  # speculators: anchors < L − block
    # the verifier as transformers saves it: speculators reads the embedding under its own name, and dllm-flow's
    # target checkpoint keeps a tied embedding once, as lm_head.weight
    verifier = tmp_path / "verifier"
    target.save_pretrained(verifier)
    draft = load_trained_model(ckpt, "cpu")
    found = _both_sides(draft, target, folders, verifier, tmp_path, monkeypatch, ids, docs, anchors)
    assert all(dh <= 1e-5 and dl <= 1e-5 for dh, dl in found.values())


@NEEDS_SPECULATORS
def test_speculators_agrees_on_a_draft_shaped_unlike_its_target(tmp_path, monkeypatch):
    """A random draft whose every knob differs from the defaults — one key/value head for four query heads, a
    head_dim (12) that is not hidden ÷ heads, biased projections, RoPE base 1e6, its own MLP width, random norm
    weights — written in both layouts and loaded by speculators: the same block hidden states and logits."""
    from strategies.models import build_model, tiny_model_config

    vocab = 50
    target = build_model(tiny_model_config("llama", vocab, 64, 32, 4, 4, 2, None, False), 0).eval()
    verifier = tmp_path / "verifier"
    target.save_pretrained(verifier)
    cfg = DFlashDraftConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=12,
        intermediate_size=40, block_size=BLOCK, target_layer_ids=[0, 2], mask_token_id=vocab - 1,
        num_target_layers=4, vocab_size=vocab, rope_theta=1e6, attention_bias=True, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    draft = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    folders = {}
    for layout in ("zlab", "speculators"):
        folders[layout] = tmp_path / layout
        folders[layout].mkdir()
        write_serving_layout(folders[layout], cfg, draft.state_dict(), layout, {"path": str(verifier)})
    assert json.loads((folders["zlab"] / "config.json").read_text())["head_dim"] == 12
    ids = torch.randint(0, vocab - 1, (1, 28), generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 10 + [1] * 18])
    anchors = torch.tensor([[2, 6, 9, 10, 15, 23]])
    found = _both_sides(draft, target, folders, verifier, tmp_path, monkeypatch, ids, docs, anchors)
    assert all(dh <= 1e-5 and dl <= 1e-5 for dh, dl in found.values())


def test_an_exported_draft_imports_evaluates_trains_and_exports_again_byte_for_byte(exported):
    """`model.path` = an export and `train.steps: 0`: the train stage publishes it as it is and the evaluate stage
    measures it against its target (the same τ as the draft it was exported from); exported again, every file
    but the lineage records is the same bytes. A speculators folder trains on, into the z-lab layout."""
    spec, data, workdir, tgt, ckpt, metrics, folders = exported
    for layout, folder in folders.items():
        imported = _imported(spec, folder)
        ref = train(imported, "dflash", data, workdir, inputs={"target": tgt})
        assert json.loads((model_dir(ref) / "dllm.json").read_text())["step"] == 0
        again = evaluate(imported, "dflash", ref, data, workdir).info["metrics"]
        for name in ("dflash/tau", "dflash/tau_sim", "dflash/exact_match", "eval/tokens_per_forward"):
            assert again[name] == metrics[name], (layout, name)
        out = export_checkpoint(str(model_dir(ref)), Path(workdir) / f"{layout}-again", Path(workdir), fmt=layout)
        names = sorted(p.name for p in folder.iterdir())
        assert sorted(p.name for p in out.iterdir()) == names
        same = [n for n in names if n not in RECORDS]
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(same)
        for name in same:
            assert (out / name).read_bytes() == (folder / name).read_bytes(), (layout, name)
        first, second = (json.loads((f / "dllm.json").read_text()) for f in (folder, out))
        for key in ("strategy", "mask_token_id", "options", "target", "seq_len", "chat", "data_key"):
            assert first[key] == second[key], key
        first, second = (json.loads((f / "generation_config.json").read_text()) for f in (folder, out))
        assert first.pop("dllm_settings_from") != second.pop("dllm_settings_from") and first == second
    continued = train(_imported(spec, folders["speculators"], steps=2), "dflash", data, workdir, inputs={"target": tgt})
    config = model_dir(continued) / "config.json"
    assert config.read_bytes() == (folders["zlab"] / "config.json").read_bytes()  # num_target_layers from the target
    before = DFlashDraftModel.load(folders["zlab"]).state_dict()
    after = DFlashDraftModel.load(model_dir(continued)).state_dict()
    assert before.keys() == after.keys() and not torch.equal(before["fc.weight"], after["fc.weight"])


def test_the_serving_layout_round_trips_bit_for_bit(exported, tmp_path):
    """The layout writer alone: a folder read back by dllm-flow's loader and written again is the same bytes,
    in both layouts."""
    _, _, _, tgt, _, _, folders = exported
    for layout, folder in folders.items():
        model = DFlashDraftModel.load(folder)
        dest = tmp_path / layout
        dest.mkdir()
        written = write_serving_layout(dest, model.config, model.state_dict(), layout, {"path": tgt.info["model_path"]})
        for name in written:
            assert (dest / name).read_bytes() == (folder / name).read_bytes(), (layout, name)


def test_the_export_decodes_with_dllm_flow_as_the_target(exported):
    """The exported folder is a dllm-flow checkpoint too: `dllm-flow generate --checkpoint OUT` decodes
    speculatively with it and gives the target's greedy text."""
    from transformers import GenerationConfig

    from strategies.sampling import SamplerConfig
    from tasks.commands.generate import Request, check_sampler, generate
    from tasks.evaluation.trained_model import load_for_generation

    for folder in exported[-1].values():
        assert GenerationConfig.from_pretrained(folder).dllm_sampler == "speculative"
        loaded = load_for_generation(folder, "cpu")
        out = generate(
            loaded, Request("O", check_sampler("dflash", "auto", False), SamplerConfig(max_new_tokens=8)), "cpu"
        )
        prompt = loaded.tokenizer("O", add_special_tokens=False)["input_ids"]
        target = loaded.strategy.target
        assert out.text == loaded.tokenizer.decode(greedy_generate(target, prompt, 8, loaded.tokenizer.eos_token_id))


def test_a_copy_hint_draft_is_refused_in_the_serving_layouts_by_name(exported, tmp_path):
    spec, data, workdir, tgt, ckpt, _, _ = exported
    from tasks.prepare_data import load_tokenizer

    meta = json.loads((ckpt / "dllm.json").read_text())
    base = DFlashDraftModel.load(ckpt).config
    hinted = DFlashDraftModel(DFlashDraftConfig(**{**base.__dict__, "copy_hint": True}))
    tokenizer = load_tokenizer(str(ckpt))
    source = write_checkpoint(tmp_path / "hinted", hinted, tokenizer, meta)
    for fmt in ("zlab", "speculators", None):
        with pytest.raises(ValueError, match=r"dflash.copy_hint: true.*no serving engine.*--format dllm-flow"):
            export_checkpoint(str(source), tmp_path / f"out-{fmt}", tmp_path, fmt=fmt)
        assert not (tmp_path / f"out-{fmt}").exists()
    out = export_checkpoint(str(source), tmp_path / "dllm-flow", tmp_path, fmt="dllm-flow")
    assert json.loads((out / "config.json").read_text())["dllm_copy_hint"] is True
    assert "decodes with dllm-flow only" in (out / "README.md").read_text()


def test_format_choices_and_a_format_for_a_model_that_is_no_draft(prepared, tmp_path):
    from flows.cli import EXPORT_FORMATS
    from strategies.models import build_model, tiny_model_config
    from tasks.prepare_data import load_tokenizer

    assert EXPORT_FORMATS == FORMATS
    tokenizer = load_tokenizer(f"{prepared[0].path}/tokenizer")
    lm = build_model(tiny_model_config("llama", len(tokenizer), 32, 16, 1, 2, None, None, True), 0)
    meta = {"strategy": "mdlm", "mask_token_id": tokenizer.mask_token_id, "options": {}}
    ckpt = write_checkpoint(tmp_path / "lm", lm, tokenizer, meta)
    with pytest.raises(ValueError, match="--format 'zlab' chooses a DFlash draft's layout; a mdlm model has one"):
        export_checkpoint(str(ckpt), tmp_path / "out", tmp_path, fmt="zlab")
    assert not (tmp_path / "out").exists()


def test_an_imported_draft_must_fit_its_target(exported, tmp_path):
    """Width, vocabulary, layer count, layer ids and mask token against the target, each with one message; the
    options that would change the draft (block size, mask token, layer ids, copy hint) against the draft's."""
    spec, data, workdir, tgt, _, _, folders = exported
    target = load_target(tgt.info["model_path"])
    good = read_draft_config(folders["zlab"]).config
    check_draft_fits_target(good, target, "x")
    cases = [
        ({"hidden_size": 48, "num_attention_heads": 4, "head_dim": 12}, "hidden size 48, but the target has 32"),
        ({"vocab_size": good.vocab_size + 1}, f"vocabulary {good.vocab_size + 1}, but the target has"),
        (
            {"num_target_layers": 8, "target_layer_ids": [1, 5]},
            "layer count .num_target_layers. 8, but the target has 4",
        ),
        ({"num_target_layers": None, "target_layer_ids": [1, 6]}, r"reads target layers \[6\], past the target's 4"),
        (
            {"num_target_layers": None, "vocab_size": None, "mask_token_id": 10**6},
            "not a row of the target's embedding",
        ),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message + ".*set dflash.target_model_id"):
            check_draft_fits_target(DFlashDraftConfig(**{**good.__dict__, **change}), target, "x")
    for dflash, message in (
        ({"block_size": 8}, "dflash.block_size is 8 but the draft .* drafts blocks of 4"),
        ({"copy_hint": True}, "dflash.copy_hint is true but the draft checkpoint"),
        ({"mask_token_id": good.mask_token_id - 1}, "dllm.mask_token_id is .* trained with mask token"),
    ):
        with pytest.raises(ValueError, match=message):
            train(_imported(spec, folders["zlab"], **dflash), "dflash", data, workdir, inputs={"target": tgt})
    with pytest.raises(ValueError, match=r"dflash.target_layer_ids \[0, 2\] differ from the layers the draft"):
        from tasks.speculative.setup import layer_ids_for

        layer_ids_for(_imported(spec, folders["zlab"], target_layer_ids=[0, 2]), tgt)
    old = tmp_path / "old-draft"
    old.mkdir()
    (old / "dflash_draft.json").write_text("{}")
    with pytest.raises(ValueError, match="old layout.*no serving engine loads.*retrain it"):
        train(_imported(spec, old), "dflash", data, workdir, inputs={"target": tgt})


def test_a_hub_id_offline_fails_at_once_with_one_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="not a local directory and not in the Hugging Face cache"):
        draft_source("nobody/no-such-dflash-draft")
    assert time.perf_counter() - start < 5


def test_configs_the_engines_publish_read_as_drafts():
    """A published-style z-lab config (ids in `dflash_config`, or only `num_target_layers`: the default ids), a
    speculators config, and what dllm-flow's draft can't run: each refused with the reason."""
    zlab = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16, "hidden_size": 4096,
        "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 12288, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000,
        "num_target_layers": 36, "vocab_size": 151936, "layer_types": ["full_attention"] * 5,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    }  # fmt: skip
    cfg = parse_draft_config(zlab, "q").config
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.block_size, cfg.rope_theta) == (8, 128, 16, 1e6)
    no_ids = {**zlab, "dflash_config": {"mask_token_id": 151669}}
    assert parse_draft_config(no_ids, "q").config.target_layer_ids == default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    as_speculators = json.loads(json.dumps(cfg.to_speculators("org/t", ["Qwen3ForCausalLM"])))
    assert parse_draft_config(as_speculators, "s") == (replace(cfg, num_target_layers=None), "speculators", "org/t")
    for change, message in (
        ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
        ({"layer_types": ["sliding_attention"] * 5}, "sliding-window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "RoPE is scaled"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "is not a DFlash draft"),
        ({"num_key_value_heads": 5}, r"num_key_value_heads \(5\) must divide num_attention_heads \(32\)"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_draft_config({**zlab, **change}, "q")
    reduced = {**cfg.to_speculators("org/t", []), "draft_vocab_size": 32000}
    with pytest.raises(ValueError, match="reduced vocabulary"):
        parse_draft_config(reduced, "s")


def test_train_steps_0_publishes_an_imported_draft_and_builds_nothing_for_training(exported, tiny_spec):
    """`train.steps: 0` needs a model to publish (`model.kind: pretrained`); a draft then needs neither the
    feature cache nor regenerated rows."""
    from dllm_common.config import ConfigError
    from strategies import strategy_class

    spec, _, _, _, _, _, folders = exported
    raw = _spec(tiny_spec).model_dump(mode="json")
    raw["train"]["steps"] = 0
    with pytest.raises(ConfigError, match="train.steps is 0: nothing is trained.*needs model.kind: pretrained"):
        validate_config(raw)
    cls = strategy_class("dflash")
    cached = _imported(spec, folders["zlab"], steps=2, target_features="cached", regenerate={"prompt_len": 8})
    assert cls.upstream_stages(cached) == ("target", "features") and cls.training_data(cached) == "regenerated"
    as_is = _imported(spec, folders["zlab"], target_features="cached", regenerate={"prompt_len": 8})
    assert cls.upstream_stages(as_is) == ("target",) and cls.training_data(as_is) == "prepared"
