"""Weights checked against the model before loading (`dllm_common.checkpoint.check_weights_fit`): a safetensors file
whose header re-declares a float tensor as an integer one, or swaps a shape, with digests.json recomputed to match
(as another tool's export or a download would be), is refused before any tensor is read, in one line naming the
file, the tensor and the flag or key that pointed there, on every load path: a checkpoint (`--checkpoint`,
`--redraft`, evaluation), `model.path` (a causal LM, a DiffusionGemma, an imported DFlash draft), a DFlash target,
the gen_ppl scorer and `--adapter`. Another float dtype (bf16 for an fp32 model) still loads: loading casts it."""

import contextlib
import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from dllm_common.checkpoint import (
    DIGESTS,
    WEIGHTS,
    WeightsMismatchError,
    load_weights_into,
    safetensors_header,
    weight_files,
    write_checkpoint,
)
from dllm_common.store import sha256_file
from strategies.dflash.draft import DFlashDraftModel
from strategies.models import add_lora, apply_adapter, build_model, load_pretrained, lora_state_dict, tiny_model_config
from tasks.evaluation.trained_model import load_for_generation, load_trained_model
from tests.stagekit import tiny_draft_config

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"  # [64, 32] each (untied)


def _llama(seed=0):
    return build_model(tiny_model_config("llama", 64, 128, 32, 2, 4, None, None, False), seed=seed)


def rewrite_header(file: Path, name: str, **change) -> None:
    """Re-declare tensor `name` in `file`'s header (`dtype=`, `shape=`) keeping its bytes, and recompute the folder's
    digests.json where it has one: what another tool's export or a download would hand over."""
    file = Path(file)
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    assert name in header, sorted(header)
    header[name].update(change)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    digests = file.parent / DIGESTS
    if digests.is_file():
        table = json.loads(digests.read_text())
        table[file.name] = sha256_file(file)
        digests.write_text(json.dumps(table, indent=2, sort_keys=True))


def _assert_names(exc, *parts) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    for part in parts:
        assert str(part) in message, (part, message)
    return message


def _shard_holding(folder: Path, name: str) -> Path:
    return next(folder / f for f in weight_files(folder) if name in safetensors_header(folder / f))


# ------------------------------------------------------------------ dllm-flow checkpoints: --checkpoint, --redraft


@pytest.fixture
def checkpoint(tmp_path):
    return write_checkpoint(tmp_path / "ckpt", _llama(), meta={"strategy": "mdlm", "mask_token_id": 63})


def test_a_float_tensor_redeclared_as_integers_is_refused_before_any_weight_is_loaded(checkpoint, monkeypatch):
    """F32 → I32 keeps 4 bytes an element and the digests are recomputed: only the header says what is wrong."""
    rewrite_header(checkpoint / WEIGHTS, EMBED, dtype="I32")
    model = _llama(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr("safetensors.torch.load_model", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(WeightsMismatchError) as exc:
        load_weights_into(model, checkpoint, "--checkpoint")
    message = _assert_names(exc, f"--checkpoint: {checkpoint / WEIGHTS}", EMBED, "I32 [64, 32]")
    assert "floating-point tensor [64, 32]" in message and "point --checkpoint at" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_swapped_shape_is_refused_naming_the_file_tensor_and_flag(checkpoint):
    rewrite_header(checkpoint / WEIGHTS, HEAD, shape=[32, 64])
    with pytest.raises(WeightsMismatchError) as exc:
        load_for_generation(checkpoint, "cpu", where="--checkpoint")
    _assert_names(exc, "--checkpoint:", checkpoint / WEIGHTS, HEAD, "F32 [32, 64]", "[64, 32]")
    with pytest.raises(WeightsMismatchError) as exc:  # evaluation: a checkpoint the pipeline wrote, no flag to name
        load_trained_model(checkpoint, "cpu")
    _assert_names(exc, "checkpoint:", checkpoint / WEIGHTS, HEAD, "put back")


def test_a_sharded_checkpoint_names_the_shard(tmp_path):
    ckpt = write_checkpoint(tmp_path / "sharded", _llama(), meta={"strategy": "mdlm"}, max_shard_size=20_000)
    assert len(weight_files(ckpt)) > 1
    shard = _shard_holding(ckpt, "model.layers.1.mlp.down_proj.weight")
    rewrite_header(shard, "model.layers.1.mlp.down_proj.weight", dtype="I64", shape=[32, 48])  # 8 bytes × half
    with pytest.raises(WeightsMismatchError) as exc:
        load_trained_model(ckpt, "cpu", "--checkpoint")
    _assert_names(exc, "--checkpoint:", shard, "model.layers.1.mlp.down_proj.weight", "I64 [32, 48]")


def test_the_generate_command_refuses_in_one_line(checkpoint, tmp_path, capsys):
    from flows.cli import main

    rewrite_header(checkpoint / WEIGHTS, EMBED, dtype="I32")
    capsys.readouterr()
    with mock.patch.dict(os.environ), contextlib.chdir(tmp_path):
        code = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "hi", "--workdir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("dllm-flow: error: ") and str(checkpoint / WEIGHTS) in err and EMBED in err


def test_a_valid_and_a_bf16_stored_checkpoint_still_load(checkpoint, tmp_path):
    model = load_trained_model(checkpoint, "cpu")
    saved = _llama().state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())

    bf16 = write_checkpoint(tmp_path / "bf16", _llama().to(torch.bfloat16), meta={"strategy": "mdlm"})
    assert safetensors_header(bf16 / WEIGHTS)[EMBED]["dtype"] == "BF16"
    fp32 = _llama(seed=1)
    load_weights_into(fp32, bf16, "--checkpoint")
    assert fp32.get_input_embeddings().weight.dtype == torch.float32
    assert torch.equal(fp32.state_dict()[EMBED], saved[EMBED].to(torch.bfloat16).float())


def test_a_damaged_header_is_one_line_too(checkpoint):
    file = checkpoint / WEIGHTS
    data = file.read_bytes()
    file.write_bytes(struct.pack("<Q", 16) + b"{not json at all" + data[8:])
    table = json.loads((checkpoint / DIGESTS).read_text())
    (checkpoint / DIGESTS).write_text(json.dumps({**table, WEIGHTS: sha256_file(file)}))
    with pytest.raises(WeightsMismatchError) as exc:
        load_trained_model(checkpoint, "cpu", "--checkpoint")
    _assert_names(exc, "--checkpoint:", file, "not a safetensors JSON header")


# ------------------------------------------------------------------ DFlash drafts: --redraft, model.path


@pytest.fixture
def draft():
    torch.manual_seed(0)
    return DFlashDraftModel(tiny_draft_config())


def test_a_draft_checkpoint_given_as_redraft_is_refused(draft, tmp_path):
    ckpt = write_checkpoint(tmp_path / "draft", draft, meta={"strategy": "dflash"})
    name = "layers.0.self_attn.q_proj.weight"
    assert load_trained_model(ckpt, "cpu", "--redraft").state_dict()[name].equal(draft.state_dict()[name])
    rewrite_header(ckpt / WEIGHTS, name, dtype="I32")
    with pytest.raises(WeightsMismatchError) as exc:
        load_trained_model(ckpt, "cpu", "--redraft")
    _assert_names(exc, "--redraft:", ckpt / WEIGHTS, name, "I32", "point --redraft at")


def test_an_imported_draft_folder_is_refused_naming_model_path(draft, tiny_spec, tmp_path):
    from strategies.dflash.options import DFlashOptions
    from strategies.options import validate_config
    from tasks.speculative.setup import import_draft
    from tests.stagekit import tiny_dflash_target

    draft.save(tmp_path / "zlab")  # the z-lab layout: no digests
    raw = tiny_spec.model_dump(mode="json")
    raw["pipeline"]["strategies"] = ["dflash"]
    raw["model"].update(kind="pretrained", path=str(tmp_path / "zlab"))
    spec, target = validate_config(raw), tiny_dflash_target()
    assert import_draft(spec, DFlashOptions(), target).config.block_size == 4
    rewrite_header(tmp_path / "zlab" / WEIGHTS, "fc.weight", shape=[64, 32])  # [32, 64]: 2 target layers × 32
    with pytest.raises(WeightsMismatchError) as exc:
        import_draft(spec, DFlashOptions(), target)
    _assert_names(exc, "model.path:", tmp_path / "zlab" / WEIGHTS, "fc.weight", "F32 [64, 32]", "[32, 64]")


# ------------------------------------------------------------------ from_pretrained paths: model.path, targets, scorer


@pytest.fixture
def hf_folder(tmp_path):
    _llama().save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.fixture
def no_from_pretrained(monkeypatch):
    """A refusal must come before transformers reads any weight."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained was reached")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def test_model_path_is_refused_before_from_pretrained(hf_folder, tiny_spec):
    from strategies.options import validate_config
    from tasks.training.trainee import backbone

    raw = tiny_spec.model_dump(mode="json")
    raw["model"] = {"kind": "pretrained", "path": str(hf_folder)}
    spec = validate_config(raw)
    assert backbone(spec, None).state_dict()[EMBED].equal(_llama().state_dict()[EMBED])  # the valid folder loads
    rewrite_header(hf_folder / WEIGHTS, EMBED, dtype="I32")
    with mock.patch("transformers.AutoModelForCausalLM.from_pretrained", side_effect=AssertionError("reached")):
        with pytest.raises(WeightsMismatchError) as exc:
            backbone(spec, None)
    _assert_names(exc, "model.path:", hf_folder / WEIGHTS, EMBED, "I32 [64, 32]", "point model.path at")


def test_a_sharded_model_path_names_the_shard(tmp_path, no_from_pretrained):
    _llama().save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    shard = _shard_holding(tmp_path / "sharded", HEAD)
    rewrite_header(shard, HEAD, shape=[32, 64])
    with pytest.raises(WeightsMismatchError) as exc:
        load_pretrained(str(tmp_path / "sharded"))
    _assert_names(exc, "model.path:", shard, HEAD, "F32 [32, 64]")


def test_a_bf16_model_path_still_loads(tmp_path):
    _llama().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert safetensors_header(tmp_path / "bf16" / WEIGHTS)[EMBED]["dtype"] == "BF16"
    model = load_pretrained(str(tmp_path / "bf16"))
    assert model.state_dict()[EMBED].dtype == torch.float32


def test_a_diffusion_gemma_model_path_is_refused(tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    from strategies.block_diffusion.gemma import DiffusionGemmaCanvas
    from strategies.models import tiny_diffusion_gemma_config

    config = tiny_diffusion_gemma_config(
        48, 64, 32, 2, 2, 1, None, num_experts=2, top_k_experts=1, moe_intermediate_size=8, canvas_length=4
    )
    DiffusionGemmaForBlockDiffusion(config).save_pretrained(tmp_path / "dg")
    m = SimpleNamespace(
        kind="pretrained", path=str(tmp_path / "dg"), gguf_file=None, trust_remote_code=False, dtype="float32"
    )
    spec = SimpleNamespace(model=SimpleNamespace(**vars(m), attn_implementation="sdpa"))
    assert isinstance(DiffusionGemmaCanvas.from_model_spec(spec, None, None, 0), DiffusionGemmaCanvas)
    name = "model.decoder.layers.0.experts.gate_up_proj"
    rewrite_header(tmp_path / "dg" / WEIGHTS, name, dtype="I32")
    with mock.patch.object(DiffusionGemmaCanvas, "from_pretrained", side_effect=AssertionError("reached")):
        with pytest.raises(WeightsMismatchError) as exc:
            DiffusionGemmaCanvas.from_model_spec(spec, None, None, 0)
    _assert_names(exc, "model.path:", tmp_path / "dg" / WEIGHTS, name, "I32")


def test_a_dflash_target_is_refused_naming_its_key(hf_folder, tmp_path, tiny_spec):
    from tasks.speculative.setup import load_spec_target, load_target
    from tests.stagekit import dflash_spec

    assert load_target(hf_folder).state_dict()[HEAD].equal(_llama().state_dict()[HEAD])
    rewrite_header(hf_folder / WEIGHTS, HEAD, dtype="U8", shape=[64, 128])  # 1 byte × 4 as many
    spec = dflash_spec(tiny_spec, target_model_id=str(hf_folder))
    with mock.patch("transformers.AutoModelForCausalLM.from_pretrained", side_effect=AssertionError("reached")):
        with pytest.raises(WeightsMismatchError) as exc:
            load_spec_target(spec, hf_folder, "cpu")
    _assert_names(exc, "dflash.target_model_id:", hf_folder / WEIGHTS, HEAD, "U8 [64, 128]")

    trained = write_checkpoint(tmp_path / "target", _llama(), meta={"strategy": "dflash-target"})
    rewrite_header(trained / WEIGHTS, EMBED, dtype="BOOL", shape=[64, 128])  # the target the pipeline trained
    with pytest.raises(WeightsMismatchError) as exc:
        load_spec_target(dflash_spec(tiny_spec), trained, "cpu")
    _assert_names(exc, "checkpoint:", trained / WEIGHTS, EMBED, "BOOL")


def test_a_draft_checkpoints_target_is_refused_naming_the_record(draft, hf_folder, tmp_path):
    from dllm_common.config import TokenizerConfig
    from tasks.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(
        ["the quick brown fox jumps over the lazy dog. " * 4], TokenizerConfig(vocab_size=300, min_frequency=1)
    )
    meta = {"strategy": "dflash", "mask_token_id": 63, "target": {"path": str(hf_folder)}}
    ckpt = write_checkpoint(tmp_path / "draft", draft, tokenizer, meta)
    rewrite_header(hf_folder / WEIGHTS, EMBED, dtype="I32")
    with pytest.raises(WeightsMismatchError) as exc:
        load_for_generation(ckpt, "cpu", where="--checkpoint")
    _assert_names(exc, "--checkpoint's target (dllm.json target.path):", hf_folder / WEIGHTS, EMBED, "I32")


def test_the_gen_ppl_scorer_is_refused_naming_eval_scorer_path(hf_folder, no_from_pretrained):
    from dllm_common.config import ScorerConfig
    from tasks.evaluation.scoring import load_scorer

    rewrite_header(hf_folder / WEIGHTS, "model.layers.0.self_attn.q_proj.weight", dtype="I32")
    with pytest.raises(WeightsMismatchError) as exc:
        load_scorer(ScorerConfig(path=str(hf_folder)), hf_folder.parent)
    _assert_names(exc, "eval.scorer.path:", hf_folder / WEIGHTS, "model.layers.0.self_attn.q_proj.weight")


def test_an_adapter_is_refused_naming_the_flag(tmp_path):
    from safetensors.torch import save_file

    trained = _llama()
    add_lora(trained, r=2, alpha=4, dropout=0.0, target_modules=["q_proj"])
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file(lora_state_dict(trained), str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 2, "alpha": 4, "target_modules": ["q_proj"]}))
    apply_adapter(_llama(), folder)  # fits
    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    rewrite_header(folder / "adapter_model.safetensors", name, shape=[32, 2])
    with pytest.raises(WeightsMismatchError) as exc:
        apply_adapter(_llama(), folder)
    _assert_names(exc, "--adapter:", folder / "adapter_model.safetensors", name, "F32 [32, 2]", "[2, 32]")


def test_a_header_length_past_the_formats_bound_is_refused_without_reading_it(tmp_path, monkeypatch):
    """A damaged length inside a large file is refused from the number, not read as gigabytes of JSON."""
    import struct

    from dllm_common import checkpoint

    monkeypatch.setattr(checkpoint, "MAX_HEADER_BYTES", 64)
    file = tmp_path / "big.safetensors"
    file.write_bytes(struct.pack("<Q", 1000) + b" " * 2000)  # a 1000-byte header in a file that holds it
    with pytest.raises(
        ValueError, match=r"its header declares 1000 bytes, more than a safetensors header may hold \(64\)"
    ):
        safetensors_header(file)
