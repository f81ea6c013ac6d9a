"""BlockDiffusionStrategy, BlockDiffusionLM, the response window, the uniform-noise bound and the
canvas sampler (docs/strategies.md §8.6, §9, §14.5; docs/evaluation.md §4.2)."""

import math

import pytest
import torch
from losskit import corrupted

from dllm_common.checkpoint import load_weights_into, write_checkpoint
from dllm_common.config import EvalConfig
from strategies import (
    BlockDiffusionCrossEntropyLoss,
    BlockDiffusionStrategy,
    Microbatch,
    SetupContext,
    StepContext,
    assemble_strategy,
    build_block_diffusion_training_mask,
    build_response_window,
    get_dllm_strategy,
    uniform_diffusion_nelbo_terms,
)
from strategies.base import TokenCounts
from strategies.block_diffusion.loss import OwnTokenCanvasLoss
from strategies.block_diffusion.model import BlockDiffusionLM
from strategies.block_diffusion.sampling import block_canvas_sample
from strategies.block_diffusion.strategy import CanvasExtras, batched_block_mask, supervised_runs
from strategies.corruption import corrupt_uniform_random
from strategies.head import HeadProjection
from strategies.losses import encoder_ar_loss, per_token_nll
from strategies.models import DLLMOutput, build_model, model_from_config_dir, tiny_model_config
from strategies.posteriors import own_token_log_likelihood, own_token_removed, reverse_step, uniform_posterior
from strategies.sampling import SamplerConfig, SampleResult
from tasks.evaluation.likelihood import fixed_noise_nelbo

V = 50


def _model(seed=0):
    return BlockDiffusionLM(build_model(tiny_model_config("llama", V, 64, 32, 2, 4, None, None, True), seed))


def _strategy(own_token="analytic", **cfg):
    return BlockDiffusionStrategy({"vocab_size": V, "block_size": 4, "own_token_evidence": own_token, **cfg})


# ------------------------------------------------------------------ strategy contract (docs/strategies.md §14.5)


def test_registered_supervised_normalization_and_loss():
    s = get_dllm_strategy("block_diffusion")
    assert isinstance(s, BlockDiffusionStrategy) and s.normalization_mode == "supervised"
    # DiffusionGemma (the default architecture) trains the reference's logits; the stack the analytic ones (issue 42)
    assert s.own_token_evidence == "learned" and isinstance(s.create_loss_fn({}), BlockDiffusionCrossEntropyLoss)
    assert isinstance(_strategy("analytic").create_loss_fn(), OwnTokenCanvasLoss)
    assert get_dllm_strategy("block_diffusion", {"architecture": "stack"}).own_token_evidence == "analytic"
    assert s.block_size == 256 and s.self_conditioning_p == 0.5 and s.encoder_loss_weight == 1.0
    # uniform noise, no [MASK]: nothing to resolve, and assembling asks for no mask id (a given one is only recorded)
    assert not s.uses_mask_token and s.setup_extra(SetupContext(None, None, None)) is None
    assert assemble_strategy("block_diffusion", {"vocab_size": 64}, None, None).mask_token_id is None
    assert assemble_strategy("block_diffusion", {"vocab_size": 64}, None, None, mask_token_id=7).mask_token_id == 7
    tuned = _strategy(self_conditioning_p=0.2, encoder_loss_weight=0.3)
    assert (tuned.vocab_size, tuned.block_size) == (V, 4)
    assert (tuned.self_conditioning_p, tuned.encoder_loss_weight) == (0.2, 0.3)
    # create_loss_fn is pure: it checks the options it is given and leaves the strategy's own alone
    assert isinstance(s.create_loss_fn({"block_size": 8}), BlockDiffusionCrossEntropyLoss) and s.block_size == 256
    analytic = s.create_loss_fn({"own_token_evidence": "analytic"})
    assert isinstance(analytic, OwnTokenCanvasLoss) and s.own_token_evidence == "learned"
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        s.create_loss_fn({"block_length": 2})
    built = assemble_strategy("block_diffusion", {"block_size": 4, "architecture": "stack"}, _model(), None)
    assert built.mask_token_id is None and built.strategy.vocab_size == V and built.strategy.block_size == 4
    assert isinstance(built.loss_fn, OwnTokenCanvasLoss)


def test_corruption_needs_vocab_and_draws_in_range():
    ids = torch.randint(0, 40, (4, 32))
    loss = torch.zeros(4, 32)
    loss[:, :24] = 1
    with pytest.raises(ValueError, match="BlockDiffusionStrategy requires dllm.vocab_size"):
        BlockDiffusionStrategy().apply_corruption(ids, loss, 999, eps=1e-3, block_size=None, half_life_ratio=None)
    draw = lambda own: _strategy(own).apply_corruption(  # noqa: E731
        ids, loss, 999, eps=1e-3, block_size=None, half_life_ratio=None, generator=torch.Generator().manual_seed(0)
    )
    noisy, noise, p = draw("analytic")
    assert noisy.min() >= 0 and noisy.max() < V and not (noisy == 999).any()
    assert not noise[:, 24:].any() and torch.equal(noisy[:, 24:], ids[:, 24:])
    # the reference's p_mask is all ones; the analytic loss gets the row's level t instead, the same t the
    # kernel drew (the same noise either way)
    ref_noisy, ref_noise, ref_p = draw("learned")
    assert torch.equal(ref_p, torch.ones(4, 32)) and torch.equal(noisy, ref_noisy) and torch.equal(noise, ref_noise)
    level = 1e-3 + (1 - 1e-3) * torch.rand(4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(p, level[:, None].expand(4, 32))


def test_split_prompt_response():
    loss = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0] * 6 + [1, 1], [1] * 8, [0] * 8])
    prefix, response = BlockDiffusionStrategy.split_prompt_response(torch.zeros(4, 8, dtype=torch.long), loss)
    assert prefix.tolist() == [3, 6, 0, 8]
    assert response[0].tolist() == [False] * 3 + [True] * 5 and not response[3].any()


def test_prepare_batch_encoder_gets_clean_canvas_gets_noisy():
    out = BlockDiffusionStrategy().prepare_batch({"attention_mask": 1, "use_cache": 1, "x": 2}, "noisy", None, "clean")
    assert out == {"x": 2, "input_ids": "clean", "canvas_ids": "noisy"}


def test_multi_turn_rows_are_rejected():
    assert supervised_runs(torch.tensor([[0, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])).tolist() == [2, 1, 0]
    s = _strategy()
    s.validate_data(torch.tensor([[0, 0, 1, 1]]), torch.ones(1, 4))
    with pytest.raises(ValueError, match="single-turn.*row 1 has 2"):
        s.validate_data(torch.tensor([[0, 0, 1, 1], [0, 1, 0, 1]]), torch.ones(2, 4))


# ---------------------------------------------- response window and masks (docs/strategies.md §9.2, §6.3)


def _reference_keep(P, R_b, R, S, bs, b_rows):
    """Element-wise predicate of the batched mask for one example (diagonal always kept)."""
    keep = torch.zeros(R, S + R, dtype=torch.bool)
    for j in range(R):
        for col in range(S + R):
            if col == S + j:
                keep[j, col] = True
            elif j < R_b and col < S:
                rel = col - P
                blk = rel // bs if rel >= 0 else -1
                keep[j, col] = j // bs > blk and rel < R_b
            elif j < R_b and S <= col < S + R_b:
                keep[j, col] = (col - S) // bs == j // bs
    return keep


def test_batched_mask_equals_elementwise_reference_with_per_row_lengths():
    prefix, resp = torch.tensor([2, 0, 5]), torch.tensor([6, 9, 3])
    masks = batched_block_mask(prefix, resp, 9, 10, 4)
    for b in range(3):
        ref = _reference_keep(int(prefix[b]), int(resp[b]), 9, 10, 4, None)
        assert torch.equal(masks["full_attention"][b, 0], ref), b
    assert masks["full_attention"].any(dim=-1).all()  # no query row is fully masked


def test_window_gathers_response_and_scores_exactly_one_block():
    clean = torch.arange(10)[None].repeat(2, 1)
    noisy = clean + 100
    loss = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]])
    attn = torch.tensor([[1] * 10, [1] * 9 + [0]])
    noise = torch.ones(2, 10, dtype=torch.bool)
    w = build_response_window(clean, noisy, noise, loss, torch.ones(2, 10), attn, 3, torch.tensor([0.99, 0.0]))
    assert w.prefix_lengths.tolist() == [3, 1] and w.response_lengths.tolist() == [7, 8]
    assert w.canvas_ids.shape == (2, 8) and w.target_ids[0, :7].tolist() == list(range(3, 10))
    assert w.canvas_ids[1].tolist() == list(range(101, 109)) and w.decoder_position_ids[0].tolist()[:7] == list(
        range(3, 10)
    )
    assert w.decoder_padding_mask[0].tolist() == [False] * 7 + [True]
    # row 0: 3 blocks of 3 over 7 tokens, u=0.99 → last block (positions 6); row 1: u=0 → first block
    assert w.loss_mask[0].nonzero().flatten().tolist() == [6]
    assert w.loss_mask[1].nonzero().flatten().tolist() == [0, 1, 2]
    every = build_response_window(clean, noisy, noise, loss, torch.ones(2, 10), attn, 3, None)
    assert every.loss_mask.sum(dim=1).tolist() == [7, 8]


def test_pre_step_denominators_and_per_sample_reproducible_choices():
    s = _strategy(self_conditioning_p=0.5)
    ids = torch.randint(0, 40, (4, 16))
    mb = Microbatch(ids, torch.ones(4, 16), torch.ones(4, 16))
    ctx = StepContext(model=None, loss_fn=None, mask_token_id=0, step=7, base_seed=1)
    corrupted, _, n_sup = s.pre_step(ctx, [mb])
    n_diff, n_ar = s.loss_denominators(corrupted, 0, n_sup)
    assert isinstance(corrupted[0].extras, CanvasExtras)
    window = corrupted[0].extras.window
    assert n_diff == int(window.loss_mask.sum()) == 16  # one block of 4 per row
    assert n_ar == 4 * 15 and n_sup == 64
    # the same rows split 2+2 over two micro-batches get the same noise, blocks and coins
    ctx2 = StepContext(model=None, loss_fn=None, mask_token_id=0, step=7, base_seed=1, grad_acc_steps=2)
    halves, _, _ = s.pre_step(
        ctx2,
        [
            Microbatch(ids[:2], mb.loss_mask[:2], mb.attention_mask[:2]),
            Microbatch(ids[2:], mb.loss_mask[2:], mb.attention_mask[2:]),
        ],
    )
    assert torch.equal(torch.cat([h.noisy_ids for h in halves]), corrupted[0].noisy_ids)
    assert torch.equal(torch.cat([h.extras.window.loss_mask for h in halves]), window.loss_mask)
    assert torch.equal(torch.cat([h.extras.self_condition for h in halves]), corrupted[0].extras.self_condition)


# ------------------------------------------------------------------ the model (docs/strategies.md §9.5)


def test_model_leakage_own_block_hidden_earlier_blocks_visible():
    model = _model().eval()
    torch.nn.init.normal_(model.self_cond.weight)
    ids, canvas = torch.randint(0, V, (2, 12)), torch.randint(0, V, (2, 12))
    full, _ = build_block_diffusion_training_mask(0, 12, 12, 4, batch_size=2)
    run = lambda x: model(input_ids=x, canvas_ids=canvas, decoder_attention_mask=full).logits  # noqa: E731
    with torch.no_grad():
        base = run(ids)
        own = ids.clone()
        own[:, 5] = (own[:, 5] + 1) % V  # a clean token of block 1
        moved = run(own)
        assert (moved[:, :8] - base[:, :8]).abs().max() < 1e-5  # blocks 0 and 1 cannot see it
        assert (moved[:, 8:] - base[:, 8:]).abs().max() > 1e-4  # block 2 sees clean block 1
        early = ids.clone()
        early[:, 1] = (early[:, 1] + 1) % V
        assert (run(early)[:, 4:8] - base[:, 4:8]).abs().max() > 1e-4  # block 1 sees clean block 0


def test_model_training_path_two_passes_and_gradients():
    model = _model().train()
    ids, canvas = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 8))
    full, _ = build_block_diffusion_training_mask(0, 8, 8, 4, batch_size=2)
    out = model(
        input_ids=ids,
        canvas_ids=canvas,
        decoder_attention_mask={"full_attention": full},
        do_self_conditioning=torch.tensor([True, False]),
    )
    assert out.logits.shape == out.encoder_logits.shape == (2, 8, V)
    (out.logits.sum() + encoder_ar_loss(out.encoder_logits, ids)).backward()
    assert model.self_cond.weight.grad.abs().sum() > 0  # pass 2 trains the self-conditioning projection
    k_proj = model.lm.model.layers[0].self_attn.k_proj.weight
    assert k_proj.grad is not None and k_proj.grad.abs().sum() > 0
    # with the coin off for every row the output equals a single no-self-conditioning pass
    model.zero_grad()
    torch.nn.init.normal_(model.self_cond.weight)
    off = model(
        input_ids=ids,
        canvas_ids=canvas,
        decoder_attention_mask=full,
        do_self_conditioning=torch.zeros(2, dtype=torch.bool),
    )
    model.eval()
    with torch.no_grad():
        single = model(input_ids=ids, canvas_ids=canvas, decoder_attention_mask=full)
    assert torch.allclose(off.logits.detach(), single.logits, atol=1e-5) and single.encoder_logits is None


def test_model_input_errors():
    model = _model().train()
    ids = torch.zeros(1, 8, dtype=torch.long)
    full, _ = build_block_diffusion_training_mask(0, 8, 8, 4, batch_size=1)
    with pytest.raises(ValueError, match="needs input_ids, canvas_ids and decoder_attention_mask"):
        model(input_ids=ids, canvas_ids=ids)
    with pytest.raises(ValueError, match="decoder_position_ids is required"):
        model(input_ids=ids, canvas_ids=ids[:, :4], decoder_attention_mask=full[:, :, :4, :12])
    with pytest.raises(ValueError, match="do_self_conditioning must be given in training"):
        model(input_ids=ids, canvas_ids=ids, decoder_attention_mask=full)


def test_checkpoint_round_trip_rebuilds_the_wrapper(tmp_path):
    model = _model().eval()
    torch.nn.init.normal_(model.self_cond.weight)
    write_checkpoint(tmp_path / "ckpt", model, None, {"strategy": "block_diffusion"})
    again = model_from_config_dir(tmp_path / "ckpt")
    load_weights_into(again, tmp_path / "ckpt")
    assert isinstance(again, BlockDiffusionLM)
    ids = torch.randint(0, V, (1, 8))
    full, _ = build_block_diffusion_training_mask(0, 8, 8, 4, batch_size=1)
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=ids, canvas_ids=ids, decoder_attention_mask=full).logits,
            again.eval()(input_ids=ids, canvas_ids=ids, decoder_attention_mask=full).logits,
        )


@pytest.mark.parametrize("own_token", ["analytic", "learned"])
def test_forward_backward_equals_hand_loss(own_token):
    torch.manual_seed(0)
    model = _model()
    s = _strategy(own_token, encoder_loss_weight=0.7)
    ids = torch.randint(0, 40, (2, 12))
    mb = Microbatch(ids, torch.ones(2, 12), torch.ones(2, 12))
    ctx = StepContext(model=model, loss_fn=s.create_loss_fn(), mask_token_id=0, step=2, base_seed=0)
    corrupted, n_noise, n_sup = s.pre_step(ctx, [mb])
    n_diff, n_ar = s.loss_denominators(corrupted, n_noise, n_sup)
    c = corrupted[0]
    w = c.extras.window
    # the model's self-conditioning projection is zero-initialised: one pass = the two-pass output
    out = s.forward_backward(ctx, c, num_diffusion_tokens=n_diff, num_ar_tokens=n_ar, is_train=True)
    with torch.no_grad():
        model.eval()
        logits = model(input_ids=ids, canvas_ids=w.canvas_ids, decoder_attention_mask=w.decoder_attention_mask).logits
        encoder_logits = model.lm(input_ids=ids).logits
    if own_token == "analytic":  # the posterior: the model's x̂ times q(z | x) at the row's own level
        assert (w.p_mask < 1).all()
        logits = logits.double() + own_token_log_likelihood(w.canvas_ids, 1 - w.p_mask[:, :1].double(), V)
    canvas = per_token_nll(logits, w.target_ids)[w.loss_mask].sum() / n_diff
    ar = per_token_nll(encoder_logits[:, :-1], ids[:, 1:]).sum() / n_ar
    assert torch.allclose(out.dllm_loss.double(), canvas.double(), rtol=1e-5)
    assert torch.allclose(out.total_loss.detach().double(), canvas.double() + 0.7 * ar, rtol=1e-5)


def test_own_token_loss_is_the_posterior_cross_entropy_even_at_the_ends():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, V, generator=gen, requires_grad=True)
    target = torch.randint(0, V, (3, 5), generator=gen)
    canvas = torch.where(torch.rand(3, 5, generator=gen) < 0.5, target, torch.randint(0, V, (3, 5), generator=gen))
    level = torch.tensor([1e-3, 0.4, 1.0])[:, None].expand(3, 5)  # t = 1: the canvas says nothing
    scored = torch.rand(3, 5, generator=gen) < 0.8
    out = OwnTokenCanvasLoss()(logits, corrupted(target, None, level, scored, noisy=canvas), TokenCounts(7))
    posterior = logits.double() + own_token_log_likelihood(canvas, 1 - level[:, :1].double().clamp_max(1 - 1e-6), V)
    hand = per_token_nll(posterior, target)[scored].sum() / 7
    assert torch.allclose(out.total_loss.double(), hand, rtol=1e-5)
    out.total_loss.backward()
    assert torch.isfinite(logits.grad).all()
    # at t = 1 it is the plain cross-entropy; with a deferred head (chunked logits) the same value
    plain = OwnTokenCanvasLoss()(
        logits[2:], corrupted(target[2:], None, level[2:], scored[2:], noisy=canvas[2:]), TokenCounts()
    )
    assert torch.allclose(plain.total_loss, per_token_nll(logits[2:], target[2:])[scored[2:]].mean(), rtol=1e-5)
    hidden, weight = torch.randn(3, 5, 8, generator=gen), torch.randn(V, 8, generator=gen)
    deferred = OwnTokenCanvasLoss()(
        HeadProjection(hidden, weight), corrupted(target, None, level, scored, noisy=canvas), TokenCounts()
    ).total_loss
    dense = OwnTokenCanvasLoss()(
        hidden @ weight.T, corrupted(target, None, level, scored, noisy=canvas), TokenCounts()
    ).total_loss
    assert torch.allclose(deferred, dense, rtol=1e-5)
    with pytest.raises(ValueError, match=r"needs batch\.noisy_ids"):
        OwnTokenCanvasLoss()(logits, corrupted(target, None, level, scored), TokenCounts())


# ------------------------------------------------------------------ the uniform-noise bound


def _discrete_bound(pi_logits, x, vocab, steps):
    """T-step discrete-time NELBO of the same process, by exact enumeration over z (a reference)."""
    ex = torch.nn.functional.one_hot(torch.tensor(x), vocab).double()
    marg = lambda a, xv: a * xv + (1 - a) / vocab  # noqa: E731

    def post(i, a_t, a_s, xv):
        like = torch.full((vocab,), (1 - a_t / a_s) / vocab, dtype=torch.float64)
        like[i] += a_t / a_s
        p = like * marg(a_s, xv)
        return p / p.sum()

    total = 0.0
    for k in range(1, steps + 1):
        t, a_t, a_s = k / steps, 1 - k / steps, 1 - (k - 1) / steps
        qz = marg(a_t, ex)
        for i in range(vocab):
            pp = post(i, a_t, a_s, torch.softmax(pi_logits(i, t), -1))
            if k == 1:
                total += float(qz[i]) * -float(pp[x].log())
            else:
                qp = post(i, a_t, a_s, ex)
                keep = qp > 0
                total += float(qz[i]) * float((qp[keep] * (qp[keep].log() - pp[keep].log())).sum())
    return total


def test_uniform_bound_is_the_continuous_limit_of_the_discrete_time_nelbo():
    vocab, x = 5, 2
    w = torch.randn(vocab, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pi_logits = lambda z, t: w[z] * (1 + 2 * t)  # noqa: E731  a denoiser that reads z_t and t
    m = 100_000
    t = (torch.arange(m, dtype=torch.float64) + 0.5) / m
    cont = 0.0
    for z in range(vocab):
        qz = (1 - t) * float(z == x) + t / vocab
        terms = uniform_diffusion_nelbo_terms(
            pi_logits(z, t[:, None])[:, None, :], torch.full((m, 1), x), torch.full((m, 1), z), 1 - t, vocab
        )[:, 0]
        cont += float((qz * terms).mean())
    coarse, fine = _discrete_bound(pi_logits, x, vocab, 500), _discrete_bound(pi_logits, x, vocab, 1000)
    assert fine < coarse and abs(fine - cont) < abs(coarse - cont)  # the discrete bound tightens toward it
    assert abs((2 * fine - coarse) - cont) < 5e-5  # Richardson-extrapolated O(1/T) limit


def test_uniform_bound_zero_for_a_perfect_denoiser_and_positive_otherwise():
    target = torch.tensor([[3, 1, 4]])
    noisy = torch.tensor([[0, 1, 2]])
    alpha = torch.tensor([0.4])
    perfect = torch.nn.functional.one_hot(target, 6).double() * 60.0
    assert uniform_diffusion_nelbo_terms(perfect, target, noisy, alpha, 6).abs().max() < 1e-12
    assert (uniform_diffusion_nelbo_terms(torch.zeros(1, 3, 6), target, noisy, alpha, 6) > 0).all()
    with pytest.raises(ValueError, match="vocab_size=7"):
        uniform_diffusion_nelbo_terms(torch.zeros(1, 3, 6), target, noisy, alpha, 7)


class _Fixed(torch.nn.Module):
    """A denoiser whose logits depend on the canvas alone: zero (x̂ uniform) unless `fn(canvas)` is given."""

    def __init__(self, fn=None):
        super().__init__()
        self.fn = fn

    def forward(self, input_ids, canvas_ids, **_):
        return DLLMOutput(logits=torch.zeros(*canvas_ids.shape, V) if self.fn is None else self.fn(canvas_ids))


def _know_nothing_integrand(alpha):
    """E_z of the integrand for x̂ uniform, by hand: x̄_θ ≡ 1, and with x̄_x = 1 + (V − 1)·α the linear terms
    cancel in expectation, leaving ((V − 1)/V)·log((1 + (V − 1)·α)/(1 − α)). Its integral over α ∈ (0, 1) is
    ((V − 1)/V)·(V·ln V/(V − 1) − 1 + 1) = ln V."""
    return (V - 1) / V * torch.log((1 + (V - 1) * alpha) / (1 - alpha))


def test_know_nothing_denoiser_bound_is_ln_v():
    x = 7
    alpha = torch.tensor([0.05, 0.5, 0.93], dtype=torch.float64)
    z = torch.arange(V)
    q = alpha[:, None] * (z == x) + (1 - alpha[:, None]) / V  # q(z | x) [3, V]
    target = torch.full((3, V), x)
    canvas = z[None].expand(3, V)
    exact = lambda logits: (q * uniform_diffusion_nelbo_terms(logits, target, canvas, alpha, V)).sum(-1)  # noqa: E731
    # analytic own-token evidence: knowing nothing is x̂ uniform, i.e. zero logits
    assert torch.allclose(exact(torch.zeros(3, V, V)), _know_nothing_integrand(alpha), rtol=1e-10)
    # learned (the reference's output is the posterior): knowing nothing is π(x) ∝ q(z | x); dividing q
    # out again gives x̂ uniform, the same value. The posterior plugged in as if it were x̂ scores far worse.
    posterior = own_token_log_likelihood(canvas, alpha[:, None], V)
    assert torch.allclose(exact(own_token_removed(posterior, canvas, alpha[:, None], V)), exact(torch.zeros(3, V, V)))
    assert (exact(posterior) > 1.05 * _know_nothing_integrand(alpha)).all()
    m = 400_000
    a = (torch.arange(m, dtype=torch.float64) + 0.5) / m
    assert abs(float(_know_nothing_integrand(a).mean()) - math.log(V)) < 1e-4
    # the evaluation's estimator over a zero-logit model: ln V within its standard error
    s = _strategy()
    ids = torch.randint(0, V, (512, 8), generator=torch.Generator().manual_seed(0))
    nelbo, se, n = fixed_noise_nelbo(s, _Fixed(), (ids, torch.ones(512, 8)), 0, EvalConfig(t_samples=8, batch_size=512))
    assert n == 512 * 8 and se < 0.15 and abs(nelbo - math.log(V)) < 3 * se


def test_briefly_trained_model_bound_is_well_below_ln_v():
    """Rows are runs (a, a + 1, …) mod 40: a few steps of training must beat knowing nothing (ln V) by a clear
    margin under the evaluation's own estimator. (The reference's flat posterior loss, scored with the
    posterior plugged in as x̂, stays above ln V on this data.)"""
    torch.manual_seed(0)
    model, s = _model(), _strategy()
    ctx_of = lambda step: StepContext(model=model, loss_fn=s.create_loss_fn(), mask_token_id=0, step=step, base_seed=0)  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    gen = torch.Generator().manual_seed(0)
    runs = lambda n: (torch.randint(0, 40, (n, 1), generator=gen) + torch.arange(12)) % 40  # noqa: E731
    for step in range(20):
        ids = runs(16)
        ctx = ctx_of(step)
        corrupted, n_noise, n_sup = s.pre_step(ctx, [Microbatch(ids, torch.ones(16, 12), torch.ones(16, 12))])
        n_diff, n_ar = s.loss_denominators(corrupted, n_noise, n_sup)
        s.forward_backward(ctx, corrupted[0], num_diffusion_tokens=n_diff, num_ar_tokens=n_ar, is_train=True)
        opt.step()
        opt.zero_grad()
    ids = runs(32)
    nelbo, se, _ = fixed_noise_nelbo(s, model, (ids, torch.ones(32, 12)), 0, EvalConfig(t_samples=8, batch_size=32))
    assert nelbo < math.log(V) - 0.5 and nelbo + 3 * se < math.log(V), (nelbo, se)


def test_nelbo_rows_scores_every_block_and_is_finite():
    s = _strategy()
    model = _model().eval()
    ids = torch.randint(0, 40, (3, 12))
    with torch.no_grad():
        rows = s.nelbo_rows(
            model, ids, torch.ones(3, 12), 0, torch.tensor([0.2, 0.5, 0.9]), torch.Generator().manual_seed(0)
        )
    assert rows.shape == (3,) and torch.isfinite(rows).all() and (rows > 0).all()


# ------------------------------------------------------------------ canvas sampler


def test_uniform_posterior_is_a_distribution_and_exact_at_the_end():
    probs = torch.softmax(torch.randn(2, 3, 7, dtype=torch.float64), -1)
    z = torch.randint(0, 7, (2, 3))
    post = uniform_posterior(probs, z, 0.3, 0.6)
    assert torch.allclose(post.sum(-1), torch.ones(2, 3, dtype=torch.float64)) and (post >= 0).all()
    onehot = torch.nn.functional.one_hot(torch.tensor([[4, 4, 4]]), 7).double()
    assert torch.equal(
        uniform_posterior(onehot, torch.tensor([[0, 4, 6]]), 0.5, 1.0).argmax(-1), torch.tensor([[4, 4, 4]])
    )


def test_reverse_step_is_the_posterior_mixture_of_exact_kernels():
    """Σ_x π(x)·q(z_s | z_t, x), each kernel written out by Bayes' rule, against `reverse_step`; the plug-in
    `uniform_posterior(π)` (the evidence of z_t counted twice) keeps z_t more often than the exact kernel."""
    vocab, a_t, a_s = 6, 0.55, 0.8
    pi = torch.softmax(torch.randn(vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), -1)
    z_t = torch.tensor([2])
    onehot = torch.eye(vocab, dtype=torch.float64)
    exact = sum(pi[x] * uniform_posterior(onehot[x][None], z_t, a_t, a_s)[0] for x in range(vocab))
    assert torch.allclose(reverse_step(pi[None], z_t, a_t, a_s)[0], exact, atol=1e-12)
    assert uniform_posterior(pi[None], z_t, a_t, a_s)[0, 2] > exact[2] + 0.05
    # at the first step (α_t = 0) there is no evidence to remove; a one-hot π is left as it is
    assert torch.allclose(reverse_step(pi[None], z_t, 0.0, a_s), uniform_posterior(pi[None], z_t, 1e-12, a_s))
    sure = onehot[4][None]
    assert torch.allclose(reverse_step(sure, z_t, a_t, a_s), uniform_posterior(sure, z_t, a_t, a_s))


class _Confident(torch.nn.Module):
    """A denoiser that always predicts token (absolute position % 7) + 10, whatever it sees."""

    def forward(self, input_ids, canvas_ids, decoder_attention_mask, decoder_position_ids=None, **_):
        target = decoder_position_ids % 7 + 10
        return DLLMOutput(logits=torch.nn.functional.one_hot(target, V).float() * 50)


def test_canvas_sampler_reproduces_a_confident_denoiser_and_keeps_the_prompt():
    prompts = [[1, 2, 3], [4]]
    cfg = SamplerConfig(steps=8, max_new_tokens=8, block_size=4, temperature=0.0)
    res = block_canvas_sample(
        _Confident(),
        prompts,
        vocab_size=V,
        block_size=4,
        pad_token_id=0,
        config=cfg,
        generator=torch.Generator().manual_seed(0),
    )
    assert isinstance(res, SampleResult) and res.nfe == 2 * 4  # blocks × steps per block, per row
    for row, p in enumerate(prompts):
        assert res.tokens[row, : len(p)].tolist() == p
        assert res.generated(row).tolist() == [(len(p) + j) % 7 + 10 for j in range(8)]


def test_canvas_sampler_stops_after_an_eos_block():
    cfg = SamplerConfig(steps=12, max_new_tokens=12, block_size=4, temperature=0.0, eos_token_id=12)
    res = block_canvas_sample(
        _Confident(),
        [[1]],
        vocab_size=V,
        block_size=4,
        pad_token_id=0,
        config=cfg,
        generator=torch.Generator().manual_seed(0),
    )
    # positions 1..4 → 11, 12(EOS), 13, 14: the first block holds EOS, so one block only
    assert res.nfe == 4 and res.generated(0).tolist()[:4] == [11, 12, 13, 14]
    assert res.generated(0).tolist()[4:] == [12] * 8  # EOS fill after the stop
    assert math.isclose(len(res.generated(0)), 12)


class _Peaked(torch.nn.Module):
    """A denoiser that gives token (position % 7) + 10 probability ≈ 0.95 and spreads the rest evenly."""

    def forward(self, input_ids, canvas_ids, decoder_attention_mask, decoder_position_ids=None, **_):
        top = (decoder_position_ids % 7 + 10)[..., None]
        return DLLMOutput(logits=torch.zeros(*canvas_ids.shape, V).scatter(-1, top, math.log(0.95 * 49 / 0.05)))


@pytest.mark.parametrize("own_token", ["analytic", "learned"])
def test_canvas_sampler_honours_top_p(own_token):
    """At temperature 1 the peaked denoiser leaves ≈ 5 % of x̂ to other tokens; with analytic own-token
    evidence the posterior also lifts a stray canvas token, to at most ≈ 16 % of the top token's mass at
    these levels. Top-p 0.8 keeps the top token alone, so the sample is exactly that token everywhere;
    with top-p 1 it is not."""
    expected = [(1 + j) % 7 + 10 for j in range(24)]

    def draw(top_p):
        cfg = SamplerConfig(steps=12, max_new_tokens=24, block_size=8, temperature=1.0, top_p=top_p)
        res = block_canvas_sample(
            _Peaked(),
            [[1]],
            vocab_size=V,
            block_size=8,
            pad_token_id=0,
            config=cfg,
            generator=torch.Generator().manual_seed(0),
            own_token_evidence=own_token,
        )
        return res.generated(0).tolist()

    assert draw(0.8) == expected and draw(1.0) != expected


class _Unsure(torch.nn.Module):
    """x̂ puts 0.2 on token (position % 7) + 10 and spreads 0.8 over the other 49 tokens (analytic logits)."""

    def forward(self, input_ids, canvas_ids, decoder_attention_mask, decoder_position_ids=None, **_):
        top = (decoder_position_ids % 7 + 10)[..., None]
        return DLLMOutput(logits=torch.zeros(*canvas_ids.shape, V).scatter(-1, top, math.log(0.2 * 49 / 0.8)))


def test_low_confidence_canvas_never_settles_its_own_noise():
    """Late in a block a canvas token is clean with probability α_t, so the posterior of an unsure denoiser
    keeps whatever token it sees: the exact ancestral sampler at temperature 0 leaves the starting noise in
    place. The low-confidence sampler knows which positions hold fresh noise, reads x̂ there and settles
    the denoiser's own choice at every position."""
    expected = [(1 + j) % 7 + 10 for j in range(16)]

    def greedy(remasking):
        cfg = SamplerConfig(steps=16, max_new_tokens=16, block_size=8, temperature=0.0, remasking=remasking)
        res = block_canvas_sample(
            _Unsure(),
            [[1]],
            vocab_size=V,
            block_size=8,
            pad_token_id=0,
            config=cfg,
            generator=torch.Generator().manual_seed(0),
        )
        return res.generated(0).tolist()

    assert greedy("low_confidence") == expected
    assert sum(a != b for a, b in zip(greedy("random"), expected)) >= 4
    with pytest.raises(NotImplementedError, match="unknown remasking"):
        greedy("top_k_margin")


def _old_analytic_corruption(strategy, ids, loss, eps, generator):
    """`apply_corruption` under "analytic" evidence as it was before the uniform kernel returned its level
    (kept verbatim): the level re-drawn from a fork of the generator, then the kernel run on the generator."""
    fork = torch.Generator(device=generator.device)
    fork.set_state(generator.get_state())
    level = eps + (1 - eps) * torch.rand(ids.shape[0], generator=fork, device=ids.device)
    noisy, noise, p_mask = corrupt_uniform_random(ids, loss, strategy.vocab_size, eps=eps, generator=generator)
    return noisy, noise, level[:, None].expand_as(p_mask).to(p_mask.dtype).contiguous()


@pytest.mark.parametrize("eps", [1e-3, 0.2])
def test_corruption_takes_the_kernels_level_and_equals_the_forked_redraw(eps):
    """The level the analytic loss reads is the one the kernel returns (no fork of the generator re-drawing it),
    and the corruption is bit for bit what the fork gave: same seeds, same noise, same p_mask."""
    ids = torch.randint(0, 40, (6, 20), generator=torch.Generator().manual_seed(1))
    loss = torch.ones(6, 20)
    loss[:, :5] = 0
    s = _strategy("analytic")
    for seed in range(4):
        new = s.apply_corruption(
            ids,
            loss,
            None,
            eps=eps,
            block_size=None,
            half_life_ratio=None,
            generator=torch.Generator().manual_seed(seed),
        )
        old = _old_analytic_corruption(s, ids, loss, eps, torch.Generator().manual_seed(seed))
        assert all(torch.equal(a, b) for a, b in zip(new, old))


def test_analytic_and_learned_draw_the_same_noise_from_the_global_rng():
    """Without a generator both evidence modes draw from the global RNG the same way (the analytic mode used
    to draw a seed from it first, for its fork, and so corrupted differently)."""
    ids, loss = torch.randint(0, 40, (3, 16)), torch.ones(3, 16)
    draws = {}
    for own in ("analytic", "learned"):
        torch.manual_seed(11)
        draws[own] = _strategy(own).apply_corruption(ids, loss, None, eps=1e-3, block_size=None, half_life_ratio=None)
    assert torch.equal(draws["analytic"][0], draws["learned"][0]) and torch.equal(
        draws["analytic"][1], draws["learned"][1]
    )
    torch.manual_seed(11)
    level = 1e-3 + (1 - 1e-3) * torch.rand(3)
    assert torch.equal(draws["analytic"][2], level[:, None].expand(3, 16))
