"""DFlash options whose valid range depends on another value, and the evaluation-only keys, refused when the config is
loaded (`DFlashOptions.check_against`, what `dllm-flow validate` and every entry point run) in one line naming the key
to change; in-range values still load. The same bounds hold where they are known only later: a draft config built at
setup, the strategy's setup before any training step, and `dllm-flow generate --tree-branches`
(docs/configuration.md, DFlash)."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from dllm_common.config import ConfigError
from dllm_common.config.dflash import MAX_EVAL_TEMPERATURE, MAX_TREE_BRANCHES
from strategies.options import load_config, validate_config
from tests.stagekit import tiny_draft_config

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "dflash.yaml"  # block 8, hidden 128, seq_len 64, 2048 tokens, a 6-layer target
VARIANTS = {
    "dflash": [],
    "dflash2": ["dflash.draft_variant=dflash2"],
    "jetspec": ["dflash.draft_variant=jetspec", "dflash.distill_top_k=32"],
    "domino": ["dflash.draft_variant=domino"],
    "dspark": ["dflash.draft_variant=dspark"],
    "variable_prefix": ["dflash.loss_type=variable_prefix"],
    "sliding_window": ["dflash.draft_sliding_window=16"],
}
# (variant, key named, bad value, sets beside it): each refused at load with the key in its one line
OUT_OF_RANGE = [
    ("dflash2", "conv_kernel_size", 9, []),  # > block_size 8
    ("dflash2", "conv_group_size", 12, []),  # does not divide hidden 128
    ("dflash2", "selector_top_k", 2049, []),  # > the 2048 tokens
    ("dflash", "distill_top_k", 2049, []),
    ("jetspec", "distill_top_k", 4096, []),
    ("variable_prefix", "distill_top_k", 2049, []),
    ("dflash", "eval_tree_branches", 8, []),  # a block of 8 proposes 7 positions
    ("dflash2", "eval_tree_branches", 8, []),
    ("domino", "eval_tree_branches", 8, []),
    ("jetspec", "eval_tree_branches", 8, []),
    ("variable_prefix", "eval_tree_branches", 8, []),
    ("sliding_window", "eval_tree_branches", 8, []),
    ("dflash", "eval_tree_branches", MAX_TREE_BRANCHES + 1, ["dflash.block_size=20", "data.seq_len=64"]),
    ("dflash", "num_blocks_per_sample", 8, ["dflash.overlap_anchors=false"]),  # 7 blocks of 8 fit after token 0
    ("dflash", "target_layer_ids", [1, 6], []),  # the target has 6 layers: 0 … 5
    ("dflash", "target_layer_ids", [-1, 2], []),
    ("sliding_window", "draft_sliding_window", 4, []),  # < block_size 8
    ("variable_prefix", "block_size", 2, []),
    ("dflash", "eval_temperature", 1e30, []),
    ("dflash", "eval_temperature", MAX_EVAL_TEMPERATURE + 0.5, []),
    ("dflash", "eval_prompt_len", 64, []),  # a row of 64 has nothing after 64 tokens
    ("dflash", "eval_prompts", 129, []),  # eval.val_rows 128
    ("dflash", "eval_prompts", 17, ["eval.val_rows=16"]),
    ("dflash", "eval_max_new_tokens", 49, []),  # 16 + 49 > the embedded target's 64 positions
    ("dflash", "eval_max_new_tokens", 1 << 21, []),
    ("dspark", "eval_tree_branches", 8, []),
    ("dspark", "eval_confidence_thresholds", [0.5, 1.2], []),  # θ bounds a product of probabilities
    ("dspark", "eval_confidence_thresholds", [0.0], []),
    ("dspark", "dspark_markov_rank", 0, []),  # the confidence head reads the Markov embedding
    ("dflash", "dspark_markov_rank", 8, []),  # a DSpark key on a DFlash draft
    ("dflash2", "dspark_tv_weight", 0.5, []),
    ("dflash", "eval_every_prompts", 4, []),  # the probe runs only with eval_every
    ("dflash", "eval_every_prompt_len", 64, ["dflash.eval_every=10"]),  # nothing left to continue in a row of 64
]
# (variant, key, the bound itself, sets beside it): loads
IN_RANGE = [
    ("dflash2", "conv_kernel_size", 8, []),
    ("dflash2", "conv_group_size", 32, []),
    ("dflash2", "selector_top_k", 2048, []),
    ("dflash", "distill_top_k", 2048, []),
    ("jetspec", "distill_top_k", 2048, []),
    ("dflash", "eval_tree_branches", 7, []),
    ("domino", "eval_tree_branches", 7, []),
    ("dflash", "eval_tree_branches", MAX_TREE_BRANCHES, ["dflash.block_size=20"]),
    ("dflash", "num_blocks_per_sample", 7, ["dflash.overlap_anchors=false"]),
    ("dflash", "num_blocks_per_sample", 64, []),  # overlapping anchors: any number
    ("dflash", "target_layer_ids", [0, 5], []),
    ("sliding_window", "draft_sliding_window", 8, []),
    ("dflash", "eval_temperature", MAX_EVAL_TEMPERATURE, []),
    ("dflash", "eval_prompt_len", 63, ["dflash.eval_max_new_tokens=1"]),
    ("dflash", "eval_prompts", 128, []),
    ("dflash", "eval_max_new_tokens", 48, []),
    ("dspark", "eval_confidence_thresholds", [0.1, 0.9], []),
    ("dspark", "dspark_markov_rank", 0, ["dflash.dspark_confidence_head_with_markov=false"]),
    ("dflash", "eval_every_prompt_len", 63, ["dflash.eval_every=10"]),
]


def _load(variant: str, key: str, value, extra: list[str]):
    text = json.dumps(value) if isinstance(value, list) else str(value)
    return load_config(CONFIG, [*VARIANTS[variant], *extra, f"dflash.{key}={text}"])


def _line(err) -> str:
    """The refusal's line that names the key (a schema error has a header line above it)."""
    return str(err.value).splitlines()[-1].strip()


@pytest.mark.parametrize(("variant", "key", "value", "extra"), OUT_OF_RANGE, ids=lambda v: str(v)[:12])
def test_an_out_of_range_dflash_option_is_refused_at_load_naming_its_key(variant, key, value, extra):
    with pytest.raises(ConfigError) as err:
        _load(variant, key, value, extra)
    assert f"dflash.{key}" in _line(err), str(err.value)


@pytest.mark.parametrize(("variant", "key", "value", "extra"), IN_RANGE, ids=lambda v: str(v)[:12])
def test_a_dflash_option_at_its_bound_still_loads(variant, key, value, extra):
    spec = _load(variant, key, value, extra)
    read = spec.dflash.model_extra.get(key, getattr(spec.dflash, key, None))
    assert read == (tuple(value) if isinstance(read, tuple) else value)


def test_the_lines_say_what_bounds_the_key_and_the_value_to_set():
    def refused(*sets):
        with pytest.raises(ConfigError) as err:
            load_config(CONFIG, list(sets))
        return str(err.value)

    assert refused("dflash.draft_variant=dflash2", "dflash.conv_kernel_size=9").startswith(
        "dflash.conv_kernel_size (9) is larger than dflash.block_size (8): tap j of the in-block convolution"
    )
    assert refused("dflash.draft_variant=dflash2", "dflash.conv_group_size=12") == (
        "dflash.conv_group_size (12) does not divide model.hidden_size (128), the DFlash 2 draft's width: each group "
        "of 12 channels shares one tap correction; set dflash.conv_group_size to a divisor of 128 (e.g. 8)"
    )
    assert refused("dflash.distill_top_k=5000").startswith(
        "dflash.distill_top_k (5000) is more than the target's vocabulary of 2048 tokens (tokenizer.vocab_size"
    )
    assert refused("dflash.eval_tree_branches=8").startswith(
        "dflash.eval_tree_branches (8) is more than a block of 8 (dflash.block_size) has proposed positions"
    )
    assert "set it to at most 7" in refused("dflash.eval_tree_branches=8")
    assert refused("dflash.eval_max_new_tokens=60") == (
        "dflash.eval_prompt_len (16 tokens) + dflash.eval_max_new_tokens (60) = 76 positions, more than the embedded "
        "target's context (data.seq_len) of 64; lower dflash.eval_max_new_tokens to at most 48"
    )
    hot = refused("dflash.eval_temperature=1e30").splitlines()[-1].strip()
    assert hot.startswith(f"dflash.eval_temperature (1e+30) is above {MAX_EVAL_TEMPERATURE:g}: τ_sampled measures")
    # set through `dllm.overrides`: the line names the key where it was written
    assert refused("dflash.draft_variant=dflash2", "dllm.overrides={dflash: {conv_kernel_size: 9}}").startswith(
        "dllm.overrides.dflash.conv_kernel_size (9) is larger than dflash.block_size (8)"
    )


def test_a_default_eval_key_that_does_not_fit_short_rows_still_loads():
    """The defaults (16 prompts of 16 tokens, 48 new ones) are kept on a short config, as every recorded config
    reloads them, and so is anything less: only a value beyond them is held to the rows and the target's context."""
    short = ["data.seq_len=32", "dflash.block_size=4", "eval.val_rows=8", "eval.sample_length=16"]
    spec = load_config(CONFIG, short)
    assert (spec.dflash.eval_prompts, spec.dflash.eval_max_new_tokens) == (16, 48)
    assert validate_config(spec.model_dump(mode="json")) == spec  # as `resume` and a torchrun rank reload it
    # less than a default never fails where the default passes: fewer prompts, a shorter prompt or continuation
    for fewer in ("dflash.eval_prompts=9", "dflash.eval_prompt_len=8", "dflash.eval_max_new_tokens=40"):
        assert load_config(CONFIG, [*short, fewer])
    with pytest.raises(ConfigError, match=r"^dflash\.eval_prompts \(17\) is more than the 8 validation rows"):
        load_config(CONFIG, [*short, "dflash.eval_prompts=17"])
    with pytest.raises(
        ConfigError, match=r"^dflash\.eval_prompt_len \(16 tokens\) \+ dflash\.eval_max_new_tokens \(49\)"
    ):
        load_config(CONFIG, [*short, "dflash.eval_max_new_tokens=49"])


def _local_target(folder: Path, **config) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(folder)


def test_a_local_targets_config_bounds_the_top_k_the_layers_and_the_context(tmp_path):
    target = _local_target(tmp_path / "t", vocab_size=100, num_hidden_layers=4, max_position_embeddings=40)
    local = [f"dflash.target_model_id={target}", "dflash.eval_prompt_len=8", "dflash.eval_max_new_tokens=32"]
    assert load_config(CONFIG, [*local, "dflash.distill_top_k=100", "dflash.target_layer_ids=[0,3]"])
    cases = {
        "dflash.distill_top_k=101": rf"^dflash\.distill_top_k \(101\) .* vocabulary of 100 tokens \(vocab_size in the "
        rf"config\.json of dflash\.target_model_id {re.escape(target)}\)",
        "dflash.target_layer_ids=[1,4]": r"^dflash\.target_layer_ids \[1, 4\]: \[4\] are not target layers; give layer "
        r"ids in 0 … 3",
        "dllm.mask_token_id=100": r"^dllm\.mask_token_id \(100\) is outside the target's vocabulary of 100 tokens",
        "dflash.eval_max_new_tokens=57": r"^dflash\.eval_prompt_len \(8 tokens\) \+ dflash\.eval_max_new_tokens \(57\) "
        r"= 65 positions, more than the context of dflash\.target_model_id",
    }
    for bad, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(CONFIG, [*local, bad])


def test_an_imported_drafts_block_bounds_the_tree_branches(tmp_path):
    from strategies.dflash.config import CONFIG as DRAFT_CONFIG
    from strategies.dflash.config import write_json

    folder = tmp_path / "draft"
    folder.mkdir()
    write_json(folder / DRAFT_CONFIG, tiny_draft_config(hidden_size=128).to_zlab())  # block 4
    imported = ["model.kind=pretrained", f"model.path={folder}", "dflash.block_size=0"]
    assert load_config(CONFIG, [*imported, "dflash.eval_tree_branches=3"]).dflash.eval_tree_branches == 3
    with pytest.raises(
        ConfigError, match=r"^dflash\.eval_tree_branches \(4\) is more than a block of 4 \(the draft's at"
    ):
        load_config(CONFIG, [*imported, "dflash.eval_tree_branches=4"])


# ---------------------------------------------------------------------------------------- known only at run time


def test_a_draft_config_refuses_a_kernel_longer_than_its_block():
    with pytest.raises(ValueError, match=r"conv_kernel_size \(5\) is larger than block_size \(4\)"):
        tiny_draft_config(variant="dflash2", conv_kernel_size=5, conv_group_size=8, selector_top_k=4)
    assert tiny_draft_config(variant="dflash2", conv_kernel_size=4, conv_group_size=8, selector_top_k=4)


def test_the_strategy_refuses_a_top_k_past_the_targets_vocabulary_before_any_step():
    """A vocabulary the config does not tell (a hub or GGUF target, a pretrained tokenizer) is the draft's at setup:
    `distill_top_k` above it is one line naming the key, not `selected index k out of range` at the first step."""
    import torch

    from strategies.dflash.draft import DFlashDraftModel
    from strategies.dflash.options import DFlashOptions
    from tasks.speculative.setup import draft_strategy
    from tests.stagekit import tiny_dflash_target

    torch.manual_seed(0)
    target, draft = tiny_dflash_target(), DFlashDraftModel(tiny_draft_config())  # 64 tokens
    assert draft_strategy("dflash", DFlashOptions(block_size=4, distill_top_k=64), draft, target, mask_token_id=63)
    with pytest.raises(ValueError, match=r"^dflash\.distill_top_k \(65\) is more than the target's vocabulary of 64"):
        draft_strategy("dflash", DFlashOptions(block_size=4, distill_top_k=65), draft, target, mask_token_id=63)


# ---------------------------------------------------------------------------------------- dllm-flow generate


def _parse(*tree):
    from flows.cli import build_parser

    return build_parser().parse_args(["generate", "--checkpoint", "c", "--prompt", "p", *tree])


def test_generate_parses_tree_branches_within_the_configs_bound_only(capsys):
    assert _parse("--tree-branches", str(MAX_TREE_BRANCHES)).tree_branches == MAX_TREE_BRANCHES
    assert _parse().tree_branches == 0
    for bad in (str(MAX_TREE_BRANCHES + 1), "1000", "-1", "two"):
        with pytest.raises(SystemExit) as exit_:
            _parse("--tree-branches", bad)
        assert exit_.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("dllm-flow generate: error: argument --tree-branches: "), line
        assert ("is not a whole number" if bad == "two" else f"{bad} is outside 0..{MAX_TREE_BRANCHES}") in line
    with pytest.raises(ConfigError, match="eval_tree_branches"):  # the config's key: the same constant
        load_config(CONFIG, ["dflash.block_size=20", f"dflash.eval_tree_branches={MAX_TREE_BRANCHES + 1}"])


def test_generate_refuses_more_branches_than_the_drafts_block_has_positions(tmp_path):
    from strategies.sampling import SamplerConfig
    from tasks.commands.generate import Request, check_request, check_tree_branches, load_redraft

    draft = SimpleNamespace(config=tiny_draft_config())  # block 4: 3 positions after the anchor
    check_tree_branches(draft, 3)
    message = (
        r"^--tree-branches \(4\) is more than a block of 4 \(the draft's\) has proposed positions: each branch puts "
        r"the draft's runner-up at one of its 3 positions after the anchor; set it to at most 3, or 0 for no tree$"
    )
    with pytest.raises(ValueError, match=message):
        check_tree_branches(draft, 4)
    with pytest.raises(
        ValueError, match=rf"^--tree-branches \({MAX_TREE_BRANCHES + 1}\) is more than {MAX_TREE_BRANCHES}, the most"
    ):
        check_tree_branches(SimpleNamespace(config=tiny_draft_config(block_size=32)), MAX_TREE_BRANCHES + 1)

    def tokenizer(text, add_special_tokens=False):
        return {"input_ids": [int(t) for t in text.split()]}

    loaded = SimpleNamespace(model=draft, tokenizer=tokenizer)
    request = Request("3 1", "speculative", SamplerConfig(max_new_tokens=8, tree_branches=4))
    with pytest.raises(ValueError, match=message):
        check_request(loaded, request)
    with pytest.raises(ValueError, match=message):  # before the second draft is looked for
        load_redraft(str(tmp_path / "absent"), loaded, "speculative", request.config, tmp_path, None, "cpu")


def test_the_feature_cache_refuses_a_top_k_past_the_recorded_targets_vocabulary(tmp_path):
    """A hub or GGUF target's vocabulary is known once its stage recorded it: cache_target refuses the top-k there,
    before building anything, where torch's `selected index k out of range` came mid-cache."""
    from tasks.common import StageRef
    from tasks.speculative.cache_target import cache_target

    spec = load_config(CONFIG, ["dflash.distill_top_k=100"])  # fits the embedded 2048 tokens: loads
    target = StageRef("target", "t" * 16, str(tmp_path), info={"vocab_size": 64, "source": "org/tiny-target"})
    data = StageRef("prepare_data", "d" * 16, str(tmp_path))
    with pytest.raises(ConfigError) as err:
        cache_target(spec, target, data, str(tmp_path / "w"))
    assert str(err.value) == (
        "dflash.distill_top_k (100) is more than the target's vocabulary of 64 tokens (org/tiny-target: its config's "
        "vocab_size): the soft label keeps the target's k most probable next tokens (0: hard labels); set it to at "
        "most 64"
    )
    assert not (tmp_path / "w").exists()  # nothing built
