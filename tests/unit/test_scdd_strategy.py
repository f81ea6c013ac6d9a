"""SCDDStrategy (docs/strategies.md §8.2, §14.5 [PR]): config threading, setup checks, corruption contract, training,
the optional time conditioning and the checkpoints with and without it."""

import pytest
import torch

from dllm_common.checkpoint import write_checkpoint
from strategies import (
    Microbatch,
    SCDDLoss,
    SCDDStrategy,
    SetupContext,
    StepContext,
    assemble_strategy,
    get_dllm_strategy,
)
from strategies.base_evaluation import SampleRequest
from strategies.models import build_model, model_logits, time_embedding, tiny_model_config
from strategies.sampling import SamplerConfig
from strategies.seeding import seeded_generator as gen
from tasks.evaluation.trained_model import load_trained_model

V, M = 64, 63


def _strategy(**cfg):
    return SCDDStrategy({"vocab_size": V, "mask_token_id": M, **cfg})


def _corrupt(s, ids, loss, seed=0, eps=1e-3):
    return s.apply_corruption(ids, loss, M, eps=eps, block_size=None, half_life_ratio=None, generator=gen(seed))


def test_registered_with_supervised_normalization():
    s = get_dllm_strategy("scdd")
    assert isinstance(s, SCDDStrategy) and s.normalization_mode == "supervised"


def test_config_threading_and_chunk_size():
    s = _strategy(num_timesteps=8, uniform_ratio=0.3, schedule_shape=2.0, schedule_peak=0.4, chunk_size=256)
    loss = s.loss_fn
    assert isinstance(loss, SCDDLoss) and (
        loss.num_timesteps,
        loss.max_ratio,
        loss.gamma_shape,
        loss.t_peak,
        loss.chunk_size,
    ) == (8, 0.3, 2.0, 0.4, 256)
    assert _strategy().loss_fn.chunk_size == 1024 and _strategy(chunk_size=None).loss_fn.chunk_size is None
    # create_loss_fn is a pure builder: a new loss from the given options, the strategy unchanged
    other = s.create_loss_fn({"vocab_size": V, "mask_token_id": 7, "num_timesteps": 4})
    assert other is not loss and (other.num_timesteps, other.mask_token_id) == (4, 7)
    assert s.loss_fn is loss and (loss.num_timesteps, loss.mask_token_id) == (8, M) and s.vocab_size == V
    assert get_dllm_strategy("scdd", {"vocab_size": V}).loss_fn.mask_token_id == 0  # unresolved: 0 until assembled


def test_errors_of_spec_16():
    with pytest.raises(ValueError, match="SCDDStrategy requires dllm.vocab_size"):
        SCDDStrategy().create_loss_fn({"mask_token_id": M})
    with pytest.raises(ValueError, match="SCDDStrategy needs dllm.vocab_size before corruption"):
        SCDDStrategy().apply_corruption(
            torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4), M, eps=1e-3, block_size=None, half_life_ratio=None
        )
    with pytest.raises(ValueError, match="SCDDStrategy needs dllm.vocab_size before sampling"):
        SCDDStrategy().sample(None, SampleRequest([[1]], M, 0, SamplerConfig()))
    model = build_model(tiny_model_config("llama", V, 8, 16, 1, 2, None, None, True), 0)
    with pytest.raises(ValueError, match="requires dllm.mask_token_id"):
        _strategy().setup_extra(SetupContext(model, None, None))
    with pytest.raises(ValueError, match="outside the model vocab"):
        _strategy().setup_extra(SetupContext(model, None, V))
    wrong = SCDDStrategy({"vocab_size": V + 1})
    with pytest.raises(ValueError, match="does not match the model vocab"):
        wrong.setup_extra(SetupContext(model, None, M))


def test_setup_installs_the_resolved_mask_id():
    s = SCDDStrategy({"vocab_size": V, "mask_token_id": None})  # null: placeholder until assembled
    model = build_model(tiny_model_config("llama", V, 8, 16, 1, 2, None, None, True), 0)
    assert s.setup_extra(SetupContext(model, None, 5)) == 5 and s.loss_fn.mask_token_id == 0  # nothing patched
    built = assemble_strategy("scdd", {"vocab_size": V, "mask_token_id": None}, model, None, mask_token_id=5)
    assert built.mask_token_id == 5 and built.loss_fn.mask_token_id == 5 and built.strategy.loss_fn.mask_token_id == 5
    assert built.strategy.options.mask_token_id == 5 and built.strategy.vocab_size == V
    # vocab_size unset: the model's
    assert assemble_strategy("scdd", {}, model, None, mask_token_id=5).strategy.vocab_size == V


def test_times_lie_on_the_inner_grid():
    s = _strategy(num_timesteps=8)
    ids = torch.randint(0, M, (256, 4), generator=gen(1))
    rows = [_corrupt(s, ids[i : i + 1], torch.ones(1, 4), seed=i)[2] for i in range(256)]
    k = torch.cat(rows)[:, 0] * 8
    assert torch.allclose(k, k.round()) and k.min() >= 1 and k.max() == 7


def test_corruption_contract_and_both_channels():
    s = _strategy(uniform_ratio=0.4)
    ids = torch.randint(0, M, (64, 32), generator=gen(2))
    loss = torch.ones(64, 32)
    loss[:, :8] = 0
    noisy, noise, p = _corrupt(s, ids, loss)
    assert torch.equal(noise, noisy != ids) and not (noise & ~loss.bool()).any()
    assert p.dtype == torch.float32 and torch.equal(p, p[:, :1].expand_as(p))
    assert (noisy == M).any() and ((noisy != M) & (noisy != ids)).any()  # absorbed and uniform channels
    torch.manual_seed(0)
    state = torch.get_rng_state()
    again = _corrupt(s, ids, loss)
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(again[0], noisy)


def test_uniform_warmup_ramps_the_input_noise_in_training_only():
    """`uniform_warmup_steps: 100`: a training step at step k uses uniform_ratio × k/100 of the uniform channel
    (none at step 0, the rest of that mass left clean; [MASK]s unchanged), the full channel from step 100 on and
    in validation, whatever the step; the loss module is the same at every step."""
    ids = torch.randint(0, M, (256, 32), generator=gen(2))
    mb = Microbatch(ids, torch.ones(256, 32), torch.ones(256, 32))
    plain, warm = _strategy(uniform_ratio=0.4), _strategy(uniform_ratio=0.4, uniform_warmup_steps=100)

    def noisy(strategy, step, training=True):
        ctx = StepContext(model=None, loss_fn=None, mask_token_id=M, step=step, base_seed=0, training=training)
        return strategy.corrupt_microbatch(ctx, mb, 0).noisy_ids

    def replaced(z):
        return float(((z != M) & (z != ids)).float().mean())

    assert torch.equal(noisy(warm, 100), noisy(plain, 100)) and torch.equal(noisy(warm, 250), noisy(plain, 250))
    assert torch.equal(noisy(warm, 3, training=False), noisy(plain, 3, training=False))
    start, half, full = noisy(warm, 0), noisy(warm, 50), noisy(plain, 50)
    assert replaced(start) == 0 and torch.equal(start == M, noisy(plain, 0) == M)
    assert torch.equal(half == M, full == M)
    assert replaced(half) == pytest.approx(replaced(full) / 2, rel=0.15) and replaced(full) > 0.05
    assert plain.uniform_scale(StepContext(None, None, M, 7, 0)) == 1.0
    assert warm.uniform_scale(StepContext(None, None, M, 25, 0)) == 0.25


def test_prepare_batch_feeds_noisy_ids_without_attention_mask():
    out = _strategy().prepare_batch(
        {"attention_mask": torch.ones(1, 3)}, torch.tensor([[1, M, 3]]), None, torch.tensor([[1, 2, 3]])
    )
    assert out["input_ids"].tolist() == [[1, M, 3]] and "attention_mask" not in out


def test_strategy_and_loss_handshake_gives_gradients():
    s = _strategy()
    model = build_model(tiny_model_config("llama", V, 16, 16, 1, 2, None, None, True), 0)
    ids = torch.randint(0, M, (4, 16), generator=gen(3))
    ctx = StepContext(model=model, loss_fn=s.loss_fn, mask_token_id=M, step=3, base_seed=0)
    corrupted, _, n_sup = s.pre_step(ctx, [Microbatch(ids, torch.ones(4, 16), torch.ones(4, 16))])
    out = s.forward_backward(ctx, corrupted[0], num_diffusion_tokens=n_sup, num_ar_tokens=n_sup, is_train=True)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.isfinite(out.total_loss) and grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def _timed_strategy(model):
    built = assemble_strategy("scdd", {"vocab_size": V, "mask_token_id": M, "time_conditioning": True}, model, None)
    emb = time_embedding(model)
    torch.nn.init.normal_(emb.mlp[2].weight, std=0.05)  # as after some training: the output depends on t
    seen = []
    emb.register_forward_hook(lambda module, args, out: seen.append(args[0].detach().clone()))
    return built, emb, seen


def test_time_conditioning_reads_t_in_training_in_the_bound_and_in_the_samplers():
    model = build_model(tiny_model_config("llama", V, 16, 16, 1, 2, None, None, True), 0)
    built, emb, seen = _timed_strategy(model)
    s = built.strategy
    assert model.config.dllm_time_conditioning and time_embedding(_tiny_model()) is None
    ids = torch.randint(0, M, (4, 16), generator=gen(3))
    ctx = StepContext(model=model, loss_fn=built.loss_fn, mask_token_id=M, step=3, base_seed=0)
    corrupted, _, n_sup = s.pre_step(ctx, [Microbatch(ids, torch.ones(4, 16), torch.ones(4, 16))])
    s.forward_backward(ctx, corrupted[0], num_diffusion_tokens=n_sup, num_ar_tokens=n_sup, is_train=True)
    assert torch.equal(seen[-1], corrupted[0].p_mask[:, 0])  # training: each row's own t
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in emb.parameters())

    t = torch.tensor([0.1234, 0.5, 0.9, 0.0001])
    rows = s.nelbo_rows(model, ids, torch.ones(4, 16), M, t, gen(0))
    assert torch.isfinite(rows).all() and torch.allclose(seen[-1], torch.tensor([0.124, 0.5, 0.9, 0.001]))  # grid

    seen.clear()
    config = SamplerConfig(steps=3, max_new_tokens=4, temperature=1.0)
    s.sample(model, SampleRequest([[1, 2]], M, 0, config, gen(1)))
    assert torch.allclose(torch.cat(seen), torch.linspace(1, 1e-3, 4))  # each step's t, then eps in the final pass
    seen.clear()
    x = torch.tensor([[1, M, M, 4], [M, M, M, M]])
    s.denoiser(model)(x, torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))  # the absorbing sampler: t = share of [MASK]
    assert torch.allclose(seen[-1], torch.tensor([2 / 3, 1.0]))


def _tiny_model():
    return build_model(tiny_model_config("llama", V, 16, 16, 1, 2, None, None, True), 0)


def test_checkpoints_with_and_without_time_conditioning_load(tmp_path):
    """A checkpoint trained before the option existed (options without the key) rebuilds an unconditioned
    backbone with the same logits; a time-conditioned one rebuilds its time embedding."""
    ids = torch.randint(0, M, (2, 16), generator=gen(4))
    plain = _tiny_model()
    legacy = {"vocab_size": V, "mask_token_id": M, "num_timesteps": 1000, "uniform_ratio": 0.1}
    write_checkpoint(tmp_path / "plain", plain, meta={"strategy": "scdd", "options": legacy})
    model = load_trained_model(tmp_path / "plain", "cpu")
    built = assemble_strategy("scdd", legacy, model, None, mask_token_id=M)
    assert time_embedding(model) is None and not built.strategy.options.time_conditioning
    assert torch.equal(model_logits(model, {"input_ids": ids}), model_logits(plain, {"input_ids": ids}))

    timed = _tiny_model()
    _timed_strategy(timed)
    write_checkpoint(tmp_path / "timed", timed, meta={"strategy": "scdd"})
    model = load_trained_model(tmp_path / "timed", "cpu")
    s = assemble_strategy("scdd", {**legacy, "time_conditioning": True}, model, None, mask_token_id=M).strategy
    t = torch.tensor([0.3, 0.8])
    assert torch.equal(model_logits(model, {"input_ids": ids}, time=t), model_logits(timed, {"input_ids": ids}, time=t))
    config = SamplerConfig(steps=2, max_new_tokens=3)
    out = s.sample(model, SampleRequest([[1]], M, 0, config, gen(0)))
    assert not (out.generated(0) == M).any() and out.revised is not None


def test_sampler_options_reach_the_sampler(monkeypatch):
    """`noise_removal` and `tempering` (docs/strategies.md §11.5): the defaults, and the reference's behaviour."""
    seen = {}
    monkeypatch.setattr(
        "strategies.scdd.evaluation.scdd_ancestral_sample", lambda _d, _r, process: seen.update(vars(process))
    )
    model, config = _tiny_model(), SamplerConfig(steps=2, max_new_tokens=3)
    for options, want in (({}, ("posterior", "draws")), (dict(noise_removal="argmax", tempering="weights"), None)):
        s = _strategy(**options)
        s.sample(model, SampleRequest([[1]], M, 0, config))
        assert (seen["noise_removal"], seen["tempering"]) == (want or ("argmax", "weights"))
        assert seen["time_input"] is False and seen["eps"] == s.options.eps


def test_flat_weighting_trains_flat_and_evaluates_the_bound():
    """`loss_weighting: flat` reaches the training loss; `nelbo_rows` (eval/nelbo) scores the bound either way."""
    flat, elbo = _strategy(loss_weighting="flat"), _strategy()
    assert (flat.loss_fn.weighting, elbo.loss_fn.weighting) == ("flat", "elbo")
    assert flat.create_loss_fn({"vocab_size": V, "loss_weighting": "elbo"}).weighting == "elbo"
    model, ids = _tiny_model(), torch.randint(0, M, (3, 16), generator=gen(5))
    t = torch.tensor([0.05, 0.5, 0.95])
    rows = [s.nelbo_rows(model, ids, torch.ones(3, 16), M, t, gen(0)) for s in (flat, elbo)]
    assert torch.equal(rows[0], rows[1]) and (rows[0] > 0).all()
