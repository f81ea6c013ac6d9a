"""SCDD of strategies/scdd.py: `scdd_schedule` and `SCDDLoss` (docs/strategies.md §5.8) against hand formulas
and docs/strategies.md §14.3 properties."""

import math

import pytest
import torch
import torch.nn.functional as F
from losskit import corrupted

from strategies.base import TokenCounts
from strategies.scdd.loss import SCDDLoss
from strategies.scdd.schedule import scdd_schedule


def ce(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view(
        target.shape
    )


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
    return loss(logits, corrupted(x0, None, torch.full(x0.shape, t), lm, noisy=zt), TokenCounts())


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
    halved = loss(logits, corrupted(x0, None, torch.full(x0.shape, 0.4), lm, noisy=zt), TokenCounts(2 * n))
    assert halved.total_loss.item() == pytest.approx(base.item() / 2, rel=1e-6)


def test_scdd_requires_noisy_ids_and_valid_args(scdd_batch):
    logits, x0, zt, lm = scdd_batch
    with pytest.raises(ValueError, match=r"needs batch\.noisy_ids"):
        SCDDLoss(M)(logits, corrupted(x0, None, torch.full(x0.shape, 0.4), lm), TokenCounts())
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
    full = loss(logits, corrupted(x0, None, times, lm, noisy=zt), TokenCounts(48)).total_loss
    parts = sum(
        loss(
            logits[i : i + 2],
            corrupted(x0[i : i + 2], None, times[i : i + 2], lm[i : i + 2], noisy=zt[i : i + 2]),
            TokenCounts(48),
        ).total_loss
        for i in range(0, 6, 2)
    )
    assert parts.item() == pytest.approx(full.item(), rel=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 32, 1024])
def test_scdd_chunking_is_exact_in_loss_and_gradient(scdd_batch, chunk):
    logits, x0, zt, lm = scdd_batch
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    la = SCDDLoss(M, chunk_size=None)(
        a, corrupted(x0, None, torch.full(x0.shape, 0.3), lm, noisy=zt), TokenCounts()
    ).total_loss
    lb = SCDDLoss(M, chunk_size=chunk)(
        b, corrupted(x0, None, torch.full(x0.shape, 0.3), lm, noisy=zt), TokenCounts()
    ).total_loss
    la.backward()
    lb.backward()
    assert torch.allclose(la, lb, rtol=1e-6) and torch.allclose(a.grad, b.grad, atol=1e-7)
    if chunk == 7:
        assert (b.grad.abs().sum(-1) > 0).all()  # every supervised position receives gradient


def _logit_grads(t, z, x=10, vocab=2048, p_x=0.05, p_z=None):
    """(∂L/∂logit_x, ∂L/∂logit_z) at one position holding z, with p_θ(x) = p_x (and p_θ(z) = p_z)."""
    logits = torch.zeros(1, 1, vocab)
    logits[0, 0, x] = math.log(p_x * (vocab - 2) / (1 - p_x))
    if p_z is not None:
        logits[0, 0, z] = math.log(p_z * (vocab - 2) / (1 - p_z))
    logits.requires_grad_(True)
    loss = SCDDLoss(2, num_timesteps=1000, max_ratio=0.1)
    out = loss(
        logits,
        corrupted(torch.tensor([[x]]), None, torch.full((1, 1), t), torch.ones(1, 1), noisy=torch.tensor([[z]])),
        TokenCounts(),
    )
    out.total_loss.backward()
    return logits.grad[0, 0, x].item(), logits.grad[0, 0, z].item()


@pytest.mark.parametrize("t", [0.05, 0.3, 0.7])
def test_scdd_visible_token_evidence_lives_in_the_posterior_not_in_p(t):
    """What the loss trains at a visible position (docs/strategies.md §5.8, §11.5): at an untouched one it
    hardly depends on p_θ(x) (∂/∂logit_x under 1/100 of a masked position's), because the token's own
    evidence enters through q(z_t | x); at a replaced one it pushes p_θ(z) down and p_θ(x) up. So p_θ at a
    visible position is a guess from the other positions, which the sampler's final pass must not copy."""
    masked, _ = _logit_grads(t, 2)
    clean, _ = _logit_grads(t, 10)
    to_x, to_z = _logit_grads(t, 11, p_z=0.05)
    assert masked < 0 and abs(clean) < abs(masked) / 100
    assert to_x < 0 < to_z and abs(to_z) > abs(masked) / 2


def test_scdd_flat_at_ratio_zero_is_mdlm_flat_and_elsewhere_a_per_row_rescale(scdd_batch):
    """`weighting="flat"` (docs/strategies.md §5.8): at uniform_ratio 0 the loss is the plain mean cross-entropy
    over masked tokens (MDLM's flat loss); with a uniform channel each row's bound term is divided by
    T·κ·ρ_s, the bound's weight on −log p_θ(x0) at a [MASK] (capped so no row is scaled up)."""
    logits, x0, zt, lm = scdd_batch
    masked_only = torch.where(torch.arange(10) % 2 == 0, M, x0)
    for t in (0.05, 0.4, 0.9):
        out = _scdd(logits, x0, masked_only, lm, t=t, max_ratio=0.0, weighting="flat")
        no_mask = logits.clone()
        no_mask[..., M] = -math.inf
        expected = (ce(no_mask, x0) * (masked_only == M)).sum() / lm.sum()
        assert out.total_loss.item() == pytest.approx(expected.item(), rel=1e-4)
    steps, t = 1000, 0.3
    sched = lambda u: scdd_schedule(torch.tensor([u], dtype=torch.float64), max_ratio=0.1, gamma_shape=1.0, t_peak=0.5)  # noqa: E731
    at_t, at_s = sched(t), sched(t - 1 / steps)
    weight = steps * (at_s.gamma - at_t.gamma) / (1 - at_t.gamma) * at_s.rho
    elbo, flat = (_scdd(logits, x0, zt, lm, t=t, weighting=w).total_loss.item() for w in ("elbo", "flat"))
    assert weight.item() > 1 and flat == pytest.approx(elbo / weight.item(), rel=1e-5)
    assert SCDDLoss(M, weighting="flat").bound().weighting == "elbo"
    with pytest.raises(ValueError, match="weighting must be one of"):
        SCDDLoss(M, weighting="1/t")
