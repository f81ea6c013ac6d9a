"""IDLMStrategy (docs/strategies.md §8.4, §14.5): config, setup errors, corruption, the [x_t ‖ x_0] forward,
training."""

import pytest
import torch

from strategies import IDLMLoss, IDLMStrategy, Microbatch, SetupContext, StepContext, get_dllm_strategy
from strategies.base_evaluation import SampleRequest
from strategies.losses import per_token_nll
from strategies.models import build_model, tiny_model_config

V, M = 48, 47


def _model(attn="sdpa"):
    return build_model(tiny_model_config("qwen3", V, 32, 32, 2, 4, 2, None, False, attn), 0)


def test_registered_and_config_threading():
    s = get_dllm_strategy("idlm")
    assert isinstance(s, IDLMStrategy) and s.normalization_mode == "supervised" and s.logit_shift == 1
    default = s.create_loss_fn({})
    assert isinstance(default, IDLMLoss) and default.clean_loss_weight == 0.2 and not default.auto_balance
    assert s.block_length == 1
    options = {"clean_loss_weight": 0.5, "auto_balance_clean_loss": True, "block_length": 3}
    tuned_s = get_dllm_strategy("idlm", options)
    tuned = tuned_s.create_loss_fn()
    assert tuned.clean_loss_weight == 0.5 and tuned.auto_balance and tuned_s.block_length == 3
    # create_loss_fn is pure: a loss from other options leaves the strategy's own as they were
    other = s.create_loss_fn(options)
    assert other.clean_loss_weight == 0.5 and other.auto_balance and s.block_length == 1
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        IDLMStrategy({"vocab_size": V})  # a key I-DLM does not declare


def test_setup_errors():
    s = IDLMStrategy()
    with pytest.raises(ValueError, match="requires dllm.mask_token_id to be set explicitly"):
        s.setup_extra(SetupContext(_model(), None, None))
    with pytest.raises(ValueError, match="outside the model vocab"):
        s.setup_extra(SetupContext(_model(), None, V))
    fa2 = _model()
    fa2.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="FlashAttention-2 ignores 4D masks"):
        s.setup_extra(SetupContext(fa2, None, M))
    assert s.setup_extra(SetupContext(_model(), None, M)) == M


def test_corruption_masks_every_supervised_token_only():
    ids = torch.randint(0, M, (2, 8))
    loss = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]] * 2, dtype=torch.float)
    noisy, noise, p = IDLMStrategy().apply_corruption(ids, loss, M, eps=1e-3, block_size=None, half_life_ratio=None)
    assert (noisy[:, 3:] == M).all() and torch.equal(noisy[:, :3], ids[:, :3]) and torch.equal(p, torch.ones(2, 8))


def _step(strategy, model, ids, loss, attn):
    loss_fn = strategy.create_loss_fn()
    ctx = StepContext(model=model, loss_fn=loss_fn, mask_token_id=M, step=0, base_seed=0)
    corrupted, _, n_sup = strategy.pre_step(ctx, [Microbatch(ids, loss, attn)])
    return strategy.forward_backward(
        ctx, corrupted[0], num_diffusion_tokens=n_sup, num_ar_tokens=n_sup, is_train=True
    ), corrupted[0]


def test_forward_backward_gives_one_finite_loss_and_grads():
    model = _model()
    ids = torch.randint(0, M, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = torch.zeros(2, 12)
    loss[:, 4:] = 1
    attn = torch.ones(2, 12)
    attn[1, 10:] = 0
    out, _ = _step(IDLMStrategy({"block_length": 2}), model, ids, loss, attn)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.isfinite(out.total_loss) and out.dllm_loss.numel() == 1
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_clean_half_is_exactly_the_causal_lm():
    """The [x_t ‖ x_0] forward's clean half equals a plain causal forward of x_0 (mask M_BC + repeated positions)."""
    model = _model().eval()
    s = IDLMStrategy({"block_length": 2})
    ids = torch.randint(0, M, (2, 10), generator=torch.Generator().manual_seed(1))
    noisy = torch.full_like(ids, M)
    with torch.no_grad():
        joint = s.joint_logits(model, noisy, ids, torch.ones(2, 10, dtype=torch.bool))
        causal = model(input_ids=ids).logits
    assert torch.allclose(joint[:, 10:], causal, atol=1e-5)
    sums, counts = s.ar_nll_rows(model, ids, torch.ones(2, 10), torch.ones(2, 10, dtype=torch.long))
    expected = per_token_nll(causal[:, :-1], ids[:, 1:]).sum(1)
    assert torch.allclose(sums, expected, atol=1e-4) and counts.tolist() == [9, 9]


def test_noisy_half_cannot_see_its_own_clean_block():
    """Leakage: perturbing clean tokens of block b leaves the noisy logits of block b unchanged."""
    model = _model().eval()
    s = IDLMStrategy({"block_length": 2})
    ids = torch.randint(0, M, (1, 8), generator=torch.Generator().manual_seed(2))
    noisy = torch.full_like(ids, M)
    changed = ids.clone()
    changed[0, 4:6] = (changed[0, 4:6] + 1) % M  # block 2 (positions 4, 5)
    valid = torch.ones(1, 8, dtype=torch.bool)
    with torch.no_grad():
        a = s.joint_logits(model, noisy, ids, valid)
        b = s.joint_logits(model, noisy, changed, valid)
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6)  # noisy blocks 0–2 see clean blocks < their own
    assert not torch.allclose(a[:, 6:8], b[:, 6:8])  # noisy block 3 sees clean block 2


def test_alpha_ia_is_the_expected_acceptance_of_decode_proposals_under_the_verify_half():
    """Σ_v min(p, q) per supervised token, from the two halves of one [x_t ‖ x_0] forward; 1 when they agree."""
    from strategies.idlm.strategy import IDLMStrategy

    torch.manual_seed(0)
    model = build_model(tiny_model_config("llama", 32, 16, 16, 1, 2, None, None, True), seed=0)
    strategy = IDLMStrategy({"mask_token_id": 31})
    ids = torch.randint(0, 31, (2, 8))
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0, 0]])
    attn = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    sums, counts = strategy.evaluator.introspective_acceptance_rows(model, ids, loss_mask, attn)
    assert counts.tolist() == [6, 4]  # supervised ∧ valid, position 0 excluded
    noisy = torch.where(loss_mask.bool(), torch.full_like(ids, 31), ids)
    logits = strategy.joint_logits(model, noisy, ids, attn.bool()).float()
    q, p = logits[:, :7].softmax(-1), logits[:, 8:15].softmax(-1)
    i, j = 0, 3  # row 0 scores token 4 from row 3 of each half
    assert sums[0] > 0 and (sums <= counts).all()
    per_token = torch.minimum(p[i, j], q[i, j]).sum()
    full = torch.minimum(p, q).sum(-1) * (loss_mask.bool() & attn.bool())[:, 1:]
    assert torch.allclose(full.sum(1), sums, atol=1e-6) and 0 < per_token <= 1
    metrics = strategy.eval_metrics(model, (ids, loss_mask, attn), batch_size=1)
    assert metrics["idlm/alpha_ia"] == pytest.approx(float(sums.sum() / counts.sum()), rel=1e-6)


def test_alpha_ia_hand_computed_on_stub_halves():
    """Decode half q = (½, ½, 0…), verify half p = one-hot on token 0 → Σ min = ½; identical halves → 1."""
    from strategies.idlm.strategy import IDLMStrategy

    big = 1e4

    class Stub(IDLMStrategy):
        same = False

        def joint_logits(self, model, noisy, clean, valid):
            b, length = clean.shape
            logits = torch.full((b, 2 * length, 4), -big)
            logits[:, :length, :2] = 0.0  # q: uniform over tokens 0 and 1
            logits[:, length:, 0] = 0.0  # p: all mass on token 0
            if self.same:
                logits[:, :length] = logits[:, length:]
            return logits

    ids, ones = torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)
    strategy = Stub({"mask_token_id": 3})
    assert strategy.eval_metrics(None, (ids, ones, ones), 1)["idlm/alpha_ia"] == pytest.approx(0.5)
    strategy.same = True
    assert strategy.eval_metrics(None, (ids, ones, ones), 1)["idlm/alpha_ia"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------- ISD


class _Halves(torch.nn.Module):
    """A stub I-DLM over 3 real tokens and [MASK] = 3, read with plain causal attention: a real token t's row is
    the causal half, `P[t]` (a bigram); a [MASK] row d places after the last real token t is the noisy half's
    guess of the token d + 1 ahead, `Q(d, t)`."""

    MASK = 3

    def __init__(self, P, Q):
        super().__init__()
        self.P, self.Q, self.calls = P, Q, 0

    def forward(self, input_ids, use_cache=False):
        from types import SimpleNamespace

        self.calls += 1
        rows, last, d = [], None, 0
        for t in input_ids[0].tolist():
            if t == self.MASK:
                d += 1
                rows.append(self.Q(d, last))
            else:
                last, d = t, 0
                rows.append(self.P[t])
        probs = torch.stack([torch.cat([r, torch.zeros(1)]) for r in rows])  # [MASK] never predicted
        return SimpleNamespace(logits=probs.log()[None])


def _chain(step, t, d):
    for _ in range(d):
        t = step[t]
    return t


def _peaked(t):
    return torch.full((3,), 0.05).index_fill(0, torch.tensor([t]), 0.9)


NEXT = [2, 0, 1]  # the deterministic chain of the greedy tests: 0 → 2 → 1 → 0 → …


def _greedy_causal(model, prompt, n, mask_id, eos=None):
    x = list(prompt)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([x]), use_cache=False).logits[0, -1].clone()
        logits[mask_id] = float("-inf")
        x.append(int(logits.argmax()))
        if x[-1] == eos:
            break
    return x[len(prompt) :]


def test_isd_is_listed_after_the_default_sampler_and_runs_through_sample():
    from strategies.registry import SAMPLERS
    from strategies.sampling import SamplerConfig

    assert IDLMStrategy.samplers[0] == "idlm" and "isd" in IDLMStrategy.samplers and "isd" in SAMPLERS
    agree = _Halves(torch.stack([_peaked(NEXT[t]) for t in range(3)]), lambda d, t: _peaked(_chain(NEXT, t, d + 1)))
    strategy = IDLMStrategy({"block_length": 2, "mask_token_id": 3})
    config = SamplerConfig(max_new_tokens=9, temperature=0.0, sampler="isd", cache="none")
    res = strategy.sample(agree, SampleRequest([[0], [1, 2]], 3, 0, config))
    assert res.generated(0).tolist() == _greedy_causal(agree, [0], 9, 3)
    assert res.generated(1).tolist() == _greedy_causal(agree, [1, 2], 9, 3)
    assert res.nfe == 4  # 1 + 3 + 3 + 2 tokens: the first forward commits one, every later one k + 1 = 3


def test_isd_at_temperature_zero_is_greedy_causal_decoding():
    """Halves that agree: every proposal stands (k + 1 tokens per forward after the first) and the text is the
    causal greedy one. A noisy half that guesses wrong changes only the number of forwards. A real tiny model,
    with and without the exact K/V cache, also decodes exactly its greedy causal text."""
    from strategies.idlm.sampling import ISDStats, isd_sample
    from strategies.sampling import SamplerConfig

    P = torch.stack([_peaked(NEXT[t]) for t in range(3)])
    agree = _Halves(P, lambda d, t: _peaked(_chain(NEXT, t, d + 1)))
    wrong = _Halves(P, lambda d, t: _peaked(_chain(NEXT, t, d)))  # one step behind: rejected every time
    for model, k in ((agree, 2), (agree, 3), (wrong, 2)):
        stats = ISDStats()
        cfg = SamplerConfig(max_new_tokens=13, temperature=0.0, cache="none")
        out = isd_sample(model, [[1]], mask_token_id=3, pad_token_id=0, config=cfg, proposals=k, stats=stats)
        assert out.generated(0).tolist() == _greedy_causal(model, [1], 13, 3)
        if model is agree:
            assert stats.per_forward[:-1] == [1] + [k + 1] * (len(stats.per_forward) - 2)
            assert stats.accepted == stats.proposed
        else:
            assert stats.accepted == 0 and max(stats.per_forward) == 1
    # EOS (token 0 here) ends the row; the rest of the canvas is EOS
    cfg = SamplerConfig(max_new_tokens=13, temperature=0.0, eos_token_id=0, cache="none")
    out = isd_sample(agree, [[1]], mask_token_id=3, pad_token_id=0, config=cfg, proposals=2)
    assert out.generated(0).tolist()[:2] == [0, 0] and _greedy_causal(agree, [1], 13, 3, eos=0) == [0]
    model = _model()
    prompt = [5, 9, 2, 30]
    for cache in ("none", "exact"):
        cfg = SamplerConfig(max_new_tokens=12, temperature=0.0, cache=cache)
        out = isd_sample(model, [prompt], mask_token_id=M, pad_token_id=0, config=cfg, proposals=2)
        assert out.generated(0).tolist() == _greedy_causal(model, prompt, 12, M)


def _joint_counts(model, n, generator, k=2, length=3, top_p=1.0):
    """Joint counts of the first `length` tokens over `n` ISD samples after the prompt [0] at T = 1."""
    from strategies.idlm.sampling import isd_sample
    from strategies.sampling import SamplerConfig

    cfg = SamplerConfig(max_new_tokens=length, temperature=1.0, top_p=top_p, cache="none")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny forwards: no thread pool to wake each time
    try:
        out = isd_sample(
            model, [[0]] * n, mask_token_id=3, pad_token_id=0, config=cfg, proposals=k, generator=generator
        )
    finally:
        torch.set_num_threads(threads)
    codes = (out.tokens[:, 1:] * torch.tensor([9, 3, 1])).sum(dim=1)
    return torch.bincount(codes, minlength=3**length).float()


@pytest.mark.parametrize("top_p", [1.0, 0.75])
def test_isd_at_temperature_one_samples_the_causal_half(monkeypatch, top_p):
    """Three generated tokens over a 3-token vocabulary, 4,000 runs at T = 1 with a noisy half far from the
    causal one: the 27 joint frequencies are the causal chain's exact probabilities (chi-square, significance
    1e-4); with a 0.75 nucleus, those of the truncated chain (and never a token outside it). The first token
    comes from a forward without proposals; the second and third are proposals that stand or are redrawn from
    max(0, p − q), or come after a rejection. Sensitivity: accepting every proposal (no rejection step) fails
    the same test."""
    from scipy.stats import chisquare

    import strategies.idlm.sampling as isd
    from strategies.sampling import truncate

    P = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.35, 0.45, 0.2]])
    Q = {1: torch.tensor([0.1, 0.2, 0.7]), 2: torch.tensor([0.6, 0.3, 0.1]), 3: torch.tensor([0.3, 0.3, 0.4])}
    model = _Halves(P, lambda d, t: Q[d])
    chain = torch.softmax(truncate(P.log(), 0, top_p), dim=-1)  # what the causal half samples at T = 1
    exact = torch.tensor(
        [float(chain[0, a] * chain[a, b] * chain[b, c]) for a in range(3) for b in range(3) for c in range(3)]
    )
    seen = exact > 0
    n = 4000
    counts = _joint_counts(model, n, torch.Generator().manual_seed(0), top_p=top_p)
    assert counts[~seen].sum() == 0
    assert chisquare(counts[seen].numpy(), (exact[seen] * n).numpy()).pvalue > 1e-4
    assert model.calls < 3 * n  # some proposals stood: fewer forwards than one per token
    monkeypatch.setattr(isd, "_uniform", lambda generator, device: 0.0)  # every proposal stands
    broken = _joint_counts(model, 2000, torch.Generator().manual_seed(1), top_p=top_p)
    outside = broken[~seen].sum() > 0
    assert outside or chisquare(broken[seen].numpy(), (exact[seen] * 2000).numpy()).pvalue < 1e-4
