"""Losses for the next strategies (spec §5.3–5.6, §5.8) against hand formulas and §14.3 properties."""

import math

import pytest
import torch
import torch.nn.functional as F

from strategies.losses import BlockDiffusionCrossEntropyLoss, HybridDiffusionLLMLoss, IDLMLoss, encoder_ar_loss
from strategies.scdd import SCDDLoss, scdd_schedule


def ce(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view(
        target.shape
    )


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


# ------------------------------------------------------------------ hybrid


def test_hybrid_hand_formula_with_ar_term(fx):
    logits, causal, target, noise, p, lm = fx
    out = HybridDiffusionLLMLoss(alpha=0.3)(
        logits, target, noise, p, lm, loss_mask_ar=lm, num_diffusion_tokens=4, num_ar_tokens=12, causal_logits=causal
    )
    diff = (ce(logits, target) * (noise & lm.bool()) / 0.5).sum() / 4
    ar = (ce(causal[:, :-1], target[:, 1:]) * lm[:, 1:]).sum() / 12
    assert out.total_loss.item() == pytest.approx(0.3 * diff.item() + ar.item(), rel=1e-6)
    assert out.dllm_loss.item() == pytest.approx(0.3 * diff.item(), rel=1e-6)


def test_hybrid_layouts_and_alpha(fx):
    logits, causal, target, noise, p, lm = fx
    plain = HybridDiffusionLLMLoss()(logits, target, noise, p, lm)
    assert torch.equal(plain.total_loss.detach(), plain.dllm_loss)
    both = torch.cat([logits, causal], dim=1)
    concat = HybridDiffusionLLMLoss()(both, target, noise, p, lm, loss_mask_ar=lm)
    separate = HybridDiffusionLLMLoss()(logits, target, noise, p, lm, loss_mask_ar=lm, causal_logits=causal)
    assert concat.total_loss > concat.dllm_loss and torch.allclose(concat.total_loss, separate.total_loss)
    a03 = HybridDiffusionLLMLoss(0.3)(logits, target, noise, p, lm).dllm_loss
    a10 = HybridDiffusionLLMLoss(1.0)(logits, target, noise, p, lm).dllm_loss
    assert (a03 / a10).item() == pytest.approx(0.3, rel=1e-6)
    quiet = HybridDiffusionLLMLoss()(logits, target, torch.zeros_like(noise), p, lm)
    assert quiet.dllm_loss.item() == 0.0


def test_hybrid_counts_divide(fx):
    logits, causal, target, noise, p, lm = fx
    raw = HybridDiffusionLLMLoss()(logits, target, noise, p, lm, loss_mask_ar=lm, causal_logits=causal)
    ten = HybridDiffusionLLMLoss()(
        logits, target, noise, p, lm, loss_mask_ar=lm, causal_logits=causal, num_diffusion_tokens=10, num_ar_tokens=10
    )
    assert ten.total_loss.item() == pytest.approx(raw.total_loss.item() / 10, rel=1e-6)


def test_hybrid_infinite_weight_maps_to_one(fx):
    logits, _, target, noise, _, lm = fx
    p = torch.full((2, 8), float("inf"))
    out = HybridDiffusionLLMLoss()(logits, target, noise, p, lm)
    # 1/inf = 0 is finite, so only the clamp path matters: no NaN, no inf
    assert torch.isfinite(out.total_loss)


# ------------------------------------------------------------------ block diffusion


def test_block_diffusion_is_flat_ce_over_supervised(fx):
    logits, _, target, noise, p, lm = fx
    loss = BlockDiffusionCrossEntropyLoss()
    out = loss(logits, target, noise, p, lm)
    expected = (ce(logits, target) * lm).sum() / lm.sum()
    assert out.total_loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.equal(out.total_loss.detach(), out.dllm_loss)
    assert loss(logits, target, torch.zeros_like(noise), p, lm).total_loss > 0  # noise does not gate
    for other_p in (0.1, 1.0):
        assert torch.equal(loss(logits, target, noise, torch.full_like(p, other_p), lm).total_loss, out.total_loss)
    glob = loss(logits, target, noise, p, lm, num_diffusion_tokens=10).total_loss
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


# ------------------------------------------------------------------ SCDD schedule


def test_scdd_schedule_boundaries_and_mass():
    ends = scdd_schedule(torch.tensor([0.0, 1.0]), max_ratio=0.25, gamma_shape=2.0, t_peak=0.4)
    assert ends.clean_mass.tolist() == [1.0, 0.0] and ends.uniform_mass.tolist() == [0.0, 0.0]
    assert ends.absorbed_mass.tolist() == [0.0, 1.0]
    grid = scdd_schedule(torch.linspace(0, 1, 51), max_ratio=0.25, gamma_shape=2.0, t_peak=0.4)
    total = grid.clean_mass + grid.uniform_mass + grid.absorbed_mass
    assert torch.allclose(total, torch.ones(51)) and min(float(m.min()) for m in grid[:3]) >= -1e-7


@pytest.mark.parametrize("peak,ratio", [(0.5, 0.1), (0.3, 0.25)])
def test_scdd_uniform_mass_peaks_at_max_ratio(peak, ratio):
    s = scdd_schedule(torch.tensor([peak]), max_ratio=ratio, gamma_shape=1.0, t_peak=peak)
    assert s.uniform_mass.item() == pytest.approx(ratio, abs=1e-6)


@pytest.mark.parametrize("ratio,peak", [(0.1, 0.5), (0.3, 0.4)])
def test_scdd_gamma_and_rho_are_non_increasing(ratio, peak):
    """With the default shape (g = 1, so b = 1 − τ < 1) [MASK] stays absorbing: gamma and rho fall."""
    s = scdd_schedule(torch.linspace(0, 1, 201), max_ratio=ratio, gamma_shape=1.0, t_peak=peak)
    assert (s.gamma[1:] - s.gamma[:-1] <= 1e-6).all() and (s.rho[1:] - s.rho[:-1] <= 1e-6).all()


def test_scdd_ratio_zero_is_masked_diffusion_and_bad_args_raise():
    t = torch.linspace(0, 0.99, 11)
    s = scdd_schedule(t, max_ratio=0.0, gamma_shape=1.0, t_peak=0.5)
    assert torch.equal(s.uniform_mass, torch.zeros(11)) and torch.allclose(s.absorbed_mass, t)
    assert torch.allclose(s.rho, torch.ones(11))
    with pytest.raises(ValueError, match="max_ratio"):
        scdd_schedule(t, max_ratio=1.0, gamma_shape=1.0, t_peak=0.5)
    with pytest.raises(ValueError, match="t_peak"):
        scdd_schedule(t, max_ratio=0.1, gamma_shape=1.0, t_peak=0.0)


# ------------------------------------------------------------------ SCDD loss

M, V = 31, 32


@pytest.fixture
def scdd_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 10, V, generator=g)
    x0 = torch.randint(0, M, (2, 10), generator=g)
    zt = x0.clone()
    zt[:, ::2] = M
    zt[0, 1] = (x0[0, 1] + 1) % M  # one visible wrong token
    return logits, x0, zt, torch.ones(2, 10)


def _scdd(logits, x0, zt, lm, t=0.4, **kw):
    loss = SCDDLoss(M, **{"num_timesteps": 1000, "max_ratio": 0.1, **kw})
    return loss(logits, x0, None, torch.full(x0.shape, t), lm, noisy_input_ids=zt)


def test_scdd_ratio_zero_equals_mdlm_without_mask_in_softmax(scdd_batch):
    logits, x0, zt, lm = scdd_batch
    zt = x0.clone()
    zt[:, ::2] = M
    out = _scdd(logits, x0, zt, lm, max_ratio=0.0)
    no_mask = logits.clone()
    no_mask[..., M] = -math.inf
    expected = (ce(no_mask, x0) * (zt == M)).sum() / 0.4 / lm.sum()
    assert out.total_loss.item() == pytest.approx(expected.item(), rel=1e-4)
    assert out.draft_correct_per_pos is None and torch.equal(out.total_loss.detach(), out.dllm_loss)


def _single_position_loss(x0_logit, z_logit=0.0, t=0.5):
    logits = torch.zeros(1, 1, V)
    logits[0, 0, 3] = x0_logit
    logits[0, 0, 5] += z_logit
    return lambda zt: _scdd(logits, torch.tensor([[3]]), torch.tensor([[zt]]), torch.ones(1, 1), t=t).total_loss.item()


def test_scdd_visible_wrong_token_prefers_x0():
    on_x0 = _single_position_loss(8.0)(5)
    on_z = _single_position_loss(0.0, z_logit=8.0)(5)
    assert on_x0 < on_z


def test_scdd_uncorrupted_loss_falls_as_x0_logit_grows():
    values = [_single_position_loss(v)(3) for v in (0.0, 2.0, 10.0)]
    assert values[0] > values[1] > values[2]


@pytest.mark.parametrize("t", [0.001, 0.5, 0.9999])
def test_scdd_finite_loss_and_grads(scdd_batch, t):
    logits, x0, zt, lm = scdd_batch
    logits = logits.clone().requires_grad_(True)
    out = _scdd(logits, x0, zt, lm, t=t)
    out.total_loss.backward()
    assert torch.isfinite(out.total_loss) and torch.isfinite(logits.grad).all()


def test_scdd_invariances(scdd_batch):
    logits, x0, zt, lm = scdd_batch
    lm = lm.clone()
    lm[1, 5:] = 0
    base = _scdd(logits, x0, zt, lm).total_loss
    poked = logits.clone()
    poked[1, 5:] += torch.randn(5, V)
    assert torch.equal(_scdd(poked, x0, zt, lm).total_loss, base)  # unsupervised logits are ignored
    louder_mask = logits.clone()
    louder_mask[..., M] += 50
    assert torch.allclose(_scdd(louder_mask, x0, zt, lm).total_loss, base)  # [MASK] logit has no effect
    before = logits.clone()
    _scdd(logits, x0, zt, lm)
    assert torch.equal(before, logits)  # caller logits untouched
    loss = SCDDLoss(M)
    n = int(lm.sum())
    halved = loss(logits, x0, None, torch.full(x0.shape, 0.4), lm, noisy_input_ids=zt, num_diffusion_tokens=2 * n)
    assert halved.total_loss.item() == pytest.approx(base.item() / 2, rel=1e-6)


def test_scdd_requires_noisy_ids_and_valid_args(scdd_batch):
    logits, x0, zt, lm = scdd_batch
    with pytest.raises(ValueError, match="noisy_input_ids"):
        SCDDLoss(M)(logits, x0, None, torch.full(x0.shape, 0.4), lm)
    for bad_t in (0, 1):
        with pytest.raises(ValueError, match="num_timesteps >= 2"):
            SCDDLoss(M, num_timesteps=bad_t)
    with pytest.raises(ValueError, match="chunk_len"):
        SCDDLoss(M, chunk_size=0)
    assert SCDDLoss(M).chunk_size == 1024 and SCDDLoss(M, chunk_size=None).chunk_size is None


def test_scdd_microbatch_split_sums_to_full_batch():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 8, V, generator=g)
    x0 = torch.randint(0, M, (6, 8), generator=g)
    zt = torch.where(torch.rand(6, 8, generator=g) < 0.5, torch.full_like(x0, M), x0)
    times = torch.rand(6, generator=g)[:, None].expand(6, 8)
    lm = torch.ones(6, 8)
    loss = SCDDLoss(M)
    full = loss(logits, x0, None, times, lm, noisy_input_ids=zt, num_diffusion_tokens=48).total_loss
    parts = sum(
        loss(
            logits[i : i + 2],
            x0[i : i + 2],
            None,
            times[i : i + 2],
            lm[i : i + 2],
            noisy_input_ids=zt[i : i + 2],
            num_diffusion_tokens=48,
        ).total_loss
        for i in range(0, 6, 2)
    )
    assert parts.item() == pytest.approx(full.item(), rel=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 32, 1024])
def test_scdd_chunking_is_exact_in_loss_and_gradient(scdd_batch, chunk):
    logits, x0, zt, lm = scdd_batch
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    la = SCDDLoss(M, chunk_size=None)(a, x0, None, torch.full(x0.shape, 0.3), lm, noisy_input_ids=zt).total_loss
    lb = SCDDLoss(M, chunk_size=chunk)(b, x0, None, torch.full(x0.shape, 0.3), lm, noisy_input_ids=zt).total_loss
    la.backward()
    lb.backward()
    assert torch.allclose(la, lb, rtol=1e-6) and torch.allclose(a.grad, b.grad, atol=1e-7)
    if chunk == 7:
        assert (b.grad.abs().sum(-1) > 0).all()  # every supervised position receives gradient
