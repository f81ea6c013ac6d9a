"""GRPO's objective (docs/post-training.md, "GRPO's objective"): advantages, the completion mask and the clipped,
KL-regularised loss against values computed by hand, and against TRL's own GRPO loss (an implementation that is not
ours) from the same per-token log-probabilities, advantages and reference log-probabilities."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tasks.posttrain.grpo_loss import completion_mask, group_advantages, policy_loss


def test_advantages_are_relative_to_the_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert group_advantages(rewards, 4).tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    scaled = group_advantages(rewards, 4, scale_by_std=True)
    sd = math.sqrt(1 / 3)  # the unbiased std of (1, 0, 0, 1)
    unit = 0.5 / (sd + 1e-4)
    assert scaled[:4].tolist() == pytest.approx([unit, -unit, -unit, unit])
    assert scaled[4:].abs().max() == 0  # a group that agrees teaches nothing
    with pytest.raises(ValueError, match="group_size must be at least 2"):
        group_advantages(rewards, 1)
    with pytest.raises(ValueError, match="7 rewards do not split into groups of 4"):
        group_advantages(rewards[:7], 4)


def test_the_completion_mask_ends_with_the_first_eos():
    eos = 0
    ids = torch.tensor([[5, 7, 0, 9, 0], [0, 1, 1, 1, 1], [1, 2, 3, 4, 5]])
    assert completion_mask(ids, eos).tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


def _case():
    """Two completions of 3 tokens, advantages +1 and −1, old log-probabilities 0 (so ρ = exp(logp))."""
    logp = torch.log(torch.tensor([[1.5, 1.0, 0.9], [0.5, 1.3, 1.0]])).requires_grad_()
    old = torch.zeros(2, 3)
    ref = logp.detach() + torch.tensor([[0.0, 0.0, 0.0], [0.0, math.log(2.0), 0.0]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return logp, old, ref, adv, mask


def test_the_loss_by_hand():
    logp, old, ref, adv, mask = _case()
    terms = policy_loss(logp, old, ref, adv, mask, clip_eps=0.2, beta=0.1)
    # row 0 (A = +1): ρ = 1.5, 1.0 (0.9 unmasked) → −min(1.5, 1.2) = −1.2, −1.0 → mean −1.1
    # row 1 (A = −1): ρ = 0.5, 1.3, 1.0 → −min(−0.5, −0.8) = 0.8, −min(−1.3, −1.2) = 1.3, 1.0; k3 KL of the
    #   second token: δ = ln 2, e^δ − δ − 1 = 1 − ln 2, times β = 0.1 → mean (0.8 + 1.3 + 0.1(1 − ln 2) + 1) / 3
    row1 = (0.8 + 1.3 + 0.1 * (1 - math.log(2)) + 1.0) / 3
    assert terms.loss.item() == pytest.approx((-1.1 + row1) / 2, abs=1e-6)
    assert terms.kl == pytest.approx((1 - math.log(2)) / 5, abs=1e-6)
    assert terms.clip_fraction == pytest.approx(2 / 5)  # 1.5 with A > 0 and 0.5 with A < 0 were held
    terms.loss.backward()
    # a held token gives no gradient; an unheld one gives −A·ρ ÷ (its row's tokens × rows)
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[1, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-1.0 * 1.0 / 2 / 2, abs=1e-6)
    assert logp.grad[0, 2].item() == 0.0  # unmasked
    # row 1 token 2: ρ·1 (A = −1: −min(−ρ, …) = ρ, dρ/dlogp = ρ) + β·(1 − e^δ) = 1.3 + 0.1·(1 − 2)
    assert logp.grad[1, 1].item() == pytest.approx((1.3 - 0.1) / 3 / 2, abs=1e-6)
    with pytest.raises(ValueError, match="reference policy's log-probabilities are needed"):
        policy_loss(logp, old, None, adv, mask, beta=0.1)


def _trl_loss(logp, old, ref, adv, mask, clip_eps, beta):
    """TRL's `GRPOTrainer._compute_loss` on a stand-in trainer whose model returns `logp` as its per-token
    log-probabilities: everything else is TRL's code (ratio, two-sided clip, k3 KL, the "grpo" reduction)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    class Accelerator:
        sync_gradients = True

        def gather(self, x):
            return x

        gather_for_metrics = gather

        def reduce(self, x, reduction="sum"):
            return x  # one process

    metrics = {"train": defaultdict(list)}
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
        loss_type="grpo",
        epsilon_low=clip_eps,
        epsilon_high=clip_eps,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        _metrics=metrics,
        accelerator=Accelerator(),
    )
    batch, length = logp.shape
    inputs = {
        "prompt_ids": torch.zeros(batch, 2, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 2, dtype=torch.long),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
    }
    return GRPOTrainer._compute_loss(trainer, None, inputs), metrics["train"]


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_loss_is_trls_from_the_same_log_probabilities(beta):
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(6, 9, generator=gen) * 3).requires_grad_()
    old = logp.detach() + torch.randn(6, 9, generator=gen) * 0.3  # ratios on both sides of the clip
    ref = logp.detach() + torch.randn(6, 9, generator=gen) * 0.5
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0]), 3)
    ids = torch.randint(1, 5, (6, 9), generator=gen)
    ids[0, 3] = ids[2, 0] = ids[4, 7] = 0
    mask = completion_mask(ids, 0)
    ours = policy_loss(logp, old, ref, adv, mask, clip_eps=0.2, beta=beta)
    (grad,) = torch.autograd.grad(ours.loss, logp)
    theirs, logged = _trl_loss(logp, old, ref, adv, mask, 0.2, beta)
    (their_grad,) = torch.autograd.grad(theirs, logp)
    assert ours.loss.item() == pytest.approx(theirs.item(), abs=1e-6)
    assert torch.allclose(grad, their_grad, atol=1e-7)
    assert ours.clip_fraction == pytest.approx(logged["clip_ratio/region_mean"][-1], abs=1e-6)
    if beta:
        assert ours.kl == pytest.approx(logged["kl"][-1], abs=1e-6)
