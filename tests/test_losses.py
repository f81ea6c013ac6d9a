"""MDLMCrossEntropyLoss against hand-computed values (spec §5.2, §14.3)."""

import math

import pytest
import torch

from strategies import DLLMLossOutput, MDLMCrossEntropyLoss, per_token_nll


def _ce(row, target):
    """−log softmax(row)[target], written out by hand."""
    m = max(row)
    return -(row[target] - m - math.log(sum(math.exp(v - m) for v in row)))


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
    out = MDLMCrossEntropyLoss()(logits, target, noise, p, lm, num_diffusion_tokens=n_sup)
    assert isinstance(out, DLLMLossOutput)
    assert out.total_loss.item() == pytest.approx(expected / n_sup, rel=1e-6)
    assert torch.equal(out.total_loss.detach(), out.dllm_loss)


def test_unnormalized_without_denominator_and_divides_by_n(case):
    logits, target, noise, p, lm = case
    raw = MDLMCrossEntropyLoss()(logits, target, noise, p, lm).total_loss
    ten = MDLMCrossEntropyLoss()(logits, target, noise, p, lm, num_diffusion_tokens=10).total_loss
    assert ten.item() == pytest.approx(raw.item() / 10)


def test_zero_when_nothing_corrupted(case):
    logits, target, _, p, lm = case
    out = MDLMCrossEntropyLoss()(logits, target, torch.zeros_like(lm, dtype=torch.bool), p, lm, num_diffusion_tokens=6)
    assert out.total_loss.item() == 0.0


def test_only_corrupted_and_supervised_positions_count(case):
    logits, target, _, _, _ = case
    noise = torch.zeros(2, 4, dtype=torch.bool)
    noise[0, 2] = True
    noise[1, 3] = True  # corrupted but unsupervised below
    lm = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float)
    p = torch.full((2, 4), 0.5)
    out = MDLMCrossEntropyLoss()(logits, target, noise, p, lm)
    assert out.total_loss.item() == pytest.approx(_ce(logits[0, 2].tolist(), 3) * 2, rel=1e-6)


def test_flat_weighting_drops_inverse_p(case):
    logits, target, noise, p, lm = case
    elbo = MDLMCrossEntropyLoss("elbo")(logits, target, noise, torch.full_like(p, 0.5), lm).total_loss
    flat = MDLMCrossEntropyLoss("flat")(logits, target, noise, torch.full_like(p, 0.5), lm).total_loss
    assert elbo.item() == pytest.approx(2 * flat.item(), rel=1e-6)
    with pytest.raises(ValueError, match="weighting"):
        MDLMCrossEntropyLoss("sqrt")


def test_per_token_nll_is_cross_entropy():
    logits = torch.randn(3, 5, 11)
    target = torch.randint(0, 11, (3, 5))
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), reduction="none").view(3, 5)
    assert torch.allclose(per_token_nll(logits, target), ref)
