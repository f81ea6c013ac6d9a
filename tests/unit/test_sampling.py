"""The samplers of strategies/sampling.py (docs/strategies.md §11): the plain absorbing one (no masks left,
prompts untouched,
windows respected, confident denoiser exact), infilling, I-DLM shift, hybrid AR-seeded blocks, SCDD ancestral
(self-correction), and determinism for a fixed seed."""

import pytest
import torch

from strategies.absorbing import absorbing_sample, infill_sample, num_transfer_tokens
from strategies.base_evaluation import SampleRequest
from strategies.hybrid.sampling import hybrid_sample
from strategies.sampling import SamplerConfig
from strategies.scdd.sampling import SCDDProcess, scdd_ancestral_sample
from strategies.scdd.schedule import scdd_schedule

MASK, PAD, V = 15, 0, 16


def confident(target_fn, vocab=V):
    """A perfectly confident denoiser: position p always predicts target_fn(p)."""

    def denoise(x, attn=None):
        logits = torch.full((*x.shape, vocab), -20.0)
        for p in range(x.shape[1]):
            logits[:, p, target_fn(p)] = 20.0
        return logits

    return denoise


def schedule(ratio=0.1):
    return lambda t: scdd_schedule(t, max_ratio=ratio, gamma_shape=1.0, t_peak=0.5)


# ------------------------------------------------------------------ absorbing sampler


def test_transfer_schedule_spreads_remainder_first():
    sched = num_transfer_tokens(torch.tensor([10, 3]), 4)
    assert sched.tolist() == [[3, 3, 2, 2], [1, 1, 1, 0]]
    assert sched.sum(1).tolist() == [10, 3]


def test_confident_denoiser_is_reproduced_and_prompt_kept():
    prompts = [[1, 2, 3], [4, 5]]
    cfg = SamplerConfig(steps=8, max_new_tokens=8, block_size=4)
    res = absorbing_sample(confident(lambda p: 1 + p % 13), prompts, mask_token_id=MASK, pad_token_id=PAD, config=cfg)
    assert not (res.tokens == MASK).any()
    for i, p in enumerate(prompts):
        assert res.tokens[i, : len(p)].tolist() == p
        assert res.generated(i).tolist() == [1 + (len(p) + k) % 13 for k in range(8)]


def test_blocks_are_filled_left_to_right():
    """With one step per token, block b is complete before any token of block b+1 appears."""
    seen = []

    def denoise(x, attn):
        seen.append(x.clone())
        g = torch.Generator().manual_seed(len(seen))
        return torch.randn(*x.shape, V, generator=g)

    absorbing_sample(
        denoise,
        [[1, 2]],
        mask_token_id=MASK,
        pad_token_id=PAD,
        config=SamplerConfig(steps=8, max_new_tokens=8, block_size=4),
    )
    for x in seen:
        gen = x[0, 2:]
        first_block_done = not (gen[:4] == MASK).any()
        assert first_block_done or (gen[4:] == MASK).all()


def test_threshold_mode_and_random_remasking_leave_no_masks():
    for cfg in (
        SamplerConfig(steps=4, max_new_tokens=8, block_size=8, threshold=0.9),
        SamplerConfig(steps=8, max_new_tokens=8, block_size=4, remasking="random", temperature=1.0),
    ):
        res = absorbing_sample(
            confident(lambda p: 3),
            [[1]],
            mask_token_id=MASK,
            pad_token_id=PAD,
            config=cfg,
            generator=torch.Generator().manual_seed(0),
        )
        assert not (res.tokens == MASK).any() and res.tokens[0, 0] == 1


def test_threshold_mode_reveals_all_confident_tokens_in_one_forward():
    res = absorbing_sample(
        confident(lambda p: 3),
        [[1]],
        mask_token_id=MASK,
        pad_token_id=PAD,
        config=SamplerConfig(steps=8, max_new_tokens=8, block_size=8, threshold=0.9),
    )
    assert res.nfe == 1


def test_eos_stops_and_fills_tail():
    eos = 14
    res = absorbing_sample(
        confident(lambda p: eos if p >= 4 else 2),
        [[1, 1]],
        mask_token_id=MASK,
        pad_token_id=PAD,
        config=SamplerConfig(steps=16, max_new_tokens=16, block_size=4, eos_token_id=eos),
    )
    assert not (res.tokens == MASK).any() and res.nfe < 16


# ------------------------------------------------------------------ the other samplers


def test_idlm_shift_with_a_position_only_stub():
    """Row i predicts i mod (V−1): shifted decoding yields (p−1) mod (V−1), unshifted p mod (V−1)."""
    stub = confident(lambda p: p % (V - 1))
    prompts = [[3, 4, 5]]
    for shift, expect in ((1, lambda p: (p - 1) % (V - 1)), (0, lambda p: p % (V - 1))):
        cfg = SamplerConfig(steps=8, max_new_tokens=8, block_size=4, logit_shift=shift)
        res = absorbing_sample(stub, prompts, mask_token_id=MASK, pad_token_id=PAD, config=cfg)
        assert res.tokens[0, :3].tolist() == [3, 4, 5]
        assert res.generated(0).tolist() == [expect(3 + k) for k in range(8)]
        assert not (res.tokens == MASK).any()


def test_infill_fills_every_mask_in_block_windows_and_keeps_the_rest():
    seq = [1, MASK, MASK, 2, MASK, 3, MASK, MASK, MASK, 4]
    seen = []

    def denoise(x, attn):
        seen.append(x.clone())
        return confident(lambda p: 5 + p % 7)(x)

    res = infill_sample(
        denoise, [seq], mask_token_id=MASK, pad_token_id=PAD, config=SamplerConfig(steps=6, block_size=4)
    )
    out = res.tokens[0].tolist()
    assert MASK not in out
    assert [out[i] for i in (0, 3, 5, 9)] == [1, 2, 3, 4]
    assert [out[i] for i, t in enumerate(seq) if t == MASK] == [5 + i % 7 for i, t in enumerate(seq) if t == MASK]
    for x in seen:  # a later window only starts once the earlier ones are full
        row = x[0].tolist()
        first_open = next((i // 4 for i, t in enumerate(row) if t == MASK), None)
        if first_open is not None:
            assert all(t == MASK for t, s in zip(row[(first_open + 1) * 4 :], seq[(first_open + 1) * 4 :]) if s == MASK)


class StubHybrid(torch.nn.Module):
    """Causal branch always predicts `seed_token`; diffusion branch predicts target(p) at every position."""

    def __init__(self, seed_token, target_fn):
        super().__init__()
        self.seed_token, self.target_fn, self.calls = seed_token, target_fn, []

    def causal_logits(self, ids, attention_mask=None):
        self.calls.append(("causal", ids.shape[1]))
        logits = torch.full((*ids.shape, V), -20.0)
        logits[..., self.seed_token] = 20.0
        return logits

    def forward(self, input_ids, **_):
        self.calls.append(("diffusion", input_ids.clone()))
        return type("Out", (), {"logits": confident(self.target_fn)(input_ids)})()


def test_hybrid_blocks_are_seeded_by_the_causal_branch_then_diffused():
    model = StubHybrid(seed_token=9, target_fn=lambda p: 2)
    prompts = [[1, 1, 1], [1]]
    res = hybrid_sample(
        model,
        prompts,
        mask_token_id=MASK,
        pad_token_id=PAD,
        config=SamplerConfig(steps=6, max_new_tokens=6, block_size=3),
    )
    for i, p in enumerate(prompts):
        assert res.tokens[i, : len(p)].tolist() == p
        assert res.generated(i).tolist() == [9, 2, 2, 9, 2, 2]  # block starts from the causal seed
    assert not (res.tokens == MASK).any()
    # the diffusion branch never sees masks of a later block (no future canvas) and the causal one sees the context
    diffusion_inputs = [c[1] for c in model.calls if c[0] == "diffusion"]
    assert all(int((x == MASK).sum()) <= 2 for x in diffusion_inputs)
    assert [c[1] for c in model.calls if c[0] == "causal"] == [3, 6, 1, 4]
    assert res.nfe == len(model.calls) / len(prompts)  # forwards per sequence


def test_scdd_ancestral_with_a_confident_denoiser_reaches_the_target():
    prompts = [[1, 2], [3]]
    for ratio in (0.1, 0.0):  # uniform_ratio 0 still terminates with no masks
        res = scdd_ancestral_sample(
            confident(lambda p: 4 + p % 9),
            SampleRequest(
                prompts,
                MASK,
                PAD,
                SamplerConfig(steps=16, max_new_tokens=6, temperature=1.0),
                torch.Generator().manual_seed(0),
            ),
            SCDDProcess(V, schedule(ratio)),
        )
        assert not (res.tokens == MASK).any() and res.nfe == 17
        for i, p in enumerate(prompts):
            assert res.tokens[i, : len(p)].tolist() == p
            assert res.generated(i).tolist() == [4 + (len(p) + k) % 9 for k in range(6)]


def test_scdd_self_correction_revises_every_position():
    """A denoiser that switches its preferred token mid-decode: tokens revealed under the old preference
    are all revised to the new one by the end (visible tokens stay revisable)."""
    calls, snapshots = [0], []

    def fickle(x, attn):
        calls[0] += 1
        snapshots.append(x.clone())
        return confident(lambda p: 5 if calls[0] <= 10 else 7)(x)

    res = scdd_ancestral_sample(
        fickle,
        SampleRequest(
            [[1]],
            MASK,
            PAD,
            SamplerConfig(steps=20, max_new_tokens=8, temperature=1.0),
            torch.Generator().manual_seed(3),
        ),
        SCDDProcess(V, schedule()),
    )
    mid = snapshots[10][0, 1:]
    assert (mid == 5).sum() >= 4  # plenty of positions were visible with the old token half-way
    before_final = snapshots[-1][0, 1:]  # what the ancestral steps alone produced
    assert ((mid == 5) & (before_final == 7)).any()  # a visible token was revised by an ancestral step
    assert res.generated(0).tolist() == [7] * 8 and res.tokens[0, 0] == 1


def test_scdd_temperature_zero_never_proposes_mask():
    def mask_loving(x, attn):
        logits = torch.zeros(*x.shape, V)
        logits[..., MASK] = 50.0
        logits[..., 3] = 1.0
        return logits

    res = scdd_ancestral_sample(
        mask_loving,
        SampleRequest(
            [[1]],
            MASK,
            PAD,
            SamplerConfig(steps=4, max_new_tokens=5, temperature=0.0),
            torch.Generator().manual_seed(0),
        ),
        SCDDProcess(V, schedule()),
    )
    assert res.generated(0).tolist() == [3] * 5


def _scdd(denoise, prompts, steps=16, n=6, temperature=1.0, ratio=0.1, seed=0, top_p=1.0, remasking="random", **kw):
    """The SCDD sampler; `remasking` "random" (the exact ancestral step) unless a test asks otherwise."""
    config = SamplerConfig(steps=steps, max_new_tokens=n, temperature=temperature, top_p=top_p, remasking=remasking)
    return scdd_ancestral_sample(
        denoise,
        SampleRequest(prompts, MASK, PAD, config, torch.Generator().manual_seed(seed)),
        SCDDProcess(V, schedule(ratio), **kw),
    )


def context_guesser(target_fn, guess=3, own=0.35, wrong=1e-6):
    """What a trained SCDD denoiser outputs: at a [MASK] its confident prediction; at a visible token a guess
    from the other positions alone (docs/strategies.md §11.5), here `guess` with probability 0.6, the visible
    token itself `own` where it is the right one and `wrong` where it is not, the rest spread evenly."""

    def denoise(x, attn=None):
        logits = torch.full((*x.shape, V), -20.0)
        for p in range(x.shape[1]):
            logits[:, p, target_fn(p)] = 20.0
        right = torch.tensor([target_fn(p) for p in range(x.shape[1])]) == x
        mass = torch.where(right, own, wrong)[..., None]
        visible = ((1 - 0.6 - mass) / (V - 3)).expand(*x.shape, V).clone()
        visible.scatter_(-1, x[..., None], mass)
        visible[..., guess] = 0.6
        return torch.where((x == MASK)[..., None], logits, visible.log())

    return denoise


def test_scdd_keeps_a_confident_diverse_canvas():
    """Tokens placed from confident predictions survive: the final pass weighs each visible token's own
    evidence (clean_t + uniform_t/K against uniform_t/K) instead of overwriting it with the context guess,
    and at temperature 0 the revision probability comes from the model's p, not from a one-hot of it.
    The reference's final argmax and its one-hot tempering collapse the canvas onto the guess."""
    target = lambda p: 4 + p % 9  # noqa: E731
    want = [4 + (1 + k) % 9 for k in range(8)]
    for temperature, ratio in ((0.0, 0.1), (1.0, 0.0)):
        res = _scdd(context_guesser(target), [[1]], steps=24, n=8, temperature=temperature, ratio=ratio)
        assert res.generated(0).tolist() == want and res.revised == 0
    # at temperature 1 (exact posterior) the uniform channel also places random tokens: the model rules them out
    # and they are revised; a nucleus leaves them out, only predictions are ever placed
    for top_p, random_placed in ((1.0, True), (0.5, False)):
        canvases = []
        spy = lambda x, attn, seen=canvases: seen.append(x[0, 1:].tolist()) or context_guesser(target)(x)  # noqa: E731
        res = _scdd(spy, [[1]], steps=24, n=8, seed=2, top_p=top_p)
        assert all(tok in (w, 3) for tok, w in zip(res.generated(0).tolist(), want))
        seen = {(i, tok) for canvas in canvases for i, tok in enumerate(canvas)}
        assert any(tok not in (want[i], 3, MASK) for i, tok in seen) == random_placed
    assert _scdd(context_guesser(target), [[1]], steps=24, n=8, noise_removal="argmax").generated(0).tolist() == [3] * 8
    greedy = _scdd(context_guesser(target), [[1]], steps=24, n=8, temperature=0.0, tempering="weights")
    assert (greedy.generated(0) == 3).sum() >= 6 and greedy.revised >= 6


def test_scdd_revised_counts_the_positions_changed_after_placement():
    """Hand-built: the denoiser is sure of 5 during the ancestral steps and of 7 in the final pass; with
    uniform_ratio 0 nothing moves but [MASK]s until the reference's final argmax rewrites every placed 5.
    So each row's revised count is the number of its positions that held a token before the final pass."""
    steps, seen = 6, []

    def switching(x, attn):
        seen.append(x.clone())
        return confident(lambda p: 5 if len(seen) <= steps else 7)(x)

    # eps 0.4: the ancestral steps stop with about 40 % still masked
    res = _scdd(switching, [[1, 2], [3]], steps=steps, n=5, ratio=0.0, seed=1, noise_removal="argmax", eps=0.4)
    before_final = seen[-1]
    placed = [int((before_final[i, len(p) : len(p) + 5] != MASK).sum()) for i, p in enumerate([[1, 2], [3]])]
    assert res.revised == sum(placed) / 2 and 0 < sum(placed) < 10  # some still masked: filled, not revised
    assert [res.generated(i).tolist() for i in range(2)] == [[7] * 5] * 2
    seen.clear()
    kept = _scdd(switching, [[1]], steps=steps, n=5, ratio=0.0, eps=0.4)  # the posterior pass keeps the 5s
    assert kept.revised == 0 and 5 in kept.generated(0).tolist()


def test_scdd_draws_at_temperature_one_are_the_exact_posterior():
    """The two-part draw (move or not from the posterior, then where to) has the exact posterior of
    `_ancestral_weights` as its distribution, at a [MASK], at a visible token and at a visible token the
    model all but confirms (p(c) ≈ 0.9: a destination renormalized without c would weigh the clean channel
    against the uniform one 10× wrong there)."""
    from strategies.absorbing import Denoising
    from strategies.scdd.sampling import _ancestral_weights, _AncestralStep, _tempered_draw

    n = 160_000
    step = _AncestralStep.between(schedule(0.3)(torch.tensor([0.6])), schedule(0.3)(torch.tensor([0.45])))
    logits = torch.randn(1, 3, V, generator=torch.Generator().manual_seed(0)).repeat(n, 1, 1)
    logits[..., MASK] = -float("inf")
    logits[:, 2, 9] = 6.0
    x = torch.tensor([[MASK, 6, 9]]).repeat(n, 1)
    job = Denoising(None, MASK, SamplerConfig(temperature=1.0, remasking="random"), torch.Generator().manual_seed(1))
    drawn = _tempered_draw(logits, x, step, V - 1, job)
    exact = _ancestral_weights(torch.softmax(logits[:1].double(), -1), x[:1], step, V - 1, MASK)[0]
    exact = exact / exact.sum(-1, keepdim=True)
    for pos in range(3):
        freq = torch.bincount(drawn[:, pos], minlength=V).double() / n
        assert (freq - exact[pos]).abs().max() < 0.012, (pos, freq, exact[pos])
        moved = exact[pos].clone()
        moved[x[0, pos]] = 0
        if pos == 2:  # where a revised token goes, given that it moves (≈ 1,300 moves)
            others = torch.bincount(drawn[:, pos][drawn[:, pos] != 9], minlength=V).double()
            p = torch.softmax(logits[0, 2].double(), -1)
            renormalized = step.clean_s * p / (1 - p[9]) + step.unif_s / (V - 1)
            renormalized[[9, MASK]] = 0
            tv = lambda a, b: 0.5 * (a / a.sum() - b / b.sum()).abs().sum().item()  # noqa: E731
            assert others.sum() > 1000 and tv(others, moved) < 0.07 and tv(renormalized, moved) > 0.15
    assert exact[1, 6] < 0.999 and exact[0, MASK] > 0.5  # both rules actually move something


def test_scdd_time_input_reads_each_step_time():
    times = []

    def timed(x, attn, t):
        times.append(float(t[0]))
        assert t.shape == (x.shape[0],)
        return confident(lambda p: 4)(x)

    res = _scdd(timed, [[1], [2, 3]], steps=4, time_input=True)
    # step i reads its t_i; the final pass reads the last time, eps
    assert torch.allclose(torch.tensor(times), torch.linspace(1.0, 1e-3, 5)) and res.nfe == 5


def test_samplers_are_deterministic_for_a_seed():
    def noisy(x, attn):
        g = torch.Generator().manual_seed(int(x.sum()))
        return torch.randn(*x.shape, V, generator=g)

    def run(sampler, seed):
        gen = torch.Generator().manual_seed(seed)
        if sampler == "scdd":
            return scdd_ancestral_sample(
                noisy,
                SampleRequest([[1, 2]], MASK, PAD, SamplerConfig(steps=6, max_new_tokens=6, temperature=1.0), gen),
                SCDDProcess(V, schedule()),
            ).tokens
        return absorbing_sample(
            noisy,
            [[1, 2]],
            mask_token_id=MASK,
            pad_token_id=PAD,
            generator=gen,
            config=SamplerConfig(steps=6, max_new_tokens=6, block_size=3, temperature=1.0, remasking="random"),
        ).tokens

    for sampler in ("scdd", "absorbing"):
        assert torch.equal(run(sampler, 5), run(sampler, 5))
        assert any(not torch.equal(run(sampler, 5), run(sampler, s)) for s in range(6, 12))


def test_threshold_mode_is_adaptive_and_never_leaves_masks():
    """Threshold mode: forwards = what the window needs (≤ its size), not the step budget."""

    def unsure(x, attn):
        logits = torch.zeros(*x.shape, V)
        logits[..., 3] = 0.5  # max prob ≈ 0.1: only the forced top-1 passes each forward
        return logits

    res = absorbing_sample(
        unsure,
        [[1]],
        mask_token_id=MASK,
        pad_token_id=PAD,
        config=SamplerConfig(steps=2, max_new_tokens=8, block_size=4, threshold=0.9),
    )
    assert not (res.tokens == MASK).any() and res.nfe == 8


def test_scdd_low_confidence_reveals_the_most_confident_masks_first():
    """`remasking="low_confidence"` (the default; docs/strategies.md §11.5): each step reveals the [MASK]s whose
    proposal the model is surest of, as many as the posterior reveals in expectation (all of them by the
    end); "random" is the exact ancestral step, whose reveal order ignores confidence."""
    n, steps = 8, 8

    def rising(seen):
        def denoise(x, attn=None):
            seen.append(x[0, 1:].clone())
            logits = torch.zeros(*x.shape, V)
            for p in range(1, x.shape[1]):  # position p proposes token 1 + p % 10, surer the further right
                logits[:, p, 1 + p % 10] = 1.0 + p
            return logits

        return denoise

    def reveal_order(remasking, seed):
        seen = []
        res = _scdd(rising(seen), [[1]], steps=steps, n=n, ratio=0.0, seed=seed, remasking=remasking, temperature=0)
        first = [min((i for i, c in enumerate(seen) if c[j] != MASK), default=len(seen)) for j in range(n)]
        return first, res

    for seed in range(3):
        first, res = reveal_order("low_confidence", seed)
        assert first == sorted(first, reverse=True) and first[0] > first[-1]  # the surest (rightmost) first
        assert first[0] < steps + 1 and res.generated(0).tolist() == [1 + p % 10 for p in range(1, n + 1)]
    orders = [reveal_order("random", seed)[0] for seed in range(3)]
    assert any(o != sorted(o, reverse=True) for o in orders)
    with pytest.raises(NotImplementedError, match="remasking"):
        _scdd(rising([]), [[1]], steps=2, n=2, remasking="leftmost")
