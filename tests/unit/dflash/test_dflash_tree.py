"""Tree verification (`strategies.dflash.tree`, docs/strategies.md §10.16): which positions branch, what the
branches hold, which branch wins, and a decoder whose output stays the target's greedy text while it verifies
several branches per forward over copies of the target's cache."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from strategies.dflash import tree as tree_module
from strategies.dflash.decoding import greedy_generate, speculative_generate
from strategies.dflash.draft import DFlashDraftModel
from strategies.dflash.strategy import DFlashStrategy
from strategies.dflash.tree import DraftTree, marginal_branches, rejection_positions, select_branch
from strategies.options import load_config
from tasks.speculative.acceptance import speculative_benchmark, tree_acceptance
from tests.stagekit import tiny_dflash_target, tiny_draft_config

ROOT = Path(__file__).resolve().parents[3]
MASK = 63
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 8, 2, 8], [5, 3, 5, 3, 5, 3], [11, 30, 2, 40, 12, 9, 9]]


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(1)
    target = tiny_dflash_target()
    return target, DFlashDraftModel(tiny_draft_config()).eval(), DFlashDraftModel(tiny_draft_config()).eval()


def test_rejection_positions_rank_where_the_first_wrong_proposal_most_likely_falls():
    # r = [1·0.1, 0.9·0.5, 0.45·0.2] = [0.1, 0.45, 0.09]
    assert rejection_positions(torch.tensor([0.9, 0.5, 0.8]), 3) == [1, 0, 2]
    assert rejection_positions(torch.tensor([0.9, 0.5, 0.8]), 1) == [1]
    # a certain position (a looked-up token) never branches; equal scores keep the earlier position first
    assert rejection_positions(torch.tensor([1.0, 0.5, 0.0]), 3) == [1, 2]
    assert rejection_positions(torch.tensor([0.5, 0.0]), 2) == [0, 1]  # r = [0.5, 0.5]
    assert rejection_positions(torch.tensor([0.9, 0.5]), 0) == []


def test_marginal_branches_put_the_runner_up_at_each_rejection_position_and_keep_the_rest():
    # position 0: proposal 2 (p ≈ .84), runner-up 0; position 1: proposal 1 (p ≈ .42), runner-up 3; position 2: certain
    logits = torch.tensor(
        [[1.0, -5.0, 3.0, -5.0], [0.0, 1.0, -9.0, 0.9], [-1e9, -1e9, -1e9, 0.0]],
    )
    proposal = torch.tensor([2, 1, 3])
    rows, positions = marginal_branches(proposal, logits, 5)
    assert positions == [1, 0]  # r₁ = .84·.58 > r₀ = .16; r₂ = 0
    assert rows.tolist() == [[2, 1, 3], [2, 3, 3], [0, 1, 3]]
    assert marginal_branches(proposal, logits, 0)[0].tolist() == [[2, 1, 3]]


def test_select_branch_takes_the_longest_accepted_branch_and_the_earliest_on_ties():
    v, bs = 6, 4
    greedy = torch.tensor([[1, 2, 3, 4], [1, 5, 3, 0], [1, 5, 2, 3]])  # the target's choice along each row
    logits = torch.nn.functional.one_hot(greedy, v).float()
    rows = torch.tensor([[1, 2, 0], [1, 5, 0], [1, 5, 2]])
    assert select_branch(rows, logits) == (2, 3, 3)  # all three of row 2 stand; its bonus is greedy[2, 3]
    assert select_branch(rows[:2], logits[:2]) == (0, 2, 3)  # two stand in both: the earlier row
    same = torch.tensor([[1, 0, 0], [1, 0, 0]])
    assert select_branch(same, logits[:2]) == (0, 1, 2)
    assert select_branch(torch.tensor([[4, 0, 0]]), logits[:1]) == (0, 0, 1)
    assert rows.shape[1] == bs - 1


@pytest.mark.parametrize("branches,second", [(0, False), (1, False), (3, False), (2, True), (3, True)])
def test_tree_decoding_keeps_the_targets_greedy_text(pair, branches, second):
    target, draft, other = pair
    tree = DraftTree(branches, other if second else None)
    for prompt in PROMPTS:
        chain = speculative_generate(target, draft, prompt, 24)
        out = speculative_generate(target, draft, prompt, 24, tree=tree)
        assert out.tokens == greedy_generate(target, prompt, 24) == chain.tokens
        assert sum(out.acceptance) >= len(out.tokens) - 1
        # from the same first state, the tree accepts at least what the one path does
        assert out.acceptance[0] >= chain.acceptance[0]
        if branches == 0:
            assert out.acceptance == chain.acceptance and out.target_forwards == chain.target_forwards


class _OracleTree(DraftTree):
    """A tree whose last branch is the target's own greedy continuation after the anchor, so the decoder must commit
    a branch other than the proposal every cycle and carry on from that branch's cache and features."""

    def __init__(self, greedy: list[int], prompt_len: int):
        super().__init__(1)
        object.__setattr__(self, "greedy", greedy)
        object.__setattr__(self, "prompt_len", prompt_len)

    def rows(self, target, ctx, anchor, block, proposal, d_logits, **kw):
        rows = super().rows(target, ctx, anchor, block, proposal, d_logits, **kw)
        done = int(anchor[0, 0]) + 1 - self.prompt_len  # tokens committed after the prompt (no window here)
        return torch.cat([rows, torch.tensor(self.greedy[done : done + rows.shape[1]])[None]])


def test_the_decoder_commits_a_later_branch_and_continues_from_its_cache(pair):
    target, draft, _ = pair
    bs, new = draft.config.block_size, 30
    for prompt in PROMPTS:
        greedy = greedy_generate(target, prompt, new + bs)
        res = speculative_generate(target, draft, prompt, new, tree=_OracleTree(greedy, len(prompt)))
        assert res.tokens == greedy[:new]
        assert res.acceptance == [bs] * len(res.acceptance)  # every cycle took the whole oracle branch
        assert res.target_forwards == 1 + len(res.acceptance)


def test_the_second_draft_redrafts_behind_each_branchs_shown_prefix(pair, monkeypatch):
    target, draft, other = pair
    seen = []
    plain = tree_module.draft_block_logits

    def recording(model, target_, ctx, anchors, keep, block_ids, **kw):
        logits = plain(model, target_, ctx, anchors, keep, block_ids, **kw)
        seen.append((block_ids.clone(), logits[:, 1:].argmax(-1)))
        return logits

    monkeypatch.setattr(tree_module, "draft_block_logits", recording)
    tree = DraftTree(3, other)
    g = torch.Generator().manual_seed(0)
    k = draft.config.block_size - 1
    d_logits = torch.randn(k, 64, generator=g)
    proposal = d_logits.argmax(-1)
    block = torch.full((1, k + 1), MASK)
    block[0, 0] = 9
    ctx = torch.randn(1, 6, other.config.hidden_size * len(other.config.target_layer_ids), generator=g)
    rows = tree.rows(target, ctx, torch.tensor([[5]]), block, proposal, d_logits)
    base, positions = marginal_branches(proposal, d_logits, 3)
    assert rows[0].tolist() == proposal.tolist() and len(seen) == 1
    shown, redrafted = seen[0]
    todo = [(i + 1, j) for i, j in enumerate(positions) if j < k - 1]
    assert shown.shape[0] == len(todo) > 0
    for r, (i, j) in enumerate(todo):
        assert shown[r, 0] == 9 and shown[r, 1 : j + 2].tolist() == base[i, : j + 1].tolist()
        assert (shown[r, j + 2 :] == MASK).all()
        assert rows[i, : j + 1].tolist() == base[i, : j + 1].tolist()
        assert rows[i, j + 1 :].tolist() == redrafted[r, j + 1 :].tolist()


def test_tree_refusals_name_what_to_change(pair):
    target, draft, _ = pair
    with pytest.raises(ValueError, match="greedy only"):
        speculative_generate(target, draft, PROMPTS[0], 8, temperature=1.0, tree=DraftTree(2))
    with pytest.raises(ValueError, match="must be ≥ 0"):
        speculative_generate(target, draft, PROMPTS[0], 8, tree=DraftTree(-1))
    with pytest.raises(
        ValueError, match=r"^tree branches \(4\) is more than a block of 4 \(the draft's\) has proposed"
    ):
        speculative_generate(target, draft, PROMPTS[0], 8, tree=DraftTree(4))  # block 4: 3 positions to branch at
    wider = DFlashDraftModel(tiny_draft_config(block_size=8)).eval()
    with pytest.raises(ValueError, match="block_size 8 where the proposing draft has 4"):
        speculative_generate(target, draft, PROMPTS[0], 8, tree=DraftTree(2, wider))
    hinted = DFlashDraftModel(replace(draft.config, copy_hint=True)).eval()
    with pytest.raises(ValueError, match="copy_hint"):
        speculative_generate(target, draft, PROMPTS[0], 8, tree=DraftTree(2, hinted))


def test_the_evaluations_tree_tau_is_the_tree_decoders_paired_against_the_one_path(pair):
    target, draft, _ = pair
    one_path = speculative_benchmark(target, draft, PROMPTS, 16, None)
    out = tree_acceptance(target, draft, PROMPTS, 16, None, 2, 0, one_path, seed=3)
    expected = [speculative_generate(target, draft, p, 16, tree=DraftTree(2)).acceptance for p in PROMPTS]
    assert out["acceptance"] == expected and out["exact_match"] == 1.0 and out["branches"] == 2
    assert out["tau"] == pytest.approx(sum(map(sum, expected)) / sum(map(len, expected)))
    assert out["gain"] == pytest.approx(out["tau"] - one_path["tau"]) and out["gain_low"] <= out["gain_high"]


def test_eval_tree_branches_keys_the_evaluation_only_and_is_unwritten_at_zero():
    key, value = "eval_tree_branches", "2"
    base = load_config(ROOT / "configs" / "dflash.yaml")
    tree = load_config(ROOT / "configs" / "dflash.yaml", [f"dflash.{key}={value}"])
    assert key not in base.dflash.model_dump(mode="json")  # the digest of an older config holds
    assert tree.dflash.model_dump(mode="json")[key] == int(value)
    assert DFlashStrategy.train_settings(tree) == DFlashStrategy.train_settings(base)
    assert DFlashStrategy.eval_settings(tree) != DFlashStrategy.eval_settings(base)
    with pytest.raises(ValueError, match=key):
        load_config(ROOT / "configs" / "dflash.yaml", [f"dflash.{key}=-1"])


def test_generate_verifies_the_tree_it_is_given_and_keeps_the_text(pair):
    """`dllm-flow generate --tree-branches K [--redraft CKPT]`: the request's tree reaches the decoder and the text is
    the one-path decoder's; a temperature, or a second draft that reads other blocks, is refused by `check_request`
    before any decoding."""
    from types import SimpleNamespace

    from strategies.sampling import SamplerConfig
    from tasks.commands.generate import Request, _speculative, check_request, speculation_tree

    target, draft, other = pair

    def tokenizer(text, add_special_tokens=False):
        return {"input_ids": [int(t) for t in text.split()]}

    tokenizer.decode, tokenizer.eos_token_id = (lambda ids: " ".join(map(str, ids))), None
    loaded = SimpleNamespace(model=draft, tokenizer=tokenizer, strategy=SimpleNamespace(target=target))
    plain = Request("3 1 4 1 5", "speculative", SamplerConfig(max_new_tokens=20))
    tree = Request("3 1 4 1 5", "speculative", SamplerConfig(max_new_tokens=20, tree_branches=3), redraft=other)
    assert speculation_tree(plain) is None and speculation_tree(tree) == DraftTree(3, other)
    ids = check_request(loaded, tree)
    one = _speculative(loaded, ids, plain.config, None, 0, speculation_tree(plain))
    branched = _speculative(loaded, ids, tree.config, None, 0, speculation_tree(tree))
    assert branched.text == one.text == " ".join(map(str, greedy_generate(target, ids, 20)))
    hot = Request("3 1", "speculative", SamplerConfig(max_new_tokens=8, tree_branches=2, temperature=0.7))
    with pytest.raises(ValueError, match=r"greedy only: decode at temperature 0 \(--temperature 0; got 0.7\)"):
        check_request(loaded, hot)
    wide = DFlashDraftModel(tiny_draft_config(block_size=8)).eval()
    mismatched = Request("3 1", "speculative", SamplerConfig(max_new_tokens=8, tree_branches=2), redraft=wide)
    with pytest.raises(ValueError, match="block_size 8 where the proposing draft has 4"):
        check_request(loaded, mismatched)


def test_every_cycle_reads_the_committed_features_after_a_branch_other_than_the_proposal(pair, monkeypatch):
    """The cache and features the decoder carries on with are the winning branch's: at every cycle the draft's
    context equals the target's features of prompt + output up to the anchor, and the anchor is the last committed
    token — with the oracle branch taken every cycle, with marginal and re-drafted branches, and with the lookup."""
    from strategies.dflash import decoding
    from strategies.dflash.draft import target_features

    target, draft, other = pair
    seen, plain = [], decoding.draft_block_logits

    def recording(model, target_, ctx, anchors, keep, block_ids, **kw):
        seen.append((ctx.clone(), int(anchors[0, 0]), int(block_ids[0, 0]), kw.get("offset", 0)))
        return plain(model, target_, ctx, anchors, keep, block_ids, **kw)

    monkeypatch.setattr(decoding, "draft_block_logits", recording)
    for prompt in PROMPTS[:2]:
        greedy = greedy_generate(target, prompt, 40)
        for tree, lookup in ((_OracleTree(greedy, len(prompt)), 0), (DraftTree(3), 2), (DraftTree(2, other), 0)):
            seen.clear()
            out = speculative_generate(target, draft, prompt, 30, tree=tree, lookup_ngram=lookup)
            row = torch.tensor([prompt + out.tokens])
            feats, _, _ = target_features(target, row, list(draft.config.target_layer_ids))
            assert len(seen) == len(out.acceptance) > 3
            for ctx, anchor, token, offset in seen:
                assert offset == 0 and token == int(row[0, anchor])
                assert torch.allclose(ctx, feats[:, :anchor], atol=1e-5)
