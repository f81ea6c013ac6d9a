"""τ at a sampling temperature (`dflash.eval_temperature`, docs/evaluation.md §4.7): the held-out prompts decoded by
speculative sampling, each prompt from its own seeded generator; an evaluation-only key, so setting it re-keys the
evaluation and not the training, and a config without it digests as before it existed."""

from pathlib import Path

import pytest
import torch

from strategies.dflash.blocks import build_target_layer_ids
from strategies.dflash.decoding import speculative_generate
from strategies.dflash.draft import DFlashDraftConfig, DFlashDraftModel
from strategies.dflash.strategy import DFlashStrategy
from strategies.models import build_model, tiny_model_config
from strategies.options import load_config
from strategies.seeding import seeded_generator
from tasks.speculative.acceptance import sampled_acceptance

ROOT = Path(__file__).resolve().parents[3]
V, BS, NEW = 40, 4, 12


@pytest.fixture(scope="module")
def pair():
    target = build_model(tiny_model_config("llama", V, 64, 32, 4, 4, None, None, False), seed=0).eval()
    torch.manual_seed(1)
    cfg = DFlashDraftConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        block_size=BS,
        target_layer_ids=build_target_layer_ids(4, 1),
        mask_token_id=V - 1,
        num_target_layers=4,
        vocab_size=V,
    )
    return target.requires_grad_(False), DFlashDraftModel(cfg).eval()


PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [11, 2, 9, 4, 11, 2], [1, 2, 3, 4, 5, 6, 7]]


def test_sampled_tau_is_speculative_sampling_from_one_seeded_generator_per_prompt(pair):
    target, draft = pair
    out = sampled_acceptance(target, draft, PROMPTS, NEW, None, 1.0, seed=4)
    expected = [
        speculative_generate(
            target, draft, p, NEW, None, temperature=1.0, generator=seeded_generator(4 * 1_000_003 + i)
        ).acceptance
        for i, p in enumerate(PROMPTS)
    ]
    assert out["acceptance"] == expected and out["temperature"] == 1.0
    assert out["tau"] == pytest.approx(sum(map(sum, expected)) / sum(map(len, expected)))
    assert "tau_draft" not in out  # no lookup: the draft alone is the decoder
    # the same seed gives the same draws; every cycle commits between 1 and the block's tokens
    assert sampled_acceptance(target, draft, PROMPTS, NEW, None, 1.0, seed=4)["acceptance"] == expected
    assert all(1 <= a <= BS for row in expected for a in row)
    # with the context lookup in front, the draft alone is measured beside it
    looked = sampled_acceptance(target, draft, PROMPTS, NEW, None, 1.0, seed=4, lookup=2)
    alone = sampled_acceptance(target, draft, PROMPTS, NEW, None, 1.0, seed=4)
    assert looked["tau_draft"] == pytest.approx(alone["tau"])


def test_sampled_tau_at_a_vanishing_temperature_is_greedy_tau(pair):
    """As T → 0 the draft's proposals and the target's draws become their argmaxes, and the rejection step keeps a
    proposal exactly when greedy verification would: the same acceptance, cycle for cycle."""
    target, draft = pair
    greedy = [speculative_generate(target, draft, p, NEW, None, lookup_ngram=2).acceptance for p in PROMPTS]
    assert max(max(row) for row in greedy) > 1  # the lookup's proposals are accepted somewhere: not all ones
    cold = sampled_acceptance(target, draft, PROMPTS, NEW, None, 1e-4, seed=0, lookup=2)
    assert cold["acceptance"] == greedy


def test_eval_temperature_keys_the_evaluation_only_and_is_unwritten_at_zero():
    base = load_config(ROOT / "configs" / "dflash.yaml")
    hot = load_config(ROOT / "configs" / "dflash.yaml", ["dflash.eval_temperature=1.0"])
    assert "eval_temperature" not in base.dflash.model_dump(mode="json")  # the digest of an older config holds
    assert hot.dflash.model_dump(mode="json")["eval_temperature"] == 1.0
    assert DFlashStrategy.train_settings(hot) == DFlashStrategy.train_settings(base)
    assert DFlashStrategy.eval_settings(hot) != DFlashStrategy.eval_settings(base)
    with pytest.raises(ValueError, match="eval_temperature"):
        load_config(ROOT / "configs" / "dflash.yaml", ["dflash.eval_temperature=-1"])


def test_a_draft_for_a_sampling_server_trained_on_greedy_rows_is_warned_about_before_training():
    from flows.cli_checks import check_sampled_serving

    cfg = ROOT / "configs" / "dflash.yaml"  # rows the target continued greedily (regenerate.temperature 0)
    assert check_sampled_serving(load_config(cfg)) == []  # judged greedy: nothing to say
    (line,) = check_sampled_serving(load_config(cfg, ["dflash.eval_temperature=0.7"]))
    assert "greedy rows" in line and "set dflash.regenerate.temperature: 0.7" in line
    fixed = ["dflash.eval_temperature=0.7", "dflash.regenerate.temperature=0.7"]
    assert check_sampled_serving(load_config(cfg, fixed)) == []
    # nothing trains (an imported draft evaluated as it is): nothing to warn about
    hot = load_config(cfg, ["dflash.eval_temperature=0.7"])
    assert check_sampled_serving(hot.model_copy(update={"train": hot.train.model_copy(update={"steps": 0})})) == []
