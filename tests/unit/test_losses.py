"""The losses of strategies/losses.py (docs/strategies.md §5.2–5.6) against hand formulas and §14.3 properties."""

import math

import pytest
import torch
import torch.nn.functional as F
from losskit import corrupted

from strategies.base import TokenCounts
from strategies.hybrid.loss import HybridDiffusionLLMLoss
from strategies.idlm.loss import IDLMLoss
from strategies.losses import BlockDiffusionCrossEntropyLoss, DLLMLossOutput, encoder_ar_loss, per_token_nll
from strategies.mdlm.loss import MDLMCrossEntropyLoss


def _ce(row, target):
    """−log softmax(row)[target], written out by hand."""
    m = max(row)
    return -(row[target] - m - math.log(sum(math.exp(v - m) for v in row)))


def ce(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view(
        target.shape
    )


# ------------------------------------------------------------------ MDLM


@pytest.fixture
def case():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 8, generator=g)
    target = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    loss_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float)
    noise = torch.tensor([[True, True, False, True], [True, False, True, True]])
    p = torch.tensor([[0.4] * 4, [0.6] * 4])
    return logits, target, noise, p, loss_mask


def test_matches_hand_formula(case):
    logits, target, noise, p, lm = case
    expected = 0.0
    for b in range(2):
        for i in range(4):
            if noise[b, i] and lm[b, i]:
                expected += _ce(logits[b, i].tolist(), int(target[b, i])) / float(p[b, i])
    n_sup = int(lm.sum())
    out = MDLMCrossEntropyLoss()(logits, corrupted(target, noise, p, lm), TokenCounts(n_sup))
    assert isinstance(out, DLLMLossOutput)
    assert out.total_loss.item() == pytest.approx(expected / n_sup, rel=1e-6)
    assert torch.equal(out.total_loss.detach(), out.dllm_loss)


def test_unnormalized_without_denominator_and_divides_by_n(case):
    logits, target, noise, p, lm = case
    raw = MDLMCrossEntropyLoss()(logits, corrupted(target, noise, p, lm), TokenCounts()).total_loss
    ten = MDLMCrossEntropyLoss()(logits, corrupted(target, noise, p, lm), TokenCounts(10)).total_loss
    assert ten.item() == pytest.approx(raw.item() / 10)


def test_zero_when_nothing_corrupted(case):
    logits, target, _, p, lm = case
    out = MDLMCrossEntropyLoss()(
        logits, corrupted(target, torch.zeros_like(lm, dtype=torch.bool), p, lm), TokenCounts(6)
    )
    assert out.total_loss.item() == 0.0


def test_only_corrupted_and_supervised_positions_count(case):
    logits, target, _, _, _ = case
    noise = torch.zeros(2, 4, dtype=torch.bool)
    noise[0, 2] = True
    noise[1, 3] = True  # corrupted but unsupervised below
    lm = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float)
    p = torch.full((2, 4), 0.5)
    out = MDLMCrossEntropyLoss()(logits, corrupted(target, noise, p, lm), TokenCounts())
    assert out.total_loss.item() == pytest.approx(_ce(logits[0, 2].tolist(), 3) * 2, rel=1e-6)


def test_flat_weighting_drops_inverse_p(case):
    logits, target, noise, p, lm = case
    elbo = MDLMCrossEntropyLoss("elbo")(
        logits, corrupted(target, noise, torch.full_like(p, 0.5), lm), TokenCounts()
    ).total_loss
    flat = MDLMCrossEntropyLoss("flat")(
        logits, corrupted(target, noise, torch.full_like(p, 0.5), lm), TokenCounts()
    ).total_loss
    assert elbo.item() == pytest.approx(2 * flat.item(), rel=1e-6)
    with pytest.raises(ValueError, match="weighting"):
        MDLMCrossEntropyLoss("sqrt")


def test_per_token_nll_is_cross_entropy():
    logits = torch.randn(3, 5, 11)
    target = torch.randint(0, 11, (3, 5))
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), reduction="none").view(3, 5)
    assert torch.allclose(per_token_nll(logits, target), ref)


# ------------------------------------------------------------------ hybrid


@pytest.fixture
def fx():
    """B=2, L=8, V=32, 6 supervised per row, noise at {1,3,4}, p=0.5."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 32, generator=g)
    causal = torch.randn(2, 8, 32, generator=g)
    target = torch.randint(0, 32, (2, 8), generator=g)
    loss_mask = torch.zeros(2, 8)
    loss_mask[:, 2:] = 1
    noise = torch.zeros(2, 8, dtype=torch.bool)
    noise[:, [1, 3, 4]] = True
    return logits, causal, target, noise, torch.full((2, 8), 0.5), loss_mask


def test_hybrid_hand_formula_with_ar_term(fx):
    logits, causal, target, noise, p, lm = fx
    out = HybridDiffusionLLMLoss(alpha=0.3)(
        logits, corrupted(target, noise, p, lm), TokenCounts(4, 12), causal_logits=causal
    )
    diff = (ce(logits, target) * (noise & lm.bool()) / 0.5).sum() / 4
    ar = (ce(causal[:, :-1], target[:, 1:]) * lm[:, 1:]).sum() / 12
    assert out.total_loss.item() == pytest.approx(0.3 * diff.item() + ar.item(), rel=1e-6)
    assert out.dllm_loss.item() == pytest.approx(0.3 * diff.item(), rel=1e-6)


def test_hybrid_layouts_and_alpha(fx):
    logits, causal, target, noise, p, lm = fx
    plain = HybridDiffusionLLMLoss()(logits, corrupted(target, noise, p, lm), TokenCounts())
    assert torch.equal(plain.total_loss.detach(), plain.dllm_loss)
    both = torch.cat([logits, causal], dim=1)
    concat = HybridDiffusionLLMLoss()(both, corrupted(target, noise, p, lm), TokenCounts())
    separate = HybridDiffusionLLMLoss()(logits, corrupted(target, noise, p, lm), TokenCounts(), causal_logits=causal)
    assert concat.total_loss > concat.dllm_loss and torch.allclose(concat.total_loss, separate.total_loss)
    a03 = HybridDiffusionLLMLoss(0.3)(logits, corrupted(target, noise, p, lm), TokenCounts()).dllm_loss
    a10 = HybridDiffusionLLMLoss(1.0)(logits, corrupted(target, noise, p, lm), TokenCounts()).dllm_loss
    assert (a03 / a10).item() == pytest.approx(0.3, rel=1e-6)
    quiet = HybridDiffusionLLMLoss()(logits, corrupted(target, torch.zeros_like(noise), p, lm), TokenCounts())
    assert quiet.dllm_loss.item() == 0.0


def test_hybrid_counts_divide(fx):
    logits, causal, target, noise, p, lm = fx
    raw = HybridDiffusionLLMLoss()(logits, corrupted(target, noise, p, lm), TokenCounts(), causal_logits=causal)
    ten = HybridDiffusionLLMLoss()(logits, corrupted(target, noise, p, lm), TokenCounts(10, 10), causal_logits=causal)
    assert ten.total_loss.item() == pytest.approx(raw.total_loss.item() / 10, rel=1e-6)


def test_hybrid_infinite_weight_maps_to_one(fx):
    logits, _, target, noise, _, lm = fx
    p = torch.full((2, 8), float("inf"))
    out = HybridDiffusionLLMLoss()(logits, corrupted(target, noise, p, lm), TokenCounts())
    # 1/inf = 0 is finite, so only the clamp path matters: no NaN, no inf
    assert torch.isfinite(out.total_loss)


# ------------------------------------------------------------------ block diffusion


def test_block_diffusion_is_flat_ce_over_supervised(fx):
    logits, _, target, noise, p, lm = fx
    loss = BlockDiffusionCrossEntropyLoss()
    out = loss(logits, corrupted(target, noise, p, lm), TokenCounts())
    expected = (ce(logits, target) * lm).sum() / lm.sum()
    assert out.total_loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.equal(out.total_loss.detach(), out.dllm_loss)
    ungated = loss(logits, corrupted(target, torch.zeros_like(noise), p, lm), TokenCounts()).total_loss
    assert ungated > 0  # noise does not gate
    for other_p in (0.1, 1.0):
        assert torch.equal(
            loss(logits, corrupted(target, noise, torch.full_like(p, other_p), lm), TokenCounts()).total_loss,
            out.total_loss,
        )
    glob = loss(logits, corrupted(target, noise, p, lm), TokenCounts(10)).total_loss
    assert glob.item() == pytest.approx((ce(logits, target) * lm).sum().item() / 10, rel=1e-6)


def test_encoder_ar_loss_hand_formula():
    g = torch.Generator().manual_seed(1)
    logits, ids = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    pairs = (valid[:, :-1] & valid[:, 1:]).bool()
    expected = (ce(logits[:, :-1], ids[:, 1:]) * pairs).sum() / pairs.sum()
    assert encoder_ar_loss(logits, ids, valid).item() == pytest.approx(expected.item(), rel=1e-6)
    assert encoder_ar_loss(logits, ids, valid, num_tokens=3).item() == pytest.approx(
        expected.item() * int(pairs.sum()) / 3, rel=1e-6
    )


# ------------------------------------------------------------------ I-DLM


@pytest.fixture
def idlm():
    g = torch.Generator().manual_seed(2)
    length = 12
    logits = torch.randn(2, 2 * length, 32, generator=g)
    target = torch.randint(0, 32, (2, length), generator=g)
    answer = torch.zeros(2, length)
    answer[:, 4:] = 1
    valid = torch.ones(2, length)
    valid[1, 10:] = 0
    return logits, target, answer, valid, length


def _idlm_reference(logits, target, answer, valid, length, denom=None):
    support = (answer.bool() & valid.bool())[:, 1:]
    d = denom or int(support.sum())
    noisy = (ce(logits[:, : length - 1], target[:, 1:]) * support).sum() / d
    clean = (ce(logits[:, length : 2 * length - 1], target[:, 1:]) * support).sum() / d
    return noisy, clean


def test_idlm_matches_two_ce_reference(idlm):
    logits, target, answer, valid, length = idlm
    out = IDLMLoss()(logits, target, answer, valid, seq_len=length)
    noisy, clean = _idlm_reference(logits, target, answer, valid, length)
    assert out.total_loss.item() == pytest.approx((noisy + 0.2 * clean).item(), rel=1e-6)
    assert out.dllm_loss.item() == pytest.approx(noisy.item(), rel=1e-6)


def test_idlm_auto_balance_and_global_denominator(idlm):
    logits, target, answer, valid, length = idlm
    noisy, clean = _idlm_reference(logits, target, answer, valid, length)
    auto = IDLMLoss(auto_balance=True)(logits, target, answer, valid, seq_len=length)
    assert auto.total_loss.item() == pytest.approx((noisy + noisy / clean * clean).item(), rel=1e-6)
    local = IDLMLoss()(logits, target, answer, valid, seq_len=length).total_loss
    glob = IDLMLoss()(logits, target, answer, valid, seq_len=length, num_diffusion_tokens=97).total_loss
    support = int(((answer.bool() & valid.bool())[:, 1:]).sum())
    assert glob.item() == pytest.approx(local.item() * support / 97, rel=1e-6)


def test_idlm_seq_len_is_keyword_only(idlm):
    logits, target, answer, valid, length = idlm
    with pytest.raises(TypeError):
        IDLMLoss()(logits, target, answer, valid, length)
