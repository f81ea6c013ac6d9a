"""DFlash's draft against its target (docs/strategies.md §10, §14): no leakage from the context at or after an
anchor, packed rows confined to their documents, speculative decoding = greedy, the context lookup, copy hints and the
draft's checkpoint."""

import copy
import dataclasses
import json
from dataclasses import replace

import pytest
import torch
from dflashkit import _ctx, _loss, _strategy
from stagekit import dflash_pair

import strategies.dflash.decoding as dflash_decoding
from strategies import Microbatch
from strategies.dflash.blocks import (
    LOOKUP_MAX_NGRAM,
    copy_hints,
    sample_anchor_blocks,
)
from strategies.dflash.decoding import context_lookup, greedy_generate, speculative_generate
from strategies.dflash.draft import DFlashDraftModel, draft_block_logits, target_features
from strategies.dflash.loss import (
    acceptance_from_correct,
)

MASK = 63


@pytest.fixture(scope="module")
def pair():
    """A frozen 5-layer target and a 2-layer draft (tests/stagekit.py: dflash_pair)."""
    return dflash_pair()


@pytest.mark.parametrize("n_blocks", [1, 3])
def test_no_leakage_from_context_at_or_after_the_anchor(pair, n_blocks):
    """docs/reference-differences.md G1 fixed: perturbing target features at positions ≥ each block's anchor
    leaves its logits unchanged."""
    target, draft = pair
    x = torch.randint(0, 60, (1, 24), generator=torch.Generator().manual_seed(2))
    feats, _, _ = target_features(target, x, draft.config.target_layer_ids)
    blocks = sample_anchor_blocks(
        x,
        torch.ones_like(x),
        None,
        block_size=4,
        num_blocks=n_blocks,
        mask_token_id=MASK,
        generators=[torch.Generator().manual_seed(5)],
    )
    with torch.no_grad():
        base = draft_block_logits(draft, target, feats, blocks.anchors, blocks.keep, blocks.block_ids)
        for n in range(n_blocks):
            anchor = int(blocks.anchors[0, n])
            poked = feats.clone()
            poked[:, anchor:] += 5 * torch.randn_like(poked[:, anchor:])
            moved = draft_block_logits(draft, target, poked, blocks.anchors, blocks.keep, blocks.block_ids)
            assert torch.allclose(moved[0, n * 4 : (n + 1) * 4], base[0, n * 4 : (n + 1) * 4], atol=1e-5)
            earlier = feats.clone()
            earlier[:, : max(anchor - 1, 1)] += 5.0
            assert not torch.allclose(
                draft_block_logits(draft, target, earlier, blocks.anchors, blocks.keep, blocks.block_ids)[
                    0, n * 4 : (n + 1) * 4
                ],
                base[0, n * 4 : (n + 1) * 4],
            )  # the context before it is read


def test_packed_rows_confine_each_block_to_its_document(pair):
    """Packed pretraining rows (`doc_starts`): a block predicts only tokens of its anchor's document, and its
    logits do not move when the previous document's context does; without document ids they do (the reference's
    dLLM recipe)."""
    target, draft = pair
    x = torch.randint(0, 60, (1, 24), generator=torch.Generator().manual_seed(2))
    docs = torch.tensor([[0] * 10 + [1] * 14])
    feats, _, _ = target_features(target, x, draft.config.target_layer_ids)

    def blocks_for(document_ids):
        gens = [torch.Generator().manual_seed(11)]
        return sample_anchor_blocks(
            x, torch.ones_like(x), None, block_size=4, num_blocks=6, mask_token_id=MASK, generators=gens,
            document_ids=document_ids,
        )  # fmt: skip

    blocks, plain = blocks_for(docs), blocks_for(None)
    assert torch.equal(blocks.anchors, plain.anchors) and bool(blocks.keep.all())
    anchors = blocks.anchors[0].tolist()
    assert min(anchors) < 7 < 10 <= max(anchors)  # blocks in both documents, some crossing the boundary
    for n, a in enumerate(anchors):
        for k in range(1, 4):
            expected = float(a + k < 24 and int(docs[0, min(a + k, 23)]) == int(docs[0, a]))
            assert float(blocks.block_mask[0, n * 3 + k - 1]) == expected
            assert float(plain.block_mask[0, n * 3 + k - 1]) == float(a + k < 24)
    poked = feats.clone()
    poked[:, :10] += 5.0  # the first document's context
    with torch.no_grad():
        for document_ids, leaks in ((docs, False), (None, True)):
            args = (blocks.anchors, blocks.keep, blocks.block_ids, document_ids)
            base = draft_block_logits(draft, target, feats, *args)
            moved = draft_block_logits(draft, target, poked, *args)
            for n, a in enumerate(anchors):
                rows = slice(n * 4, (n + 1) * 4)
                if a >= 10:  # anchored in the second document
                    assert torch.allclose(moved[0, rows], base[0, rows], atol=1e-5) != leaks
                else:
                    assert not torch.allclose(moved[0, rows], base[0, rows])  # its own document's context


def test_packed_splits_reach_the_dflash_step_as_document_ids(pair):
    """`doc_starts` of a packed split become per-row document numbers on each micro-batch, which DFlash uses
    unless `dflash.document_mask` is off."""
    from tasks.training.runtime import Split

    target, draft = pair
    ids = torch.randint(0, 60, (4, 24), generator=torch.Generator().manual_seed(3))
    starts = torch.zeros_like(ids, dtype=torch.uint8)
    starts[:, 0], starts[0, 9], starts[2, 15] = 1, 1, 1
    split = Split(
        ids, torch.ones_like(ids, dtype=torch.uint8), torch.ones_like(ids, dtype=torch.uint8), "train", starts
    )
    (mb,) = split.microbatches(torch.arange(4), 4, "cpu")
    assert torch.equal(mb.document_ids, starts.long().cumsum(dim=1))
    assert split.head(2).microbatches(torch.arange(2), 2, "cpu")[0].document_ids[0, 9] == 2
    on, off = _strategy(target, draft), _strategy(target, draft, document_mask=False)
    extras = on.strategy.pre_step(_ctx(on, draft), [mb])[0][0].extras
    assert torch.equal(extras.documents, mb.document_ids)
    assert off.strategy.pre_step(_ctx(off, draft), [mb])[0][0].extras.documents is None
    plain = off.strategy.pre_step(_ctx(off, draft), [mb])[0][0].extras
    assert torch.equal(extras.anchors, plain.anchors)
    assert extras.block_mask.sum() <= plain.block_mask.sum()
    assert _loss(on, draft, mb)[0].total_loss.item() != _loss(off, draft, mb)[0].total_loss.item()


def test_teacher_forced_acceptance_keeps_blocks_inside_documents(pair):
    """Evaluation's τ_sim on packed validation rows scores each block inside its document, as training does:
    with a boundary every 3 tokens, a block whose first target lies in the next document is not scored."""
    from dllm_common.config import EvalConfig
    from tasks.speculative.acceptance import teacher_forced_acceptance

    target, draft = pair
    built = _strategy(target, draft)
    ids = torch.randint(0, 60, (16, 24), generator=torch.Generator().manual_seed(3))
    val = (ids, torch.ones(16, 24), torch.ones_like(ids))
    docs = (torch.arange(24) // 3).expand(16, -1)
    settings = EvalConfig(batch_size=8)
    plain = teacher_forced_acceptance(built.strategy, draft, val, MASK, settings)
    packed = teacher_forced_acceptance(built.strategy, draft, val, MASK, settings, docs)
    assert plain[2] == 16 * 3  # every block scored without documents
    assert 0 < packed[2] < plain[2]


def test_speculative_decoding_equals_target_greedy(pair):
    target, draft = pair
    for prompt in ([1, 2, 3], [5, 9, 9, 4, 2, 7]):
        spec = speculative_generate(target, draft, prompt, max_new_tokens=20)
        assert spec.tokens == greedy_generate(target, prompt, 20)
        assert 1 <= spec.tau <= draft.config.block_size and len(spec.acceptance) == spec.target_forwards - 1


def test_context_lookup_proposes_what_followed_the_longest_recurring_suffix():
    """The longest suffix (4 tokens down to `min_ngram`) that occurred before, its latest occurrence, and at
    most `count` tokens after it; nothing when no suffix of the allowed lengths recurs."""
    h = [7, 1, 2, 3, 9, 8, 5, 1, 2, 3, 4, 6, 0, 2, 3]
    # suffix [2, 3] recurs at indices 2-3 and 8-9; [0, 2, 3] does not: the latest 2-gram match wins
    assert context_lookup(h, 2, 3) == [4, 6, 0]
    assert context_lookup(h, 3, 3) == []  # no 3-gram suffix recurs
    assert context_lookup([5, 1, 2, 3, 4, 1, 2, 3], 1, 2) == [4, 1]  # the 3-gram [1, 2, 3] beats shorter ones
    assert context_lookup([1, 2, 3, 2], 1, 5) == [3, 2]  # a 1-gram, cut at the end of the history
    assert context_lookup([4, 4], 1, 3) == [4]
    assert context_lookup([4], 1, 3) == [] and context_lookup([1, 2, 3], 1, 3) == []


def test_speculative_decoding_with_the_context_lookup_keeps_the_targets_output(pair):
    """Greedy: the output is target-only greedy token for token, and on text that repeats itself the lookup
    is used and commits more per cycle than the draft alone. Sampling: the first two tokens still follow the
    target's distribution (a point-mass proposal through the same rejection step)."""
    from scipy.stats import chisquare

    target, draft = pair
    for prompt in ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [5, 9, 9, 4, 2, 7]):
        spec = speculative_generate(target, draft, prompt, max_new_tokens=20, lookup_ngram=1)
        assert spec.tokens == greedy_generate(target, prompt, 20)
    # this untrained target falls into a loop (… 29 57 29 57 …): text that repeats itself, as small LMs write
    looping = [3, 1, 4] + greedy_generate(target, [3, 1, 4], 12)
    spec = speculative_generate(target, draft, looping, max_new_tokens=12, lookup_ngram=2)
    alone = speculative_generate(target, draft, looping, max_new_tokens=12)
    assert spec.tokens == alone.tokens == greedy_generate(target, looping, 12)
    assert spec.lookups > 0 and spec.tau > alone.tau
    prompt = [1, 2, 1, 2, 1]  # the 1-gram [1] recurs: the first cycle proposes [2, 1, ...] from the context
    with torch.no_grad():
        p1 = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        rows = torch.cat([torch.tensor([prompt]).expand(64, -1), torch.arange(64)[:, None]], dim=1)
        p2 = (p1[:, None] * torch.softmax(target(input_ids=rows).logits[:, -1], -1)).sum(0)
    g, n, counts, used = torch.Generator().manual_seed(0), 1500, torch.zeros(2, 64), 0
    for _ in range(n):
        out = speculative_generate(target, draft, prompt, 3, temperature=1.0, generator=g, lookup_ngram=1)
        counts[0, out.tokens[0]] += 1
        counts[1, out.tokens[1]] += 1
        used += out.lookups
    assert used > 0
    for seen, probs in ((counts[0], p1), (counts[1], p2)):
        assert chisquare(seen.numpy(), (probs.double() / probs.double().sum() * n).numpy()).pvalue > 1e-4


def test_copy_hints_are_the_context_lookups_proposals_at_every_anchor():
    """`copy_hints` (vectorized, for training) against `context_lookup` (the decoder's loop) element by element:
    at every anchor of random rows over 3 tokens, for several block sizes, the hinted tokens are the lookup's
    proposals (n = 1) and the length is the longest recurring suffix's; nothing at the anchor itself. With
    document ids (random contiguous documents) the history is the anchor's document up to the anchor, as only
    it is visible to the block."""
    g = torch.Generator().manual_seed(0)
    for length, bs in ((2, 2), (5, 4), (17, 3), (30, 4), (30, 6)):
        x = torch.randint(0, 3, (3, length), generator=g)
        docs = (torch.rand(3, length, generator=g) < 0.2).long().cumsum(1)
        for documents in (None, docs):
            hints = copy_hints(x, torch.arange(length)[None].repeat(3, 1), bs, -1, documents)
            for b in range(3):
                for a in range(length):
                    start = 0 if documents is None else int((docs[b] == docs[b, a]).nonzero()[0])
                    history = x[b, start : a + 1].tolist()
                    found = context_lookup(history, 1, bs - 1)
                    n = max((k for k in range(1, LOOKUP_MAX_NGRAM + 1) if context_lookup(history, k, 1)), default=0)
                    pad = bs - 1 - len(found)
                    assert hints.ids[b, a * bs : (a + 1) * bs].tolist() == [-1, *found] + [-1] * pad
                    assert hints.lengths[b, a * bs : (a + 1) * bs].tolist() == [0] + [n] * len(found) + [0] * pad
    bs, x, anchor = 4, torch.tensor([[1, 2, 3, 1, 2, 3]]), torch.tensor([[5]])
    assert copy_hints(x, anchor, bs, -1).ids.tolist() == [[-1, 1, 2, 3]]  # "1 2 3" recurs: copy what followed
    assert copy_hints(x, anchor, bs, -1, torch.tensor([[0, 0, 0, 1, 1, 1]])).lengths.tolist() == [[0, 0, 0, 0]]
    x, docs = torch.tensor([[8, 7, 7, 8, 7]]), torch.tensor([[0, 0, 1, 1, 1]])
    inside = copy_hints(x, torch.tensor([[4]]), bs, -1, docs)  # "8 7" recurs only across the boundary
    assert inside.ids.tolist() == [[-1, 8, 7, -1]] and inside.lengths.tolist() == [[0, 1, 1, 0]]
    assert copy_hints(x, torch.tensor([[4]]), bs, -1).lengths.tolist() == [[0, 2, 2, 2]]


def test_a_copy_hint_draft_starts_as_the_plain_draft_and_requires_its_hints(pair):
    """The hint's projection and length embedding start at zero, so a new copy-hint draft computes what the
    plain draft with the same weights computes; called without hints it says what is missing."""
    target, draft = pair
    hinted = DFlashDraftModel(replace(draft.config, copy_hint=True))
    missing, _ = hinted.load_state_dict(draft.state_dict(), strict=False)
    assert sorted(missing) == ["hint_length.weight", "hint_proj.weight"]
    ids = torch.randint(0, 6, (2, 16), generator=torch.Generator().manual_seed(4))  # 6 tokens: suffixes recur
    feats, _, _ = target_features(target, ids, list(draft.config.target_layer_ids))
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    blocks = sample_anchor_blocks(
        ids, torch.ones_like(ids), None, block_size=4, num_blocks=3, mask_token_id=MASK, generators=gens
    )
    args = (feats, blocks.anchors, blocks.keep, blocks.block_ids)
    hints = copy_hints(ids, blocks.anchors, 4, MASK)
    assert int(hints.lengths.count_nonzero()) > 0
    with torch.no_grad():
        assert torch.allclose(
            draft_block_logits(hinted, target, *args, hints=hints), draft_block_logits(draft, target, *args)
        )
        with pytest.raises(ValueError, match="copy hints"):
            draft_block_logits(hinted, target, *args)


def test_decoding_gives_a_copy_hint_draft_the_hints_and_logits_training_computes(pair, monkeypatch):
    """Every decoding cycle of a copy-hint draft (non-zero hint weights) against the training path on the
    finished text: the same anchor token, the hints `copy_hints` computes at that anchor over the whole row,
    and the same logits from full-sequence target features. Greedy equality alone would not see a hint
    taken one position off."""
    target, draft = pair
    hinted = DFlashDraftModel(replace(draft.config, copy_hint=True))
    hinted.load_state_dict(draft.state_dict(), strict=False)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        hinted.hint_proj.weight.normal_(0, 0.3, generator=g)
        hinted.hint_length.weight.normal_(0, 0.3, generator=g)
    cycles, plain = [], dflash_decoding.draft_block_logits

    def recording(draft_, target_, ctx, anchors, keep, block_ids, hints=None):
        logits = plain(draft_, target_, ctx, anchors, keep, block_ids, hints=hints)
        cycles.append((int(anchors[0, 0]), int(block_ids[0, 0]), hints, logits))
        return logits

    monkeypatch.setattr(dflash_decoding, "draft_block_logits", recording)
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5, 3, 1]
    out = speculative_generate(target, hinted.eval(), prompt, 30)
    row = torch.tensor([prompt + out.tokens])
    feats, _, _ = target_features(target, row, list(draft.config.target_layer_ids))
    assert len(cycles) > 5 and sum(int(h.lengths.count_nonzero() > 0) for _, _, h, _ in cycles) > 5
    for anchor, token, hints, logits in cycles:
        assert int(row[0, anchor]) == token
        again = copy_hints(row, torch.tensor([[anchor]]), 4, MASK)
        assert torch.equal(again.ids, hints.ids) and torch.equal(again.lengths, hints.lengths)
        block = torch.tensor([[token, MASK, MASK, MASK]])
        with torch.no_grad():
            trained = plain(
                hinted, target, feats, torch.tensor([[anchor]]), torch.ones(1, 1, dtype=torch.bool), block, hints=again
            )
        torch.testing.assert_close(trained, logits, rtol=1e-5, atol=1e-5)


def test_a_copy_hint_draft_learns_to_copy_faster_than_the_plain_draft(pair):
    """Rows that repeat a fresh random 6-token pattern four times: after the first pass every token is given by
    the text itself. Same steps, data and seed: the copy-hint draft's held-out loss ends well below the plain
    draft's (which can only learn to copy through attention), and it relies on its hint: withheld (every length
    0, "nothing recurs"), its loss more than doubles. Its decoding stays target greedy. The target's head is its
    embedding scaled up, so that a draft can reach confident logits at all (a random tiny head keeps every logit
    near 0). (Measured over 4 data/init seeds: hinted ÷ plain 0.34–0.53, hinted ÷ withheld 0.36–0.40; the
    engines' draft, with its q/k norms, learns to copy through attention faster than dllm-flow's first draft did,
    so it trains at a gentler 5e-3 for 100 steps: at 1e-2 for 60 both are still on the way and the order varies.)"""
    target, draft = pair
    target = copy.deepcopy(target)
    with torch.no_grad():
        target.get_output_embeddings().weight.copy_(target.get_input_embeddings().weight * 40)
    g = torch.Generator().manual_seed(0)

    def rows(n):
        ids = torch.randint(0, 60, (n, 6), generator=g).repeat(1, 4)
        return Microbatch(ids, torch.ones_like(ids, dtype=torch.float32), torch.ones_like(ids), torch.arange(n))

    train, held = [rows(8) for _ in range(100)], rows(16)
    final, models = {}, {}
    for hint in (False, True):
        torch.manual_seed(2)
        model = DFlashDraftModel(replace(draft.config, copy_hint=hint))
        built, opt = _strategy(target, model, copy_hint=hint), torch.optim.AdamW(model.parameters(), lr=5e-3)
        for step, mb in enumerate(train):
            ctx = _ctx(built, model, step)
            batches, n, _ = built.strategy.pre_step(ctx, [mb])
            assert (batches[0].extras.hints is not None) == hint
            built.strategy.forward_backward(ctx, batches[0], num_diffusion_tokens=n, num_ar_tokens=n, is_train=True)
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            out, batches = _loss(built, model, held, step=99)
            final[hint] = float(out.total_loss)
            if hint:
                e, n = batches[0].extras, int(batches[0].extras.block_mask.sum())
                withheld = dataclasses.replace(e, hints=e.hints._replace(lengths=torch.zeros_like(e.hints.lengths)))
                batch = dataclasses.replace(batches[0], extras=withheld)
                ctx = _ctx(built, model, 99)
                final["withheld"] = float(
                    built.strategy.forward_backward(
                        ctx, batch, num_diffusion_tokens=n, num_ar_tokens=n, is_train=False
                    ).total_loss
                )
        models[hint] = model.eval()
    print(f"\n[measured] held-out loss: plain {final[False]:.3f}, copy hint {final[True]:.3f}, hint withheld "
          f"{final['withheld']:.3f}")  # fmt: skip
    assert final[True] < 0.6 * final[False] and final[True] < 0.5 * final["withheld"]
    prompt = held.input_ids[0, :9].tolist()
    assert speculative_generate(target, models[True], prompt, 16).tokens == greedy_generate(target, prompt, 16)


def test_perfect_proposals_are_all_accepted(pair, monkeypatch):
    """A draft that proposes exactly the target's greedy tokens gets τ = block size (the last cycle may cut)."""
    target, draft = pair
    prompt = [3, 1, 4]
    truth = greedy_generate(target, prompt, 40)

    def oracle(draft_, target_, ctx, anchors, keep, block_ids, hints=None):
        start = int(anchors[0, 0]) - len(prompt) + 1  # proposals follow the anchor's generated index
        logits = torch.full((1, 4, 64), -10.0)
        for j in range(1, 4):
            logits[0, j, truth[min(start + j - 1, len(truth) - 1)]] = 10.0
        return logits

    monkeypatch.setattr(dflash_decoding, "draft_block_logits", oracle)
    spec = speculative_generate(target, draft, prompt, max_new_tokens=40)
    assert spec.tokens == truth and spec.acceptance[:-1] == [4] * (len(spec.acceptance) - 1)


def test_acceptance_proxy_from_teacher_forced_correctness():
    correct = torch.tensor([[1, 1, 0, 1, 0, 1]], dtype=torch.bool)  # two blocks of bs = 4
    mask = torch.ones(1, 6)
    tau, acc = acceptance_from_correct(correct, mask, 4)
    assert tau == (3 + 2) / 2 and acc == [1.0, 0.5, 0.5]  # runs of 2 and 1 correct proposals


def test_draft_checkpoint_round_trip(pair, tmp_path):
    """A draft saves as the engines' config.json + model.safetensors and loads back equal; the copy hint is
    recorded only on a copy-hint draft; the old layout and a folder that is not a draft get one message each."""
    _, draft = pair
    hinted = DFlashDraftModel(replace(draft.config, copy_hint=True))
    torch.nn.init.normal_(hinted.hint_proj.weight)
    for model, name in ((draft, "draft"), (hinted, "hinted")):
        model.save(tmp_path / name)
        loaded = DFlashDraftModel.load(tmp_path / name)
        assert loaded.config == model.config
        assert loaded.state_dict().keys() == model.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    plain = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert plain["architectures"] == ["DFlashDraftModel"] and "dllm_copy_hint" not in plain
    assert json.loads((tmp_path / "hinted" / "config.json").read_text())["dllm_copy_hint"] is True
    with pytest.raises(FileNotFoundError, match="is not a DFlash draft"):
        DFlashDraftModel.load(tmp_path)
    old = tmp_path / "old"
    old.mkdir()
    (old / "dflash_draft.json").write_text(json.dumps({"hidden_size": 32, "num_layers": 2}))
    assert DFlashDraftModel.describes(old)
    with pytest.raises(
        ValueError,
        match=r"dllm-flow's old layout \(dflash_draft.json.*no serving engine loads.*"
        r"retrain it.*model.kind: tiny",
    ):
        DFlashDraftModel.load(old)
