"""The fast loss kernels equal their element-wise definitions, values and gradients (docs/strategies.md §5.9).

References here are written the slow, obvious way: full log-softmax over the vocabulary, boolean
selection, autograd through every element.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from losskit import corrupted

from strategies.base import TokenCounts
from strategies.head import DeferrableHead, HeadProjection, deferred_logits, make_head_deferrable
from strategies.hybrid.loss import HybridDiffusionLLMLoss
from strategies.idlm.loss import IDLMLoss
from strategies.losses import BlockDiffusionCrossEntropyLoss, causal_nll_rows, encoder_ar_loss, nll_at
from strategies.mdlm.loss import MDLMCrossEntropyLoss
from strategies.models import build_model, tiny_model_config
from strategies.scdd.loss import SCDDLoss
from strategies.scdd.schedule import scdd_schedule

TINY = 1e-30


def reference_nll_at(logits, selected, targets):
    """−log softmax(logits)[target] at selected positions, 0 elsewhere, one position at a time."""
    out = torch.zeros(selected.shape)
    for idx in selected.nonzero().tolist():
        row = logits[tuple(idx)].float()
        out[tuple(idx)] = -(row[targets[tuple(idx)]] - torch.logsumexp(row, dim=0))
    return out


@pytest.mark.parametrize("fraction", [0.1, 0.5, 1.0])  # the gather path, and the one-pass path
def test_nll_at_matches_elementwise_reference_values_and_gradients(fraction):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, dtype=torch.float64).float()
    targets = torch.randint(0, 11, (3, 7), generator=g)
    selected = torch.rand(3, 7, generator=g) < fraction
    selected[0, 0] = True
    weights = torch.rand(3, 7, generator=g)

    a = logits.clone().requires_grad_(True)
    got = nll_at(a, selected, targets)
    (got * weights).sum().backward()
    b = logits.clone().requires_grad_(True)
    want = reference_nll_at(b, selected, targets)
    (want * weights).sum().backward()
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert (got[~selected] == 0).all()


def _projection(seed=1, shape=(2, 9), hidden=6, vocab=13, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=g).requires_grad_(True)
    w = torch.randn(vocab, hidden, generator=g).requires_grad_(True)
    b = torch.randn(vocab, generator=g).requires_grad_(True) if bias else None
    return h, w, b


def _grads(*tensors):
    return [t.grad.clone() for t in tensors if t is not None]


def _compare_projection(loss_of, chunk_rows, label="", **proj):
    """loss_of(logits_like) on a HeadProjection (chunked) vs on the materialized logits: value and grads."""
    h, w, b = _projection(**proj)
    value = loss_of(HeadProjection(h, w, b, chunk_rows=chunk_rows))
    value.backward()
    got = _grads(h, w, b)
    for t in (h, w, b):
        if t is not None:
            t.grad = None
    want_value = loss_of(F.linear(h, w, b))
    want_value.backward()
    want = _grads(h, w, b)
    assert value.item() == pytest.approx(want_value.item(), rel=1e-5, abs=1e-6), label
    for x, y in zip(got, want):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-5), label


def _batch(seed=2, shape=(2, 9), vocab=13):
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab - 1, shape, generator=g)
    noise = torch.rand(shape, generator=g) < 0.5
    p = torch.rand(shape[0], 1, generator=g).clamp_min(0.1).expand(shape).contiguous()
    loss_mask = torch.rand(shape, generator=g) < 0.8
    noisy = torch.where(noise, torch.full_like(targets, vocab - 1), targets)
    return targets, noise, p, loss_mask, noisy


@pytest.mark.parametrize("chunk_rows", [1, 4, 100])
def test_every_loss_on_a_head_projection_equals_the_loss_on_its_logits(chunk_rows):
    x, noise, p, lm, noisy = _batch()
    losses = {
        "mdlm": lambda lo: MDLMCrossEntropyLoss()(lo, corrupted(x, noise, p, lm), TokenCounts(7)).total_loss,
        "hybrid": lambda lo: (
            HybridDiffusionLLMLoss(0.3)(lo, corrupted(x, noise, p, lm), TokenCounts(5, 9), causal_logits=lo).total_loss
        ),
        "block": lambda lo: BlockDiffusionCrossEntropyLoss()(lo, corrupted(x, noise, p, lm), TokenCounts()).total_loss,
        "encoder_ar": lambda lo: encoder_ar_loss(lo, x, lm),
        "causal_rows": lambda lo: causal_nll_rows(lo, x, lm, torch.ones_like(lm))[0].sum(),
        "scdd": lambda lo: (
            SCDDLoss(12, num_timesteps=50)(lo, corrupted(x, noise, p, lm, noisy=noisy), TokenCounts()).total_loss
        ),
    }
    for name, loss_of in losses.items():
        _compare_projection(loss_of, chunk_rows, label=name)
    # I-DLM reads [x_t ‖ x_0] logits: 2L positions for L targets
    _compare_projection(lambda lo: IDLMLoss()(lo, x, lm, lm, seq_len=9).total_loss, chunk_rows, shape=(2, 18))


# ---------------------------------------------------------------- SCDD against its element-wise definition


def reference_scdd(logits, x0, zt, t, loss_mask, mask_id, T, max_ratio):
    """docs/strategies.md §5.8 written out with full-vocabulary tensors and log-space sums (float64 schedule)."""
    k = logits.shape[-1] - 1
    ts = t[:, 0].double()
    ss = (ts - 1 / T).clamp_min(0)
    at_t = scdd_schedule(ts, max_ratio=max_ratio, gamma_shape=1.0, t_peak=0.5)
    at_s = scdd_schedule(ss, max_ratio=max_ratio, gamma_shape=1.0, t_peak=0.5)
    rho_s, rho_t = at_s.rho, at_t.rho
    beta_s, beta_t = (1 - rho_s) / k, (1 - rho_t) / k
    c_c, c_u = rho_t / rho_s.clamp_min(TINY), (rho_s - rho_t) / rho_s.clamp_min(TINY) / k
    kappa = (at_s.gamma - at_t.gamma) / (1 - at_t.gamma).clamp_min(TINY)
    filled = logits.float().index_fill(-1, torch.tensor([mask_id]), -math.inf)
    logp = torch.log_softmax(filled, dim=-1)
    tau = torch.logaddexp(
        beta_s.clamp_min(TINY).log()[:, None, None].float(), rho_s.log()[:, None, None].float() + logp
    )
    keep = torch.ones(logits.shape[-1], dtype=torch.bool)
    keep[mask_id] = False
    sigma = tau[..., keep].sum(-1).double()
    tau_x, tau_z = tau.gather(-1, x0[..., None])[..., 0].double(), tau.gather(-1, zt[..., None])[..., 0].double()
    logp_z = logp.gather(-1, zt[..., None])[..., 0].double()
    col = lambda v: v[:, None]  # noqa: E731
    lam = torch.logaddexp(col(beta_t).clamp_min(TINY).log(), col(rho_t).clamp_min(TINY).log() + logp_z)
    delta = (zt == x0).double()
    absorbed = -col(kappa) * (col(beta_s) * sigma + col(rho_s) * tau_x)
    s_vis = (
        col(beta_s * c_u) * (sigma - k * lam)
        + col(rho_s * c_u) * (tau_x - lam)
        + col(beta_s * c_c) * (tau_z - lam)
        + col(rho_s * c_c) * delta * (tau_x - lam)
    )
    visible = -s_vis / (col(beta_t) + col(rho_t) * delta).clamp_min(TINY)
    per_token = T * torch.where(zt == mask_id, absorbed, torch.where(zt == mask_id, 0.0, visible))
    return (per_token * loss_mask.double()).sum() / max(int(loss_mask.sum()), 1)


def _scdd_case(seed, mask_id, vocab=17, scale=3.0, uniform=0.2):
    g = torch.Generator().manual_seed(seed)
    b, length = 3, 10
    x0 = torch.randint(0, vocab, (b, length), generator=g)
    x0[x0 == mask_id] = (mask_id + 1) % vocab
    zt, r = x0.clone(), torch.rand(b, length, generator=g)
    zt[r < 0.4] = mask_id
    replaced = r > 1 - uniform
    zt[replaced] = torch.randint(0, vocab, (int(replaced.sum()),), generator=g)
    zt[replaced & (zt == mask_id)] = x0[replaced & (zt == mask_id)]
    t = torch.tensor([[0.3], [0.7], [1.0]]).expand(b, length).contiguous()
    logits = torch.randn(b, length, vocab, generator=g) * scale
    loss_mask = torch.rand(b, length, generator=g) < 0.9
    return logits, x0, zt, t, loss_mask


@pytest.mark.parametrize("max_ratio", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("mask_id,chunk", [(16, None), (16, 4), (0, 7), (8, 1)])
@pytest.mark.parametrize("scale", [3.0, 40.0])  # 40: log p below log 1e-30 somewhere, where a clamp would show
def test_scdd_loss_and_gradient_equal_the_elementwise_definition(max_ratio, mask_id, chunk, scale):
    logits, x0, zt, t, lm = _scdd_case(int(scale) + mask_id, mask_id, scale=scale)
    a = logits.clone().requires_grad_(True)
    got = SCDDLoss(mask_id, num_timesteps=100, max_ratio=max_ratio, chunk_size=chunk)(
        a, corrupted(x0, None, t, lm, noisy=zt), TokenCounts()
    ).total_loss
    got.backward()
    b = logits.clone().requires_grad_(True)
    want = reference_scdd(b, x0, zt, t, lm, mask_id, 100, max_ratio)
    want.backward()
    assert math.isfinite(got.item())
    assert got.item() == pytest.approx(want.item(), rel=2e-5, abs=1e-4)
    assert torch.isfinite(a.grad).all()
    assert torch.allclose(a.grad, b.grad.float(), rtol=1e-3, atol=1e-6)
    assert (a.grad[..., mask_id] == 0).all()  # the [MASK] logit is outside the denoiser's domain


def test_scdd_bf16_logits_give_the_fp32_result_of_the_same_values():
    logits, x0, zt, t, lm = _scdd_case(5, 16)
    low = logits.bfloat16()
    a = low.clone().requires_grad_(True)
    got = SCDDLoss(16, num_timesteps=100)(a, corrupted(x0, None, t, lm, noisy=zt), TokenCounts()).total_loss
    got.backward()
    want = reference_scdd(low.float(), x0, zt, t, lm, 16, 100, 0.1)
    assert a.grad.dtype == torch.bfloat16
    assert got.float().item() == pytest.approx(want.item(), rel=1e-2)


# ---------------------------------------------------------------- the deferrable head inside a model


def _tiny(**extra):
    config = tiny_model_config("llama", 37, 16, 16, 2, 2, None, None, tie_embeddings=True)
    for key, value in extra.items():
        setattr(config, key, value)
    return build_model(config, seed=0)


def test_deferred_head_returns_a_projection_only_inside_the_context_and_keeps_the_state_dict():
    model = _tiny()
    keys = list(model.state_dict())
    assert make_head_deferrable(model)
    assert isinstance(model.lm_head, DeferrableHead) and list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    ids = torch.randint(0, 37, (2, 8))
    plain = model(input_ids=ids).logits
    with deferred_logits(model):
        deferred = model(input_ids=ids).logits
    assert isinstance(deferred, HeadProjection) and deferred.shape == plain.shape
    assert torch.allclose(deferred.materialize(), plain, atol=1e-6)
    assert isinstance(model(input_ids=ids).logits, torch.Tensor)  # switched off again


def test_a_head_with_a_soft_cap_after_it_is_left_alone():
    model = _tiny(final_logit_softcapping=30.0)
    assert not make_head_deferrable(model)
    assert type(model.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("log_beta,log_rho", [(-12.0, -0.01), (math.log(TINY), 0.0), (-3.0, -2.0)])
def test_scdd_closed_form_gradient_holds_float64_accuracy_at_a_real_vocabulary(log_beta, log_rho):
    """At V = 32k the closed-form backward sums 32k terms per row: no cancellation may creep in."""
    from strategies.scdd.loss import _vocab_terms

    rows, vocab = 16, 32_000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g) * 3
    x0, zt = torch.randint(0, vocab - 1, (rows,), generator=g), torch.randint(0, vocab, (rows,), generator=g)
    lb, lr = torch.full((rows,), log_beta), torch.full((rows,), log_rho)
    upstream = torch.randn(4, rows, generator=g, dtype=torch.float64)
    a = logits.clone().requires_grad_(True)
    got = _vocab_terms(a, x0, zt, lb, lr, vocab - 1, chunk=5)
    sum(o.double() @ u for o, u in zip(got, upstream)).backward()

    b = logits.double().requires_grad_(True)
    logp = torch.log_softmax(b.index_fill(-1, torch.tensor([vocab - 1]), -math.inf), dim=-1)
    tau = torch.logaddexp(lb.double()[:, None], lr.double()[:, None] + logp)
    logp_z = torch.where(zt == vocab - 1, math.log(TINY), logp.gather(1, zt[:, None])[:, 0])
    want = [tau[:, :-1].sum(1), tau.gather(1, x0[:, None])[:, 0], tau.gather(1, zt[:, None])[:, 0], logp_z]
    sum(w @ u for w, u in zip(want, upstream)).backward()
    for o, w in zip(got, want):
        assert torch.allclose(o.double(), w, rtol=1e-6, atol=1e-5)
    assert (a.grad.double() - b.grad).abs().max() <= 1e-6 * b.grad.abs().max()


def test_fused_head_under_bf16_autocast_matches_the_autocast_linear():
    """The chunk matmuls run in the autocast dtype in forward and in the rebuilt backward alike."""
    h, w, b = _projection(seed=3, hidden=16, vocab=40)
    x = torch.randint(0, 40, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = nll_at(HeadProjection(h, w, b, chunk_rows=4), torch.ones(2, 9, dtype=torch.bool), x)
    fused.sum().backward()
    got = _grads(h, w, b)
    for t in (h, w, b):
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, w, b)
    F.cross_entropy(logits.float().reshape(-1, 40), x.reshape(-1), reduction="sum").backward()
    for a, e in zip(got, _grads(h, w, b)):
        assert torch.allclose(a, e, rtol=2e-2, atol=2e-2)
