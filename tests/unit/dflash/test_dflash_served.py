"""Acceptance as it will be served (docs/evaluation.md §4.7.1): the draft exported in the z-lab layout and decoded by
z-lab's own `dflash_generate` on prompts rendered with the target's chat template, beside dllm-flow's τ; the paired
bootstrap that decides "beyond noise"; the causes it checks (mask alias, chat template and special tokens differing
from the target's, config fields an engine reads differently), reported after training and refused or warned about
before it; the plain-prompt case said, never silent. Tiny models and a tiny BPE tokenizer with a chat template."""

import json
import warnings
from types import SimpleNamespace

import pytest
import torch

from dllm_common.config import TokenizerConfig
from strategies.dflash.blocks import build_target_layer_ids
from strategies.dflash.decoding import speculative_generate
from strategies.dflash.draft import DFlashDraftConfig, DFlashDraftModel
from strategies.dflash.served_checks import (
    engine_field_problems,
    engine_reading,
    served_notes,
    template_token_ids,
    tokenizer_problems,
    tokenizer_record,
)
from strategies.models import build_model, set_token_ids, tiny_model_config
from tasks.data.tokenizer import CHAT_TEMPLATE, train_tokenizer
from tasks.speculative.served import full_cycles, paired_bootstrap, ratio, render_prompts, served_acceptance
from tasks.speculative.setup import check_served_before_training, import_draft

pytest.importorskip("dflash.model", reason="z-lab's dflash package (make install: NODEPS) is not installed")

TEXTS = [
    "the quick brown fox jumps over the lazy dog. " * 4,
    "a stitch in time saves nine; more haste, less speed. " * 4,
]
THINKING = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<|system|><|eos|>{% endif %}{% endif %}",
)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, TokenizerConfig(vocab_size=300, min_frequency=1))


@pytest.fixture(scope="module")
def target(tok):
    model = build_model(tiny_model_config("llama", len(tok), 256, 32, 4, 4, None, None, False), seed=0)
    set_token_ids(model.config, tok)
    return model.eval().requires_grad_(False)


def _draft(tok, mask_id=None) -> DFlashDraftModel:
    torch.manual_seed(0)
    cfg = DFlashDraftConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        block_size=4,
        target_layer_ids=build_target_layer_ids(4, 1),
        mask_token_id=tok.mask_token_id if mask_id is None else mask_id,
        num_target_layers=4,
        vocab_size=len(tok),
    )
    return DFlashDraftModel(cfg).eval()


def _ev(tok, **dflash):
    d = {"eval_max_new_tokens": 13, "eval_served": True, "eval_enable_thinking": None} | dflash
    return SimpleNamespace(
        spec=SimpleNamespace(dflash=SimpleNamespace(**d), eval=SimpleNamespace(seed=0)), tokenizer=tok
    )


def _prompts(tok, n=4):
    ids = tok(TEXTS[0] + TEXTS[1])["input_ids"]
    return [ids[7 * i : 7 * i + 6] for i in range(n)]


def _target_folder(tmp_path, tok, template=None, eos=None):
    """The target's folder as a serving engine finds it: its own tokenizer beside the weights."""
    tok = tok.__class__.from_pretrained(_save(tok, tmp_path / "trained"))
    if template is not None:
        tok.chat_template = template
    if eos is not None:
        tok.eos_token = eos
    return _save(tok, tmp_path / "target")


def _save(tok, folder):
    tok.save_pretrained(folder)
    return str(folder)


def test_served_tau_through_zlabs_decoder_on_chat_prompts(tok, target, tmp_path):
    draft = _draft(tok)
    meta = {"target": {"path": _target_folder(tmp_path, tok), "stage": "target"}, "chat": True}
    raw = _prompts(tok)
    metrics, report = served_acceptance(_ev(tok), target, draft, tok.mask_token_id, raw, meta)
    assert metrics["dflash/served_chat"] == 1 and metrics["dflash/tau_served_prompts"] == 4
    # the same engine reading: z-lab's decoder gives dllm-flow's tokens and acceptance on the rendered prompts
    assert metrics["dflash/served_exact_match"] == 1.0
    assert report["acceptance"]["served"] == report["acceptance"]["ours_served"]
    assert metrics["dflash/tau_served"] == pytest.approx(metrics["dflash/tau_served_ours"])
    # the rendered prompts are the user turns of the target's template; today's τ counted without each last cycle
    rendered = render_prompts(raw, tok, tok, True, None)
    assert rendered[0][0] == tok.convert_tokens_to_ids("<|user|>") and rendered[0][-1] == tok.convert_tokens_to_ids(
        "<|assistant|>"
    )
    ours = [full_cycles(speculative_generate(target, draft, p, 13, tok.eos_token_id).acceptance, 13, 4) for p in raw]
    assert metrics["dflash/tau_full_cycles"] == pytest.approx(ratio(ours))
    lo, hi = metrics["dflash/tau_served_gap_lo"], metrics["dflash/tau_served_gap_hi"]
    assert lo <= metrics["dflash/tau_served_gap"] <= hi
    assert metrics["dflash/tau_served_mismatch"] == int(lo > 0 or hi < 0)
    assert not any(metrics[f"dflash/served_cause_{c}"] for c in ("mask_alias", "template", "special_tokens"))
    notes = "\n".join(served_notes(metrics))
    assert "chat prompts rendered with the target's own chat template" in notes and "bootstrap" in notes


def test_a_draft_trained_with_another_template_and_special_tokens_and_an_aliased_mask_is_reported(
    tok, target, tmp_path
):
    assistant = tok.convert_tokens_to_ids("<|assistant|>")
    draft = _draft(tok, mask_id=assistant)  # the mask is a token the chat template writes into every prompt
    folder = _target_folder(tmp_path, tok, template=CHAT_TEMPLATE.replace("<|user|>", "<|system|>"), eos="<|pad|>")
    meta = {"target": {"path": folder, "stage": "target"}, "chat": True}
    metrics, report = served_acceptance(_ev(tok), target, draft, assistant, _prompts(tok), meta)
    for cause in ("mask_alias", "template", "special_tokens"):
        assert metrics[f"dflash/served_cause_{cause}"] == 1, cause
    details = " ".join(c["detail"] for c in report["causes"])
    assert "dllm.mask_token_id" in details and "tokenizer.path" in details
    assert "allow_mask_alias" in details
    # a gap beyond noise names the causes found
    notes = "\n".join(served_notes({**metrics, "dflash/tau_served_mismatch": 1}))
    assert "beyond noise" in notes and "chat template" in notes and "EOS/PAD" in notes


def test_the_plain_prompt_case_is_said_and_a_skip_has_its_reason(tok, target, tmp_path):
    draft = _draft(tok)
    meta = {"target": {"path": _target_folder(tmp_path, tok), "stage": "pretrain_target"}, "chat": False}
    raw = _prompts(tok, 3)
    metrics, report = served_acceptance(_ev(tok), target, draft, tok.mask_token_id, raw, meta)
    assert (
        metrics["dflash/served_chat"] == 0 and report["plain_reason"] == "the target was pretrained here on plain text"
    )
    # plain prompts: the served and our decoder see the same prompts, so the gap is the engine's alone: none
    assert metrics["dflash/tau_served"] == pytest.approx(metrics["dflash/tau_full_cycles"])
    assert "plain prompts: the target has no chat template" in "\n".join(served_notes(metrics))
    off, _ = served_acceptance(_ev(tok, eval_served=False), target, draft, tok.mask_token_id, raw, meta)
    assert off == {"dflash/tau_served_prompts": 0, "dflash/served_skipped": 3}
    assert "dflash.eval_served is false" in served_notes(off)[0]


def test_the_thinking_switch_is_passed_where_the_template_has_one(tok, tmp_path):
    served = tok.__class__.from_pretrained(_save(tok, tmp_path))
    served.chat_template = THINKING
    raw = _prompts(tok, 1)
    on, off = render_prompts(raw, tok, served, True, True), render_prompts(raw, tok, served, True, False)
    assert len(off[0]) == len(on[0]) + 2  # enable_thinking false writes the empty-think scaffolding
    assert render_prompts(raw, tok, served, True, None) == on  # None: the template's own default


def test_the_bootstrap_interval_excludes_zero_only_for_a_real_gap():
    ours = [[3, 3, 2, 3], [2, 3, 3], [3, 2, 3, 3], [3, 3, 3]] * 4
    gap, lo, hi, se = paired_bootstrap(ours, [[1, 1, 2, 1], [1, 2, 1], [1, 1, 1, 1], [2, 1, 1]] * 4, seed=0)
    assert gap < 0 and hi < 0 and se > 0  # served accepts far less: beyond noise
    gap, lo, hi, _ = paired_bootstrap(ours, [[3, 3, 3, 3], [2, 3, 2], [3, 3, 3, 3], [3, 3, 2]] * 4, seed=0)
    assert lo < 0 < hi and abs(gap) < 0.1  # about the same acceptance, spread otherwise over prompts: noise


def test_engine_reading_and_fields_read_differently():
    raw = {"num_hidden_layers": 2, "block_size": 8, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 2]}}
    assert engine_reading(raw) == {
        "block_size": 8,
        "mask_token_id": 5,
        "target_layer_ids": [1, 2],
        "num_target_layers": None,
    }
    assert engine_field_problems(raw, {"block_size": 8, "mask_token_id": 5, "target_layer_ids": [1, 2]}) == []
    twice = {**raw, "dflash_config": {**raw["dflash_config"], "block_size": 4}}
    (line, *rest) = engine_field_problems(twice, {"block_size": 8})
    assert "names block_size twice" in line and "write one value" in line
    no_ids = {"num_hidden_layers": 2, "num_target_layers": 12, "dflash_config": {"mask_token_id": 5}}
    assert engine_reading(no_ids)["target_layer_ids"] == [1, 9] and engine_reading(no_ids)["block_size"] == 16
    (line,) = engine_field_problems(no_ids, {"block_size": 16, "target_layer_ids": [2, 9]})
    assert "target_layer_ids [1, 9]" in line


def test_an_imported_draft_naming_its_block_size_twice_is_refused_before_training(tok, tmp_path):
    draft = _draft(tok)
    draft.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dflash_config"]["block_size"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = SimpleNamespace(model=SimpleNamespace(path=str(tmp_path)))
    options = SimpleNamespace(copy_hint=False, block_size=0, mask_token_id=None)
    with pytest.raises(ValueError, match="names block_size twice.*write one value, 8"):
        import_draft(spec, options, None)


def test_the_causes_are_refused_or_warned_about_before_training(tok, target, tmp_path):
    same = _target_folder(tmp_path / "a", tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_served_before_training(False, True, tok, target, same, tok.mask_token_id)  # nothing to say
    assistant = tok.convert_tokens_to_ids("<|assistant|>")
    assert assistant in template_token_ids(tok)
    with pytest.raises(ValueError, match="chat template writes.*dllm.mask_token_id.*allow_mask_alias"):
        check_served_before_training(False, True, tok, target, same, assistant)
    check_served_before_training(True, True, tok, target, same, assistant)  # allowed
    with pytest.raises(ValueError, match="also the target's EOS id \\(its config.json\\).*dllm.mask_token_id"):
        check_served_before_training(False, False, tok, target, same, tok.eos_token_id)
    other = _target_folder(tmp_path / "b", tok, template=CHAT_TEMPLATE.replace("<|user|>", "<|system|>"), eos="<|pad|>")
    with pytest.warns(UserWarning) as seen:
        check_served_before_training(False, True, tok, target, other, tok.mask_token_id)
    lines = [str(w.message) for w in seen]
    assert any("eos_token_id" in w and "tokenizer.path" in w for w in lines)
    assert any("chat template" in w for w in lines)
    record = tokenizer_record(tok)  # what regenerate records of the tokenizer its prompts were rendered with
    assert record["eos_token_id"] == tok.eos_token_id and len(record["chat_template_sha256"]) == 64
    # plain-text training data: only the special tokens count, not the template
    assert [c for c, _ in tokenizer_problems(tok, tok.__class__.from_pretrained(other), False)] == ["special_tokens"]


def test_the_report_and_the_card_say_served_tau_and_the_causes_of_a_gap():
    from tasks.commands.model_card import _evaluation_section
    from tasks.speculative.table import dflash_table

    m = {"dflash/tau": 3.1, "dflash/tau_sim": 2.9, "dflash/tau_served": 2.0, "dflash/tau_served_ours": 2.9}
    m |= {"dflash/tau_full_cycles": 3.0, "dflash/tau_served_prompts": 16, "dflash/tau_served_gap": -1.0}
    m |= {"dflash/tau_served_gap_lo": -1.3, "dflash/tau_served_gap_hi": -0.7, "dflash/tau_served_mismatch": 1}
    m |= {"dflash/served_chat": 1, "dflash/served_cause_template": 1, "dflash/served_cause_mask_alias": 0}
    report = "\n".join(dflash_table([{"strategy": "dflash", "metrics": m}]))
    ev = SimpleNamespace(source="run x", metrics=m, others=[], samples="", repro_card=None)
    card = "\n".join(_evaluation_section(SimpleNamespace(evaluation=ev, notes=[])))
    for text in (report, card):
        assert "Served τ (z-lab's `dflash_generate`" in text and "[-1.300, -0.700]" in text
        assert "beyond noise" in text and "likely cause: the chat template" in text and "EOS/PAD" not in text
    assert "**dflash**, as served" in report
    plain = {"dflash/tau": 3.1, "dflash/tau_served_prompts": 0, "dflash/served_skipped": 1}
    assert "not installed" in "\n".join(dflash_table([{"strategy": "dflash", "metrics": plain}]))


def test_a_budget_of_one_cycle_per_prompt_is_skipped_with_its_reason(tok, target, tmp_path):
    meta = {"target": {"path": _target_folder(tmp_path, tok), "stage": "target"}, "chat": True}
    m, _ = served_acceptance(
        _ev(tok, eval_max_new_tokens=2), target, _draft(tok), tok.mask_token_id, _prompts(tok), meta
    )
    assert m == {"dflash/tau_served_prompts": 0, "dflash/served_skipped": 4}
    assert "raise dflash.eval_max_new_tokens" in served_notes(m)[0]


def test_the_cli_refuses_a_mask_id_that_is_the_targets_eos_and_warns_of_other_special_ids(tok, tmp_path):
    from dllm_common.config import ConfigError
    from flows.cli_checks import check_served_target
    from strategies.options import load_config, validate_config

    ours, target = _target_folder(tmp_path / "a", tok), _target_folder(tmp_path / "b", tok, eos="<|system|>")
    raw = load_config("configs/dflash.yaml").model_dump(mode="json")
    raw["dflash"] |= {"target_model_id": target}
    assert check_served_target(validate_config(raw)) == []
    raw["dllm"] = {**raw["dllm"], "mask_token_id": tok.convert_tokens_to_ids("<|system|>")}
    with pytest.raises(ConfigError, match="dllm.mask_token_id .against the target's tokenizer. is 5.*EOS"):
        check_served_target(validate_config(raw))
    raw["tokenizer"] = {**raw["tokenizer"], "allow_mask_alias": True}
    assert check_served_target(validate_config(raw)) == []
    raw["dllm"] = {**raw["dllm"], "mask_token_id": None}
    raw["tokenizer"] = {**raw["tokenizer"], "kind": "pretrained", "path": ours, "allow_mask_alias": False}
    (line,) = check_served_target(validate_config(raw))
    assert "eos_token_id 1 vs 5" in line and "set tokenizer.path to the target's folder" in line


@pytest.mark.parametrize("drop", [(), ("target_layer_ids",), ("block_size",)])
def test_engine_reading_is_what_zlabs_loader_takes(tok, tmp_path, drop):
    """The replica of the engines' reading (dflash_config first, then the top level, the default layer ids and
    block size) against z-lab's own loader, on config.json files that leave fields out."""
    import dflash.model as zlab

    _draft(tok).save(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["num_target_layers"] = 12
    for key in drop:
        raw["dflash_config"].pop(key, None)
        raw.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = zlab.DFlashDraftModel.from_pretrained(str(tmp_path))
    seen = engine_reading(raw)
    assert seen["block_size"] == loaded.block_size and seen["mask_token_id"] == loaded.mask_token_id
    assert seen["target_layer_ids"] == list(loaded.target_layer_ids)


def test_only_cycles_that_fit_the_budget_whole_are_counted():
    # budget 11, block 4: cycles start after 0, 3, 7, 10 committed tokens; 7 + 4 ≥ 11 ends the count
    assert full_cycles([3, 4, 3, 2], 11, 4) == [3, 4]
    assert full_cycles([3, 4, 3, 2], 12, 4) == [3, 4, 3]
    assert full_cycles([1, 1, 1], 48, 4) == [1, 1]  # the last (EOS) cycle never counts
    assert full_cycles([4], 48, 4) == []
