"""DFlash's blocks and losses (docs/strategies.md §5.7, §6.2, §10): layer ids, the mask against an element-wise
reference (dense and flex), the decay, soft-label and D-PACE losses by hand, and the anchors."""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from strategies.dflash.blocks import (
    build_dflash_mask_mod,
    build_target_layer_ids,
    create_dflash_block_mask,
    create_dflash_sdpa_mask,
    sample_anchor_blocks,
)
from strategies.dflash.loss import (
    DFlashDecayLoss,
    DFlashDPACELoss,
    SoftLabels,
    block_soft_labels,
    dpace_weights,
    scored_blocks,
    top_k_labels,
)

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
