"""HybridStrategy and HybridLM (docs/strategies.md §8.3, §14.5): config, corruption, inputs, two streams,
leakage, training."""

import pytest
import torch

from strategies import HybridDiffusionLLMLoss, HybridStrategy, Microbatch, SetupContext, StepContext, get_dllm_strategy
from strategies.hybrid.model import HYBRID, HybridLM
from strategies.losses import per_token_nll
from strategies.models import build_model, tiny_model_config, wrap_for_architecture

V, M = 48, 47


def _lm():
    return build_model(tiny_model_config("llama", V, 32, 32, 2, 4, None, None, True), 0)


def _model():
    model = HybridLM(_lm(), M)
    assert HybridStrategy().setup_extra(SetupContext(model, None, M)) == M
    return model


def test_registered_with_noise_normalization_and_alpha_from_config():
    s = get_dllm_strategy("hybrid")
    assert isinstance(s, HybridStrategy) and s.normalization_mode == "noise"
    assert isinstance(s.create_loss_fn({}), HybridDiffusionLLMLoss) and s.create_loss_fn({}).alpha == 1.0
    assert s.create_loss_fn({"ar_loss_alpha": 0.3}).alpha == 0.3
    # denominators: diffusion ← global noise count, AR ← global supervised count
    assert s.loss_denominators([], 5, 9) == (5, 9)


def test_uniform_kernel_without_block_size_and_blockwise_with_it():
    s = HybridStrategy()
    ids = torch.randint(0, M, (3, 16))
    loss = torch.ones(3, 16)
    kw = dict(eps=1e-3, half_life_ratio=None)
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    noisy, noise, p = s.apply_corruption(ids, loss, M, block_size=None, generator=g(), **kw)
    assert (p == p[:, :1]).all()  # one level per row: the uniform kernel
    noisy_b, noise_b, p_b = s.apply_corruption(ids, loss, M, block_size=4, generator=g(), **kw)
    assert noisy_b.shape == noise_b.shape == p_b.shape == (3, 16)
    assert torch.equal(noisy_b[noise_b], torch.full_like(noisy_b[noise_b], M))
    assert torch.equal(noisy_b[~noise_b], ids[~noise_b])
    per_block = p_b.view(3, 4, 4)
    assert (per_block == per_block[..., :1]).all() and not (p_b == p_b[:, :1]).all()  # a level per block


def test_prepare_batch_feeds_clean_ids_and_masked_positions():
    s = HybridStrategy()
    clean, noisy = torch.arange(6)[None], torch.full((1, 6), M)
    noise = torch.tensor([[0, 1, 0, 1, 1, 0]], dtype=torch.bool)
    out = s.prepare_batch(
        {"attention_mask": torch.ones(1, 6), "use_cache": True, "input_lengths": torch.tensor([6])}, noisy, noise, clean
    )
    assert torch.equal(out["input_ids"], clean) and torch.equal(out["masked_indices"], noise)
    assert torch.equal(out["labels"], clean) and out["skip_loss"] is True
    assert "attention_mask" not in out and "use_cache" not in out and "input_lengths" in out


def test_model_masks_internally_and_streams_hide_what_they_must():
    model = _model().eval()
    ids = torch.randint(0, M, (2, 10))
    masked = torch.zeros(2, 10, dtype=torch.bool)
    masked[:, [2, 5]] = True
    with torch.no_grad():
        out = model(input_ids=ids, masked_indices=masked)
        # the diffusion stream equals the backbone run bidirectionally on the [MASK]-substituted ids
        noisy = ids.masked_fill(masked, M)
        assert torch.allclose(out.logits, model(input_ids=noisy).logits, atol=1e-6)
        assert out.causal_logits.shape == out.logits.shape == (2, 10, V)
        # leakage: the clean token under a mask is invisible to the diffusion stream
        other = ids.clone()
        other[:, 5] = (other[:, 5] + 1) % M
        out2 = model(input_ids=other, masked_indices=masked)
        assert torch.equal(out.logits, out2.logits)
        # the causal stream is causal: positions < 5 unchanged, position 5 onward changed
        assert torch.allclose(out.causal_logits[:, :5], out2.causal_logits[:, :5], atol=1e-6)
        assert not torch.allclose(out.causal_logits[:, 5:], out2.causal_logits[:, 5:])
        # ... and the diffusion stream is bidirectional: an unmasked late token changes early logits
        late = ids.clone()
        late[:, 9] = (late[:, 9] + 1) % M
        assert not torch.allclose(model(input_ids=late, masked_indices=masked).logits[:, 0], out.logits[:, 0])


def test_mask_id_missing_is_a_clear_error():
    model = HybridLM(_lm())
    with pytest.raises(ValueError, match="HybridLM needs a mask token id"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), masked_indices=torch.ones(1, 4, dtype=torch.bool))
    # setup_extra validates only: it installs nothing into a model built without a mask id
    assert HybridStrategy().setup_extra(SetupContext(model, None, M)) == M
    assert getattr(model.config, "dllm_mask_token_id", None) is None


def test_building_with_the_mask_id_installs_it_and_setup_refuses_a_mismatch():
    model = wrap_for_architecture(_lm(), HYBRID, mask_token_id=M)
    assert isinstance(model, HybridLM) and model.config.dllm_mask_token_id == M and model.mask_token_id == M
    assert model.config.dllm_architecture == HYBRID
    s = HybridStrategy()
    assert s.setup_extra(SetupContext(model, None, M)) == M
    assert s.setup_extra(SetupContext(model, None, None)) is None  # unresolved: the trainer's error
    with pytest.raises(ValueError, match="masks with token id 47 but dllm.mask_token_id resolves to 3"):
        s.setup_extra(SetupContext(model, None, 3))


def test_forward_backward_equals_hand_loss_and_gives_grads():
    torch.manual_seed(0)
    model = _model()
    s = HybridStrategy()
    loss_fn = s.create_loss_fn({"ar_loss_alpha": 0.5})
    ids = torch.randint(0, M, (2, 12))
    loss = torch.ones(2, 12)
    loss[0, :3] = 0
    ctx = StepContext(model=model, loss_fn=loss_fn, mask_token_id=M, step=3, base_seed=0)
    corrupted, n_noise, n_sup = s.pre_step(ctx, [Microbatch(ids, loss, torch.ones(2, 12))])
    n_diff, n_ar = s.loss_denominators(corrupted, n_noise, n_sup)
    c = corrupted[0]
    out = s.forward_backward(ctx, c, num_diffusion_tokens=n_diff, num_ar_tokens=n_ar, is_train=True)
    with torch.no_grad():
        both = model(input_ids=ids, masked_indices=c.noise_mask)
        sel = c.noise_mask & loss.bool()
        diff = (per_token_nll(both.logits, ids)[sel] / c.p_mask[sel]).sum() / n_noise
        ar_sel = loss.bool()[:, 1:]
        ar = per_token_nll(both.causal_logits[:, :-1], ids[:, 1:])[ar_sel].sum() / n_sup
    assert torch.allclose(out.total_loss, 0.5 * diff + ar, rtol=1e-5)
    assert torch.allclose(out.dllm_loss, 0.5 * diff, rtol=1e-5)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
