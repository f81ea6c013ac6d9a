"""DFlash pieces (docs/strategies.md §5.7, §6.2, §10, §14): layer ids, anchors, the mask against an element-wise
reference (dense and flex), the decay and D-PACE losses by hand, D-PACE's split invariance (micro-batches and
gloo ranks), leakage, and speculative decoding = greedy."""

import copy
import dataclasses
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from rankkit import run_ranks
from stagekit import tiny_dflash_target, tiny_draft_config
from torch.nn.attention.flex_attention import create_mask

import strategies.dflash.decoding as dflash_decoding
from strategies import Microbatch, SetupContext, StepContext, assemble_strategy
from strategies.base import global_sum
from strategies.dflash.blocks import (
    LOOKUP_MAX_NGRAM,
    build_dflash_mask_mod,
    build_target_layer_ids,
    copy_hints,
    create_dflash_block_mask,
    create_dflash_sdpa_mask,
    sample_anchor_blocks,
)
from strategies.dflash.decoding import context_lookup, greedy_generate, speculative_generate
from strategies.dflash.draft import DFlashDraftModel, draft_block_logits, target_features
from strategies.dflash.features import CachedFeatures, OnlineFeatures, write_feature_cache
from strategies.dflash.loss import (
    DFlashDecayLoss,
    DFlashDPACELoss,
    SoftLabels,
    acceptance_from_correct,
    block_soft_labels,
    dpace_weights,
    scored_blocks,
    top_k_labels,
)
from strategies.dflash.strategy import DFlashBlocks, DFlashStrategy
from strategies.options import DFlashOptions

MASK = 63


def test_target_layer_ids_examples_and_errors():
    assert build_target_layer_ids(12, 1) == [6]
    assert build_target_layer_ids(12, 3) == [1, 5, 9]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(5, 2) == [1, 2]
    # every draft layer reads a distinct target layer among 1 … T − 3 (4 target layers for 8 draft layers used to
    # give [1] * 8)
    for target, draft, need in ((3, 2, 5), (4, 2, 5), (4, 8, 11)):
        with pytest.raises(ValueError, match=f"needs a target with at least {need} layers"):
            build_target_layer_ids(target, draft)


def reference_visible(anchors, keep, s, bs, causal, docs=None):
    bsz, n = anchors.shape
    out = torch.zeros(bsz, n * bs, s + n * bs, dtype=torch.bool)
    for b in range(bsz):
        for q in range(n * bs):
            blk, off = divmod(q, bs)
            for k in range(s + n * bs):
                if k < s:
                    a = int(anchors[b, blk])
                    same_doc = docs is None or int(docs[b, k]) == int(docs[b, a])
                    out[b, q, k] = k < a and bool(keep[b, blk]) and same_doc
                else:
                    kb, ko = divmod(k - s, bs)
                    out[b, q, k] = kb == blk and (not causal or ko <= off)
    return out


# packed rows: row 0 holds documents 0 | 1 | 2 starting at 0, 5 and 10; row 1 is one document
PACKED_DOCS = torch.tensor([[0] * 5 + [1] * 5 + [2] * 4, [0] * 14])


@pytest.mark.parametrize("docs", [None, PACKED_DOCS], ids=["one-document", "packed"])
@pytest.mark.parametrize("causal", [False, True])
def test_mask_matches_the_elementwise_reference_dense_and_flex(causal, docs):
    anchors = torch.tensor([[3, 9, 1], [12, 2, 7]])
    keep = torch.tensor([[True, True, False], [True, False, True]])
    s, bs = 14, 4
    ref = reference_visible(anchors, keep, s, bs, causal, docs)
    dense = create_dflash_sdpa_mask(anchors, keep, s, bs, dtype=torch.float32, causal=causal, document_ids=docs)
    assert dense.shape == (2, 1, 12, s + 12)
    assert torch.equal(dense[:, 0] == 0, ref) and torch.isinf(dense[:, 0][~ref]).all()
    mod = build_dflash_mask_mod(anchors, keep, s, bs, causal, docs)
    flex = create_mask(mod, 2, 1, 12, s + 12, device="cpu")
    assert torch.equal(flex[:, 0], ref)
    if docs is not None:  # block 1 of row 0 (anchor 9, document 1) sees keys 5–8 only
        assert ref[0, 4:8, :s].nonzero()[:, 1].unique().tolist() == [5, 6, 7, 8]
    block_mask = create_dflash_block_mask(anchors, keep, s, bs, causal, docs)  # the BlockMask builds on CPU too
    assert block_mask.shape[-2:] == (12, s + 12)
    assert (dense[:, 0] == 0).any(dim=-1).all()  # no all −inf row, dropped blocks included


def test_decay_loss_by_hand():
    # B=1, two blocks of bs=3 → T = 4 predicted positions, V = 2
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    targets = torch.tensor([[0, 0, 0, 1]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    nll = [math.log(2), math.log(1 + math.exp(-2)), math.log(1 + math.e), math.log(2)]
    w = [1, math.exp(-1 / 2), 1, math.exp(-1 / 2)]  # resets at each block start (γ = 2)
    num = sum(n * wi * m for n, wi, m in zip(nll, w, mask[0].tolist()))
    loss = DFlashDecayLoss(loss_gamma=2.0)
    out = loss(logits, targets, mask, num_tokens=3, block_size=3)
    assert math.isclose(out.total_loss.item(), num / 3, rel_tol=1e-6)
    assert math.isclose(loss(logits, targets, mask, block_size=3).total_loss.item(), num, rel_tol=1e-6)  # unnormalized
    mono = [math.exp(-j / 2) for j in range(4)]  # no block size: one decaying vector over all T positions
    assert math.isclose(
        loss(logits, targets, mask).total_loss.item(),
        sum(n * wi * m for n, wi, m in zip(nll, mono, mask[0].tolist())),
        rel_tol=1e-6,
    )
    mean = DFlashDecayLoss(loss_gamma=2.0, normalize="mean")(logits, targets, mask, block_size=3)
    assert math.isclose(
        mean.total_loss.item(), num / (sum(wi * m for wi, m in zip(w, mask[0].tolist())) + 1e-6), rel_tol=1e-6
    )
    flat = DFlashDecayLoss(loss_gamma=None)(logits, targets, mask, num_tokens=3)
    assert math.isclose(flat.total_loss.item(), (nll[0] + nll[1] + nll[3]) / 3, rel_tol=1e-6)
    # argmax [0 (tie → first), 0, 1, 0] vs targets [0, 0, 0, 1]: correct [1, 1, 0, 0]; blocks (pos 0, 1), (2, 3)
    # offset 1 = positions 0, 2 (mask 1, 0); offset 2 = positions 1, 3 (mask 1, 1)
    assert out.draft_correct_per_pos.tolist() == [1.0, 1.0] and out.draft_count_per_pos.tolist() == [1.0, 2.0]
    assert monotone_weights(DFlashDecayLoss(loss_gamma=7.0), 5)
    with pytest.raises(ValueError, match="normalize must be 'tokens' or 'mean', got 'sum'"):
        DFlashDecayLoss(normalize="sum")


def test_soft_label_loss_is_the_cross_entropy_to_the_targets_distribution():
    """With `soft` labels each prediction's term is −Σ_j p_j log q(id_j), hand-computed; a one-hot label on the
    true token gives the hard loss; D-PACE's weights and the accuracy still read the true token."""
    logits = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]]])
    targets = torch.tensor([[2, 0]])
    mask = torch.ones(1, 2)
    soft = SoftLabels(torch.tensor([[[2, 1], [0, 2]]], dtype=torch.int32), torch.tensor([[[0.75, 0.25], [0.5, 0.5]]]))
    lse0, lse1 = math.log(1 + math.e + math.e**2), math.log(math.e + 2)
    ce = [0.75 * (lse0 - 2) + 0.25 * (lse0 - 1), 0.5 * (lse1 - 1) + 0.5 * lse1]
    w = [1.0, math.exp(-1 / 2)]  # γ = 2, one block of 3
    loss = DFlashDecayLoss(loss_gamma=2.0)
    out = loss(logits, targets, mask, num_tokens=2, block_size=3, soft=soft)
    assert math.isclose(out.total_loss.item(), (ce[0] * w[0] + ce[1] * w[1]) / 2, rel_tol=1e-6)
    assert out.draft_correct_per_pos.tolist() == [1.0, 1.0]  # argmax 2, 0 = the true tokens
    one_hot = SoftLabels(targets[..., None].int(), torch.ones(1, 2, 1))
    hard = loss(logits, targets, mask, num_tokens=2, block_size=3)
    assert torch.allclose(
        loss(logits, targets, mask, num_tokens=2, block_size=3, soft=one_hot).total_loss, hard.total_loss
    )
    # D-PACE: the weights come from q(true token), the summed term from the soft label
    nll = torch.tensor([[lse0 - 2, lse1 - 1]])
    dp = DFlashDPACELoss(0.5)(logits, targets, mask, num_tokens=1, block_size=3, soft=soft)
    expected = (dpace_weights(nll, mask, 3, 0.5)[0] * torch.tensor(ce)).sum()
    assert math.isclose(dp.total_loss.item(), expected.item(), rel_tol=1e-5)
    # the fused, chunked head path: same value and gradients with soft labels
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 6, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    tgt, bmask = torch.randint(0, 50, (2, 6)), (torch.rand(2, 6) > 0.3).float()
    top = top_k_labels(torch.randn(2, 6, 50), 4)
    lbl = SoftLabels(top.ids, top.probs / top.probs.sum(-1, keepdim=True))
    plain = DFlashDecayLoss(4.0, chunk_size=5)(hidden @ weight.T, tgt, bmask, 7, 4, soft=lbl)
    fused = DFlashDecayLoss(4.0, chunk_size=5).forward_fused(hidden, weight, tgt, bmask, 7, 4, soft=lbl)
    assert torch.allclose(plain.total_loss, fused.total_loss, atol=1e-5)
    g_plain = torch.autograd.grad(plain.total_loss, (hidden, weight))
    g_fused = torch.autograd.grad(fused.total_loss, (hidden, weight))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_plain, g_fused))


def test_block_soft_labels_are_the_targets_distribution_one_position_back():
    """Prediction k of the anchor at A labels the token at A + k, whose distribution the target gave at
    A + k − 1: checked element by element, the first k of the stored ones, renormalized."""
    logits = torch.randn(2, 10, 30, generator=torch.Generator().manual_seed(1))
    top = top_k_labels(logits, 5)
    probs = logits.softmax(-1)
    assert torch.equal(top.ids[..., 0].long(), logits.argmax(-1))
    assert torch.allclose(top.probs, probs.gather(-1, top.ids.long()))
    anchors, bs, k = torch.tensor([[1, 4], [2, 7]]), 4, 3
    got = block_soft_labels(top, anchors, bs, k)
    for b in range(2):
        for n in range(2):
            for j in range(bs - 1):
                pos = min(int(anchors[b, n]) + j, 9)  # prediction j + 1 → position A + j, clamped to the row
                i = n * (bs - 1) + j
                assert torch.equal(got.ids[b, i], top.ids[b, pos, :k])
                assert torch.allclose(got.probs[b, i], top.probs[b, pos, :k] / top.probs[b, pos, :k].sum())
    assert torch.allclose(got.probs.sum(-1), torch.ones(2, 6))


def monotone_weights(loss, n):
    w = loss.weights(n, None, "cpu")
    return bool((w[1:] < w[:-1]).all()) and w[0] == 1


def test_fused_chunked_path_equals_the_plain_one():
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    targets = torch.randint(0, 50, (2, 6))
    mask = (torch.rand(2, 6) > 0.3).float()
    loss = DFlashDecayLoss(loss_gamma=4.0, chunk_size=5)
    plain = loss(hidden @ weight.T, targets, mask, num_tokens=7, block_size=4)
    g_plain = torch.autograd.grad(plain.total_loss, (hidden, weight))
    fused = loss.forward_fused(hidden, weight, targets, mask, num_tokens=7, block_size=4)
    g_fused = torch.autograd.grad(fused.total_loss, (hidden, weight))
    assert torch.allclose(plain.total_loss, fused.total_loss, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_plain, g_fused))
    assert torch.equal(plain.draft_correct_per_pos, fused.draft_correct_per_pos)


def test_dpace_loss_by_hand():
    """B = 1, two blocks of bs = 3 (T = 4), V = 2, α = 0.5; the third prediction is unsupervised. Per block,
    q = exp(−CE), q̃ = α + (1 − α)·q (1 where masked), C_m = Π_{k≤m} q̃_k, w_k = Σ_{m≥k} C_m (0 where masked)."""
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    targets = torch.tensor([[0, 0, 0, 1]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    nll = [math.log(2), math.log(1 + math.exp(-2)), math.log(1 + math.e), math.log(2)]
    qt = [0.5 + 0.5 * math.exp(-n) for n in nll]
    w = [qt[0] + qt[0] * qt[1], qt[0] * qt[1], 0.0, qt[3]]  # block 2: the masked slot is a no-op
    num = sum(n * wi for n, wi in zip(nll, w))
    loss = DFlashDPACELoss(alpha=0.5)
    out = loss(logits, targets, mask, num_tokens=2, block_size=3)  # 2 scored blocks
    assert math.isclose(out.total_loss.item(), num / 2, rel_tol=1e-6)
    assert torch.allclose(dpace_weights(torch.tensor([nll]), mask, 3, 0.5), torch.tensor([w]), atol=1e-7)
    assert scored_blocks(mask, 3) == 2 and scored_blocks(torch.tensor([[0.0, 0.0, 0.0, 1.0]]), 3) == 1
    # another implementation's hand-worked case (confidences 0.8, 0.5 → weights 1.575, 0.675)
    two = dpace_weights(-torch.tensor([[0.8, 0.5]]).log(), torch.ones(1, 2), 3, 0.5)
    assert torch.allclose(two, torch.tensor([[1.575, 0.675]]), atol=1e-6)
    assert out.draft_count_per_pos.tolist() == [1.0, 2.0]  # the accuracy sums are the decay loss's
    with pytest.raises(ValueError, match="alpha must be in"):
        DFlashDPACELoss(alpha=0.0)
    with pytest.raises(ValueError, match="needs the block size"):
        loss(logits, targets, mask, num_tokens=2)


def test_dpace_weights_match_an_elementwise_reference_and_carry_no_gradient():
    g = torch.Generator().manual_seed(0)
    bsz, n_blocks, bs, alpha = 2, 3, 5, 0.3
    logits = torch.randn(bsz, n_blocks * (bs - 1), 11, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (bsz, n_blocks * (bs - 1)), generator=g)
    mask = (torch.rand(bsz, n_blocks * (bs - 1), generator=g) > 0.3).float()
    nll = torch.nn.functional.cross_entropy(logits.detach().flatten(0, 1), targets.flatten(), reduction="none")
    nll = nll.view_as(targets)
    ref = torch.zeros_like(nll)
    for b in range(bsz):
        for n in range(n_blocks):
            sl = range(n * (bs - 1), (n + 1) * (bs - 1))
            for k in sl:
                if mask[b, k] == 0:
                    continue
                for m in sl:  # Σ over later supervised m of Π over supervised i ≤ m of q̃_i
                    if m < k or mask[b, m] == 0:
                        continue
                    prod = 1.0
                    for i in sl:
                        if i <= m and mask[b, i] > 0:
                            prod *= alpha + (1 - alpha) * math.exp(-float(nll[b, i]))
                    ref[b, k] += prod
    got = dpace_weights(nll, mask, bs, alpha)
    assert torch.allclose(got, ref, atol=1e-6) and not got.requires_grad
    # the weights are constants for backward: the gradient is that of Σ w·CE with w frozen
    out = DFlashDPACELoss(alpha)(logits, targets, mask, num_tokens=5, block_size=bs)
    (grad,) = torch.autograd.grad(out.total_loss, logits)
    frozen = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    (expected,) = torch.autograd.grad((frozen.view_as(targets) * ref * mask).sum() / 5, logits)
    assert torch.allclose(grad, expected, atol=1e-6)
    # the fused, chunked head path gives the same value and gradients
    hidden = torch.randn(bsz, n_blocks * (bs - 1), 6, generator=g, requires_grad=True)
    weight = torch.randn(11, 6, generator=g, requires_grad=True)
    plain = DFlashDPACELoss(alpha, chunk_size=5)(hidden @ weight.T, targets, mask, num_tokens=5, block_size=bs)
    fused = DFlashDPACELoss(alpha, chunk_size=5).forward_fused(hidden, weight, targets, mask, 5, bs)
    assert torch.allclose(plain.total_loss, fused.total_loss, atol=1e-6)
    g_plain = torch.autograd.grad(plain.total_loss, (hidden, weight))
    g_fused = torch.autograd.grad(fused.total_loss, (hidden, weight))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_plain, g_fused))


def test_anchor_blocks_follow_the_spec_and_reproduce_from_seeds():
    x = torch.arange(40).view(2, 20) % 50
    attn = torch.ones(2, 20, dtype=torch.long)
    attn[1, 7:] = 0  # row 1 is too short to train on (valid 7 ≤ 2·bs)
    gens = lambda: [torch.Generator().manual_seed(s) for s in (11, 12)]  # noqa: E731
    blocks = sample_anchor_blocks(x, attn, None, block_size=4, num_blocks=3, mask_token_id=MASK, generators=gens())
    again = sample_anchor_blocks(x, attn, None, block_size=4, num_blocks=3, mask_token_id=MASK, generators=gens())
    assert all(
        torch.equal(a, b) for a, b in zip(blocks, again)
    )  # per-row generators: resume-reproducible (docs/reference-differences.md G5)
    a = blocks.anchors
    assert ((a[0] >= 1) & (a[0] <= 16)).all()  # maxA = valid − bs
    assert blocks.keep[0].all() and not blocks.keep[1].any()
    for n in range(3):
        anchor = int(a[0, n])
        assert blocks.block_ids[0, n * 4] == x[0, anchor] and (blocks.block_ids[0, n * 4 + 1 : n * 4 + 4] == MASK).all()
        assert blocks.targets[0, n * 3 : n * 3 + 3].tolist() == x[0, anchor + 1 : anchor + 4].tolist()
    assert (blocks.block_ids[1] == MASK).all() and (blocks.block_mask[1] == 0).all()


def test_non_overlapping_sampler_with_fewer_slots_than_blocks_does_not_break():
    """docs/reference-differences.md G3: shortest valid length 26, block 8, N ≥ 3 → n_valid 3 but only 2
    free offsets."""
    x = torch.randint(0, 50, (2, 30))
    attn = torch.ones(2, 30, dtype=torch.long)
    attn[0, 26:] = 0
    blocks = sample_anchor_blocks(
        x,
        attn,
        None,
        block_size=8,
        num_blocks=4,
        mask_token_id=MASK,
        overlap=False,
        generators=[torch.Generator().manual_seed(0)] * 2,
    )
    kept = blocks.anchors[0][blocks.keep[0]].tolist()
    assert len(kept) == 2 and kept == sorted(kept) and kept[1] - kept[0] >= 8
    assert torch.equal(blocks.anchors[0], blocks.anchors[1])  # batch-shared


@pytest.fixture(scope="module")
def pair():
    return _make_pair()


def _make_pair():
    """A frozen 5-layer target and a 2-layer draft (block 4, grouped-query attention), built the same in every
    process (tests/stagekit.py)."""
    torch.manual_seed(1)
    return tiny_dflash_target(), DFlashDraftModel(tiny_draft_config()).eval()


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


# ---------------------------------------------------------------------------------------- the strategy


def _strategy(target, draft, features=None, **cfg):
    """DFlash assembled for `draft` (online target features unless `features` is given): strategy + loss."""
    if features is None:
        features = OnlineFeatures(target, list(draft.config.target_layer_ids))
    return assemble_strategy(
        "dflash",
        {"block_size": 4, "num_blocks_per_sample": 3, **cfg},
        draft,
        None,
        mask_token_id=MASK,
        resources={"target": target, "features": features},
    )


def _ctx(built, draft, step=0):
    return StepContext(model=draft, loss_fn=built.loss_fn, mask_token_id=MASK, step=step, base_seed=7)


def _batch():
    ids = torch.randint(0, 60, (4, 24), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    return ids, Microbatch(ids, torch.ones_like(ids, dtype=torch.float32), attn, torch.arange(4))


def _loss(built, draft, mb, step=0):
    ctx = _ctx(built, draft, step)
    batches, n, _ = built.strategy.pre_step(ctx, [mb])
    out = built.strategy.forward_backward(ctx, batches[0], num_diffusion_tokens=n, num_ar_tokens=n, is_train=False)
    return out, batches


def test_cached_and_online_features_give_the_same_loss(pair, tmp_path):
    target, draft = pair
    ids, mb = _batch()
    online, batches = _loss(_strategy(target, draft), draft, mb)
    index = write_feature_cache(
        target,
        {"train": ids},
        draft.config.target_layer_ids,
        tmp_path / "fp32",
        dtype="fp32",
        batch_size=3,
        shard_rows=3,
    )  # 2 shards, batches across them
    assert [s["rows"] for s in index["splits"]["train"]] == [3, 1] and index["bytes"] > 0
    cached, cached_batches = _loss(_strategy(target, draft, CachedFeatures(tmp_path / "fp32")), draft, mb)
    assert isinstance(batches[0].extras, DFlashBlocks) and isinstance(cached_batches[0].extras, DFlashBlocks)
    assert torch.equal(batches[0].extras.anchors, cached_batches[0].extras.anchors)
    assert torch.allclose(online.total_loss, cached.total_loss, atol=1e-6)
    write_feature_cache(target, {"train": ids}, draft.config.target_layer_ids, tmp_path / "bf16", dtype="bf16")
    half, _ = _loss(_strategy(target, draft, CachedFeatures(tmp_path / "bf16")), draft, mb)
    assert abs(float(half.total_loss) - float(online.total_loss)) < 0.02 * float(online.total_loss)
    with pytest.raises(FileNotFoundError, match="no target-feature cache"):
        CachedFeatures(tmp_path)


def test_soft_labels_from_the_cache_equal_the_online_ones_and_are_refused_when_missing(pair, tmp_path):
    """`distill_top_k`: the cache stores the target's top-k per position, the loss is the same as with the
    target run online, it differs from the hard-label loss, and a cache without them is refused at setup."""
    target, draft = pair
    ids, mb = _batch()
    online, batches = _loss(
        _strategy(target, draft, OnlineFeatures(target, draft.config.target_layer_ids, 8), distill_top_k=4), draft, mb
    )
    soft = batches[0].extras.soft
    assert soft.ids.shape == (4, 9, 4) and torch.allclose(soft.probs.sum(-1), torch.ones(4, 9))
    index = write_feature_cache(
        target, {"train": ids}, draft.config.target_layer_ids, tmp_path / "k8", dtype="fp32", top_k=8
    )
    assert index["top_k"] == 8
    cached, _ = _loss(_strategy(target, draft, CachedFeatures(tmp_path / "k8"), distill_top_k=4), draft, mb)
    assert torch.allclose(online.total_loss, cached.total_loss, atol=1e-6)
    hard, _ = _loss(_strategy(target, draft), draft, mb)
    assert not torch.allclose(hard.total_loss, online.total_loss)
    write_feature_cache(target, {"train": ids}, draft.config.target_layer_ids, tmp_path / "k0", dtype="fp32")
    with pytest.raises(
        ValueError, match="dflash.distill_top_k is 4 but the target-feature source holds the target's top 0"
    ):
        _strategy(target, draft, CachedFeatures(tmp_path / "k0"), distill_top_k=4)


def test_anchors_are_a_function_of_seed_step_and_row(pair):
    target, draft = pair
    built = _strategy(target, draft)
    s = built.strategy
    _, mb = _batch()
    first = s.pre_step(_ctx(built, draft, 5), [mb])[0][0].extras.anchors
    again = s.pre_step(_ctx(built, draft, 5), [mb])[0][0].extras.anchors
    later = s.pre_step(_ctx(built, draft, 6), [mb])[0][0].extras.anchors
    assert torch.equal(first, again) and not torch.equal(first, later)


def test_setup_errors_name_what_to_change(pair):
    target, draft = pair
    s = DFlashStrategy({"block_size": 4})
    with pytest.raises(ValueError, match="dflash.target_model_id must be set in config."):
        s.setup_extra(SetupContext(model=draft, tokenizer=None, mask_token_id=MASK))
    with pytest.raises(ValueError, match="dflash.target_model_id must be set in config."):
        assemble_strategy("dflash", {"block_size": 4}, draft, None, mask_token_id=MASK)
    with pytest.raises(ValueError, match="dflash.block_size must be at least 2"):
        DFlashStrategy({"block_size": 1})  # refused by the options
    with pytest.raises(ValueError, match=r"block_size \(1\) must be at least 2"):  # a draft config can't hold it
        replace(draft.config, block_size=1)
    with pytest.raises(ValueError, match="dflash.block_size must be at least 2."):  # a model reporting block 1
        DFlashStrategy.complete_options(DFlashOptions(), SimpleNamespace(config=SimpleNamespace(block_size=1)))
    with pytest.raises(ValueError, match="Cannot infer block_size from draft config"):
        DFlashStrategy.complete_options(DFlashOptions(), SimpleNamespace(config=None))
    with pytest.raises(ValueError, match="Cannot infer block_size from draft config"):
        DFlashStrategy().create_loss_fn()  # block size 0 is resolved only against a draft
    with pytest.raises(ValueError, match="the target-feature cache holds layers .* but the draft reads"):
        DFlashStrategy({"block_size": 4}, target=target, features=OnlineFeatures(target, [99])).setup_extra(
            SetupContext(model=draft, tokenizer=None, mask_token_id=MASK)
        )
    assert DFlashStrategy().block_size is None  # unset until completed against the draft
    built = assemble_strategy("dflash", {}, draft, None, mask_token_id=MASK, resources={"target": target})
    s = built.strategy
    assert s.block_size == draft.config.block_size and built.loss_fn.loss_gamma == 2.0  # γ = max(2, bs/2) for bs 4
    assert isinstance(built.loss_fn, DFlashDecayLoss) and s.target is target and built.mask_token_id == MASK


def test_draft_training_lowers_the_loss_and_touches_only_the_draft(pair):
    target, draft = pair
    draft = copy.deepcopy(draft).train()
    built = _strategy(target, draft)
    s = built.strategy
    ids = (torch.arange(4)[:, None] * 7 + torch.arange(24)[None]) % 60  # predictable continuations
    mb = Microbatch(ids, torch.ones(4, 24), torch.ones_like(ids), torch.arange(4))
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    losses = []
    for step in range(40):
        ctx = _ctx(built, draft, step % 2)
        batches, n, _ = s.pre_step(ctx, [mb])
        out = s.forward_backward(ctx, batches[0], num_diffusion_tokens=n, num_ar_tokens=n, is_train=True)
        opt.step()
        opt.zero_grad()
        losses.append(float(out.total_loss))
    assert losses[-1] < 0.85 * losses[0]  # a frozen random 64-token head makes this slow; it does fall
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in target.parameters())
    assert not target.training and not any(p.requires_grad for p in target.parameters())  # still frozen


def _uneven_rows():
    """Four rows whose scored-block counts differ (row 1 is too short to keep any block; row 3 has its first
    eight tokens unsupervised), so a per-micro-batch or per-rank denominator would change the loss."""
    ids = torch.randint(0, 60, (4, 24), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0
    loss_mask = attn.float().clone()
    loss_mask[3, :8] = 0
    return ids, loss_mask, attn


def _split_step(built, draft, rows, microbatches: int, dp_rank: int = 0, dp_size: int = 1):
    """One training step over `rows` (global row indices) split into `microbatches`: pre_step, the
    (all-reduced) denominators, forward/backward × loss_scale. Returns (Σ micro-batch losses, denominator)."""
    ids, loss_mask, attn = _uneven_rows()
    per = len(rows) // microbatches
    mbs = [
        Microbatch(ids[r], loss_mask[r], attn[r], torch.tensor(r))
        for r in (rows[i * per : (i + 1) * per] for i in range(microbatches))
    ]
    ctx = StepContext(
        model=draft,
        loss_fn=built.loss_fn,
        mask_token_id=MASK,
        step=3,
        base_seed=7,
        dp_rank=dp_rank,
        dp_size=dp_size,
        grad_acc_steps=microbatches,
        loss_scale=float(dp_size),
    )
    s = built.strategy
    batches, n_noise, n_sup = s.pre_step(ctx, mbs)
    n_diff, n_ar = s.loss_denominators(batches, global_sum(n_noise), global_sum(n_sup))
    total = sum(
        float(s.forward_backward(ctx, b, num_diffusion_tokens=n_diff, num_ar_tokens=n_ar, is_train=True).dllm_loss)
        for b in batches
    )
    return total, n_diff


@pytest.mark.parametrize("loss_type", ["decay", "dpace"])
def test_loss_and_gradient_do_not_depend_on_the_micro_batch_split(pair, loss_type):
    """The same 4 rows as one micro-batch of 4 or two of 2: same anchors (per-row seeds), same loss, same
    gradient, because each micro-batch divides by the step's global count (docs/strategies.md §7.2)."""
    target, draft = pair
    results = []
    for microbatches in (1, 2):
        d = copy.deepcopy(draft)
        built = _strategy(target, d, loss_type=loss_type)
        loss, denominator = _split_step(built, d, [0, 1, 2, 3], microbatches)
        results.append((loss, denominator, [p.grad.clone() for p in d.parameters()]))
    (one, den_one, g_one), (two, den_two, g_two) = results
    assert den_one == den_two and one == pytest.approx(two, rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7, rtol=1e-5) for a, b in zip(g_one, g_two))
    if loss_type == "dpace":
        assert den_one == 8  # 3 + 0 + 3 + 2 scored blocks of 3 rows kept
        assert isinstance(built.loss_fn, DFlashDPACELoss)
    else:
        assert isinstance(built.loss_fn, DFlashDecayLoss) and built.loss_fn.loss_gamma == 2.0


def test_a_per_micro_batch_dpace_denominator_would_change_the_update(pair):
    """Sensitivity of the test above: dividing each micro-batch by its own block count (what a rank-local
    denominator does, then averaged over ranks) weights the blocks of the smaller share more: another
    gradient on the same rows."""
    target, draft = pair
    ids, loss_mask, attn = _uneven_rows()
    grads = {}
    for name in ("global", "local"):
        d = copy.deepcopy(draft)
        built = _strategy(target, d, loss_type="dpace")
        ctx = StepContext(model=d, loss_fn=built.loss_fn, mask_token_id=MASK, step=3, base_seed=7, grad_acc_steps=2)
        mbs = [Microbatch(ids[r], loss_mask[r], attn[r], torch.tensor(r)) for r in ([0, 1], [2, 3])]
        batches, _, _ = built.strategy.pre_step(ctx, mbs)
        local = [scored_blocks(b.extras.block_mask, 4) for b in batches]
        assert local == [3, 5]
        for b, n in zip(batches, local):
            count, scale = (sum(local), 1.0) if name == "global" else (n, 0.5)
            out = built.strategy.forward_backward(ctx, b, num_diffusion_tokens=count, num_ar_tokens=1, is_train=False)
            (out.total_loss * scale).backward()
        grads[name] = torch.cat([p.grad.flatten() for p in d.parameters()])
    gap = (grads["global"] - grads["local"]).norm() / grads["global"].norm()
    assert gap > 0.05


def _gloo_worker(rank: int, world: int, out_file: str, loss_type: str):
    """Rank `rank` of `world`: rows rank, rank + world, … of the global batch, gloo all-reduces, gradients
    averaged over ranks as DDP averages them."""
    import torch.distributed as dist

    target, draft = _make_pair()
    built = _strategy(target, draft, loss_type=loss_type)
    loss, denominator = _split_step(built, draft, list(range(rank, 4, world)), 1, rank, world)
    grads = [p.grad for p in draft.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
        grad /= world
    if rank == 0:
        torch.save({"loss": global_sum(loss), "denominator": denominator, "grads": grads}, out_file)
    else:
        global_sum(loss)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dpace"])
def test_dpace_under_two_gloo_processes_matches_one_process(tmp_path, loss_type):
    """Two CPU processes (gloo), two rows each, against one process with all four: the D-PACE denominator
    (scored blocks) is all-reduced, so the loss and the DDP-averaged gradient are the one-process ones."""
    target, draft = _make_pair()
    built = _strategy(target, draft, loss_type=loss_type)
    loss, denominator = _split_step(built, draft, [0, 1, 2, 3], 1)
    out = tmp_path / "rank0.pt"
    run_ranks(_gloo_worker, str(out), loss_type, tmp_path=tmp_path)
    two = torch.load(out)
    assert two["denominator"] == denominator == 8
    assert two["loss"] == pytest.approx(loss, rel=1e-6)
    assert all(torch.allclose(p.grad, g, atol=1e-7, rtol=1e-5) for p, g in zip(draft.parameters(), two["grads"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention has no CPU backward in torch 2.13; GPU check")
def test_flex_block_mask_trains_like_the_dense_mask_on_gpu(pair):
    """On CUDA the draft trains through the flex BlockMask: same loss and gradients as the dense mask, on packed
    rows (three documents in row 0) as on plain ones."""
    target, draft = (m.cuda() for m in copy.deepcopy(pair))
    ids = torch.randint(0, 60, (2, 256), generator=torch.Generator().manual_seed(4)).cuda()
    docs = torch.zeros_like(ids)
    docs[0, 90:], docs[0, 170:] = 1, 2
    mb = Microbatch(
        ids, torch.ones_like(ids, dtype=torch.float32), torch.ones_like(ids), torch.arange(2), "train", docs
    )
    grads, losses = [], []
    for backend in ("sdpa", "flex_attention"):
        d = copy.deepcopy(draft).train()
        built = _strategy(target, d, attention_backend=backend, num_blocks_per_sample=8)
        s = built.strategy
        ctx = _ctx(built, d)
        batches, n, _ = s.pre_step(ctx, [mb])
        out = s.forward_backward(ctx, batches[0], num_diffusion_tokens=n, num_ar_tokens=n, is_train=True)
        losses.append(float(out.total_loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-3)


def test_speculative_accept_commits_tokens_distributed_as_the_target():
    """Rejection step, k = 2, V = 5, a draft far from the target: the first committed token follows p_0
    exactly, and so does the second wherever the first proposal stood (p does not depend on the prefix
    here). A chi-square test over 20k draws at significance 1e-4; the draft itself fails the same test."""
    from scipy.stats import chisquare

    from strategies.dflash.decoding import speculative_accept

    p = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05], [0.05, 0.05, 0.10, 0.30, 0.50], [0.2] * 5])
    q = torch.tensor([[0.05, 0.05, 0.30, 0.30, 0.30], [0.40, 0.30, 0.10, 0.10, 0.10]])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    first, second, accepted_counts = [], [], []
    for _ in range(n):
        proposal = torch.multinomial(q, 1, generator=g)[:, 0]
        accepted, nxt = speculative_accept(p, q, proposal, g)
        tokens = proposal[:accepted].tolist() + [nxt]
        first.append(tokens[0])
        if len(tokens) > 1:
            second.append(tokens[1])
        accepted_counts.append(accepted)

    def pvalue(seen, probs):
        expected = probs.double() / probs.double().sum() * float(seen.sum())
        return chisquare(seen.double().numpy(), expected.numpy()).pvalue

    assert pvalue(torch.bincount(torch.tensor(first), minlength=5), p[0]) > 1e-4
    assert pvalue(torch.bincount(torch.tensor(second), minlength=5), p[1]) > 1e-4
    # sensitivity: draws from the draft itself are rejected by the same test
    assert pvalue(torch.bincount(torch.multinomial(q[0], n, replacement=True, generator=g), minlength=5), p[0]) < 1e-4
    # expected acceptance of the first proposal is Σ min(p, q)
    rate = sum(a >= 1 for a in accepted_counts) / n
    assert rate == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=0.015)


def test_speculative_sampling_matches_target_sampling_on_a_model(pair):
    """The first two generated tokens of a prompt, 1,500 runs at T = 1: their joint frequencies are those
    of the target's own ancestral sampling (exact probabilities from the target, chi-square over the
    64 + 64 marginals), while the argmax path stays the greedy one."""
    from scipy.stats import chisquare

    target, draft = pair
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        nxt = torch.arange(64)[:, None]
        rows = torch.cat([torch.tensor([prompt]).expand(64, -1), nxt], dim=1)
        p2 = (p1[:, None] * torch.softmax(target(input_ids=rows).logits[:, -1], -1)).sum(0)  # marginal of token 2
    g = torch.Generator().manual_seed(0)
    n = 1500
    counts = torch.zeros(2, 64)
    for _ in range(n):
        out = speculative_generate(target, draft, prompt, max_new_tokens=2, temperature=1.0, generator=g).tokens
        counts[0, out[0]] += 1
        counts[1, out[1]] += 1
    for seen, probs in ((counts[0], p1), (counts[1], p2)):
        expected = probs.double() / probs.double().sum() * n
        assert chisquare(seen.numpy(), expected.numpy()).pvalue > 1e-4
    again = speculative_generate(target, draft, prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(3))
    same = speculative_generate(target, draft, prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert again.tokens == same.tokens  # the seed alone decides the sample


def test_a_draft_trained_on_the_targets_top_k_loads_from_its_checkpoints_options(pair):
    """`dllm-flow generate` rebuilds a draft's strategy from the options its checkpoint records (a dict): a draft
    trained with `distill_top_k` gets online features holding that many of the target's tokens, as evaluation's
    typed options do (it used to get none and was refused: 'the target-feature source holds the target's top 0')."""
    from tasks.speculative.setup import draft_strategy

    target, draft = pair
    options = {"block_size": 4, "distill_top_k": 8}
    built = draft_strategy("dflash", options, draft, target, mask_token_id=MASK)
    assert built.strategy.features.top_k == 8
    assert draft_strategy("dflash", {"block_size": 4}, draft, target, mask_token_id=MASK).strategy.features.top_k == 0
