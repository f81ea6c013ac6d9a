"""SPG's estimator and objective (docs/post-training.md, "Likelihood estimators"): the block-wise masks against the
rule written out position by position, the two bounds against the reference's formula (probabilities summed, not
log-sum-exp) and against numbers computed by hand, the loss by hand, and the configuration it needs."""

import math

import pytest
import torch
from test_grpo_estimators import MASK, PROMPT, TableDenoiser

from dllm_common.config import ConfigError
from strategies.options import validate_config
from tasks.posttrain.estimators import elbo_eubo, sandwich_bounds, sandwich_masks
from tasks.posttrain.grpo_loss import completion_mask, sandwich_loss


def _rows(lengths: list[int], canvas: int) -> torch.Tensor:
    return torch.tensor([[1.0] * n + [0.0] * (canvas - n) for n in lengths])


@pytest.mark.parametrize("block", [1, 2, 3, 4, 8])
def test_each_view_is_a_semi_autoregressive_state(block):
    """Per view: blocks before the chosen one clean, the chosen one masked at 1 … (its completion tokens) positions,
    every later position and every position past the first EOS masked."""
    canvas, lengths = 8, [8, 5, 1, 3, 7, 2]
    cmask = _rows(lengths, canvas)
    seen_blocks = set()
    for seed in range(30):
        masked = sandwich_masks(cmask, block, 3, torch.Generator().manual_seed(seed))
        assert masked.shape == (3, len(lengths), canvas)
        for j in range(3):
            for i, n in enumerate(lengths):
                row = masked[j, i].tolist()
                assert all(row[n:])  # past the EOS
                first = row.index(True)
                b = first // block  # the chosen block: the first with a masked position
                assert b * block < n  # it holds completion tokens
                start, end = b * block, min((b + 1) * block, canvas)
                assert not any(row[:start]) and all(row[end:])
                inside = min(block, n - start)
                assert 1 <= sum(row[start : start + inside]) <= inside
                seen_blocks.add((block, b))
    # every block that can hold completion tokens gets chosen over the draws
    assert {b for _, b in seen_blocks} == set(range(-(-canvas // block)))
    again = sandwich_masks(cmask, block, 3, torch.Generator().manual_seed(29))
    assert torch.equal(again, masked)  # one seed, one set of views: shared by every pass of an update


def test_views_of_one_row_take_different_blocks_while_there_are_enough():
    cmask = _rows([8], 8)
    for seed in range(20):
        masked = sandwich_masks(cmask, 2, 4, torch.Generator().manual_seed(seed))
        firsts = {masked[j, 0].tolist().index(True) // 2 for j in range(4)}
        assert firsts == {0, 1, 2, 3}  # a permutation of the four blocks


def _reference_bounds(logp, masked, cmask, beta):
    """The reference's arithmetic, element by element: probabilities raised to β and summed."""
    n, batch, length = logp.shape
    elbo, eubo = [], []
    for i in range(batch):
        per_view = []
        for j in range(n):
            ks = [k for k in range(length) if masked[j, i, k] and cmask[i, k]]
            per_view.append(sum(float(logp[j, i, k]) for k in ks) / len(ks))
        elbo.append(sum(per_view) / n)
        logs = []
        for k in range(length):
            total = 0.0
            for j in range(n):
                if masked[j, i, k] and cmask[i, k]:
                    t = sum(bool(masked[j, i, q] and cmask[i, q]) for q in range(length)) / float(cmask[i].sum())
                    total += math.exp(float(logp[j, i, k])) ** beta / t
            if total > 0:
                logs.append(math.log(total / n))
        eubo.append(sum(logs) / len(logs) / beta)
    return elbo, eubo


def test_the_bounds_by_hand():
    """One row of 3 completion tokens, 2 views: view 1 masks positions 1, 2 (t = 2/3), view 2 masks 0, 1, 2 (t = 1).
    ELBO = ((log .5 + log .25)/2 + (log .8 + log .4 + log .2)/3) / 2. With β = 1, the EUBO's per-position means are
    k0: (.8/1)/2 = .4;  k1: (.5·3/2 + .4)/2 = .575;  k2: (.25·3/2 + .2)/2 = .2875, so EUBO = (log .4 + log .575 +
    log .2875)/3."""
    p = torch.tensor([[[0.9, 0.5, 0.25]], [[0.8, 0.4, 0.2]]])
    masked = torch.tensor([[[False, True, True]], [[True, True, True]]])
    cmask = torch.ones(1, 3)
    elbo, eubo = sandwich_bounds(p.log(), masked, cmask, 1.0)
    want_elbo = ((math.log(0.5) + math.log(0.25)) / 2 + (math.log(0.8) + math.log(0.4) + math.log(0.2)) / 3) / 2
    want_eubo = (math.log(0.4) + math.log(0.575) + math.log(0.2875)) / 3
    assert elbo.item() == pytest.approx(want_elbo, abs=1e-6)
    assert eubo.item() == pytest.approx(want_eubo, abs=1e-6)
    # β = 2: k0 (.64)/2 = .32, k1 (.25·1.5 + .16)/2 = .2675, k2 (.0625·1.5 + .04)/2 = .066875, over β
    _, eubo2 = sandwich_bounds(p.log(), masked, cmask, 2.0)
    assert eubo2.item() == pytest.approx((math.log(0.32) + math.log(0.2675) + math.log(0.066875)) / 3 / 2, abs=1e-6)
    # one view masking everything: both bounds are the mean log-probability
    full = torch.ones(1, 1, 3, dtype=torch.bool)
    e, u = sandwich_bounds(p[:1].log(), full, cmask, 1.5)
    assert e.item() == pytest.approx(u.item(), abs=1e-6) == pytest.approx(p[0].log().mean().item(), abs=1e-6)


def test_the_estimate_scores_the_views_the_denoiser_was_shown():
    """elbo_eubo on a table denoiser: the batch it forwards is the prompt + each view, and its bounds are the
    reference's arithmetic on the log-probabilities of those views."""
    completion = torch.tensor([[7, 8, 0, 0, 5, 5], [8, 7, 7, 7, 7, 7]])
    cmask = completion_mask(completion, eos_token_id=0)  # row 0 ends at its first 0 (3 tokens), row 1 has no EOS
    den = TableDenoiser(9)
    elbo, eubo = elbo_eubo(den, PROMPT, completion, MASK, torch.Generator().manual_seed(4), cmask, 2, draws=3, beta=1.5)
    masked = sandwich_masks(cmask, 2, 3, torch.Generator().manual_seed(4))
    (shown,) = den.shown
    assert shown.shape == (6, 9) and torch.equal(shown[:, :3], PROMPT.repeat(3, 1))
    assert torch.equal(shown[:, 3:] == MASK, masked.reshape(6, 6))
    logp = torch.tensor(
        [[[den.logp(shown[j * 2 + i].tolist(), 3 + k, int(completion[i, k])) for k in range(6)] for i in range(2)]
         for j in range(3)]
    )  # fmt: skip
    want_elbo, want_eubo = _reference_bounds(logp, masked, cmask, 1.5)
    assert elbo.tolist() == pytest.approx(want_elbo, abs=1e-5)
    assert eubo.tolist() == pytest.approx(want_eubo, abs=1e-5)


def test_the_loss_by_hand_and_which_bound_each_completion_gets():
    """Advantages +1, −0.5, −0.5 on completions of 2, 4, 2 tokens, mix 0.5:
    ℓ = (elbo₀, (eubo₁ + elbo₁)/2, (eubo₂ + elbo₂)/2); loss = −(1·ℓ₀·2 − .5·ℓ₁·4 − .5·ℓ₂·2) / 8."""
    elbo = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    eubo = torch.tensor([-0.5, -1.0, -1.5], requires_grad=True)
    adv = torch.tensor([1.0, -0.5, -0.5])
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    terms = sandwich_loss(elbo, eubo, adv, mask, mix=0.5)
    want = -(1 * -1.0 * 2 - 0.5 * -1.5 * 4 - 0.5 * -2.25 * 2) / 8
    assert terms.loss.item() == pytest.approx(want) and terms.kl == 0.0 and terms.clip_fraction == 0.0
    terms.loss.backward()
    # the good completion's lower bound is pushed up, the bad ones' bounds down, each as its share says
    assert elbo.grad.tolist() == pytest.approx([-2 / 8, 0.5 * 0.5 * 4 / 8, 0.5 * 0.5 * 2 / 8])
    assert eubo.grad.tolist() == pytest.approx([0.0, 0.5 * 0.5 * 4 / 8, 0.5 * 0.5 * 2 / 8])
    # mix 1: the upper bound alone for the negative ones; mix 0: the ELBO everywhere
    assert sandwich_loss(elbo, eubo, adv, mask, 1.0).loss.item() == pytest.approx(
        -(-2.0 + 0.5 * 1.0 * 4 + 0.5 * 1.5 * 2) / 8
    )
    assert sandwich_loss(elbo, eubo, adv, mask, 0.0).loss.item() == pytest.approx(-(-2.0 + 4.0 + 3.0) / 8)


GRPO_TASK = {
    "pipeline": {"name": "t", "strategies": ["mdlm"]},
    "data": {"source": "task", "shape": "dialogue", "task": {"family": "arithmetic", "problems": 50}},
}


def test_the_configuration_spg_needs():
    spec = validate_config({**GRPO_TASK, "grpo": {"estimator": "elbo_eubo", "beta": 0}})
    assert spec.grpo.likelihood_draws == 2 and spec.grpo.eubo_beta == 1.5 and spec.grpo.mix_weight == 0.5
    with pytest.raises(ConfigError, match="no KL term.*set grpo.beta: 0"):
        validate_config({**GRPO_TASK, "grpo": {"estimator": "elbo_eubo"}})
    with pytest.raises(ConfigError, match="idlm cannot compute the 'elbo_eubo' estimate; it supports exact_ar"):
        validate_config(
            {
                **GRPO_TASK,
                "pipeline": {"name": "t", "strategies": ["idlm"]},
                "grpo": {"estimator": "elbo_eubo", "beta": 0},
            }
        )
    with pytest.raises(ConfigError, match="mix_weight"):
        validate_config({**GRPO_TASK, "grpo": {"estimator": "elbo_eubo", "beta": 0, "mix_weight": 1.5}})
