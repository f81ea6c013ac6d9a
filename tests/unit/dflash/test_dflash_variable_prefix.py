"""DFlash's variable-prefix objective (`dflash.loss_type: variable_prefix`, docs/strategies.md §5.7, §10.3): the
weights by hand, the prefix prior and its seeding, what the draft sees and what is supervised, p = 0 as the plain
decay loss, a tiny draft that learns under it, and the options it refuses."""

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml
from stagekit import tiny_dflash_target, tiny_draft_config

import strategies.dflash.strategy as dflash_strategy
from dllm_common.config import ConfigError
from strategies import Microbatch, StepContext, assemble_strategy
from strategies.dflash.draft import DFlashDraftModel
from strategies.dflash.features import OnlineFeatures
from strategies.dflash.loss import DFlashDecayLoss, DFlashDPACELoss
from strategies.dflash.prefix import draw_prefix_lengths, prefix_decay_weights, prefix_generator
from strategies.options import DFlashOptions, _validated, printed_options, validate_config
from strategies.registry import REGISTRY

MASK = 63
E = math.exp


# ---------------------------------------------------------------------------------------- weights and loss


def test_weights_by_hand_restart_at_the_prefix_boundary():
    """bs = 4: predictions k = 1, 2, 3; w_k = exp(−(k − 1 − p)/γ) for k > p, 0 for k ≤ p (γ = 2)."""
    prefix = torch.tensor([[0, 1, 2]])  # three blocks of one row
    got = prefix_decay_weights(prefix, 4, 2.0).view(3, 3)
    expected = torch.tensor(
        [
            [1.0, E(-1 / 2), E(-1)],  # p = 0: the plain decay
            [0.0, 1.0, E(-1 / 2)],  # p = 1: offset 1 shown, the decay restarts at offset 2
            [0.0, 0.0, 1.0],  # p = 2: only offset 3 is predicted, with weight 1
        ]
    )
    assert torch.allclose(got, expected, atol=1e-7)
    flat = prefix_decay_weights(prefix, 4, None).view(3, 3)  # γ None: 1 wherever predicted
    assert flat.tolist() == [[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    # bs = 6, p = 3: k = 1..5 → [0, 0, 0, 1, e^(−1/γ)] with γ = 3
    six = prefix_decay_weights(torch.tensor([[3]]), 6, 3.0)[0]
    assert torch.allclose(six, torch.tensor([0.0, 0.0, 0.0, 1.0, E(-1 / 3)]), atol=1e-7)


def test_loss_by_hand_supervises_only_the_suffix():
    """B = 1, two blocks of bs = 3 (T = 4), V = 2, prefixes (1, 0): block 0 predicts only offset 2 (weight 1),
    block 1 both offsets (1, e^(−1/2)); ÷ num_tokens as training does (G4)."""
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    targets = torch.tensor([[0, 0, 0, 1]])
    mask = torch.ones(1, 4)
    nll = [math.log(2), math.log(1 + E(-2)), math.log(1 + math.e), math.log(2)]
    expected = (nll[1] * 1 + nll[2] * 1 + nll[3] * E(-1 / 2)) / 3
    loss = DFlashDecayLoss(loss_gamma=2.0)
    out = loss(logits, targets, mask, num_tokens=3, block_size=3, prefix=torch.tensor([[1, 0]]))
    assert math.isclose(out.total_loss.item(), expected, rel_tol=1e-6)
    # a shown position's logits do not matter: any value there gives the same loss and no gradient
    moved = logits.clone().requires_grad_(True)
    again = loss(moved, targets, mask, num_tokens=3, block_size=3, prefix=torch.tensor([[1, 0]]))
    again.total_loss.backward()
    assert moved.grad[0, 0].abs().sum() == 0 and moved.grad[0, 1].abs().sum() > 0
    with pytest.raises(ValueError, match="prefix lengths need the block layout"):
        loss(logits, targets, mask, num_tokens=3, block_size=4, prefix=torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="the D-PACE loss has no shown prefix"):
        DFlashDPACELoss()(logits, targets, mask, num_tokens=2, block_size=3, prefix=torch.tensor([[1, 0]]))


@pytest.mark.parametrize("fused", [False, True])
def test_prefix_zero_everywhere_is_the_decay_loss_exactly(fused):
    torch.manual_seed(0)
    b, n, bs, h, v = 2, 3, 5, 8, 11
    hidden, weight = torch.randn(b, n * (bs - 1), h), torch.randn(v, h)
    targets = torch.randint(0, v, (b, n * (bs - 1)))
    mask = (torch.rand(b, n * (bs - 1)) > 0.3).float()
    loss = DFlashDecayLoss(loss_gamma=2.5, chunk_size=7)
    zeros = torch.zeros(b, n, dtype=torch.long)
    if fused:
        plain = loss.forward_fused(hidden, weight, targets, mask, num_tokens=9, block_size=bs)
        zero = loss.forward_fused(hidden, weight, targets, mask, num_tokens=9, block_size=bs, prefix=zeros)
    else:
        logits = hidden @ weight.T
        plain = loss(logits, targets, mask, num_tokens=9, block_size=bs)
        zero = loss(logits, targets, mask, num_tokens=9, block_size=bs, prefix=zeros)
    assert torch.equal(plain.total_loss, zero.total_loss)
    assert torch.equal(plain.draft_correct_per_pos, zero.draft_correct_per_pos)


# ---------------------------------------------------------------------------------------- the prior


def test_drawn_prefix_lengths_follow_the_truncated_geometric_prior():
    """bs = 6, base 0.9: p ∈ {1, 2, 3, 4} with Pr(p) = 0.9^p / (0.9 + 0.81 + 0.729 + 0.6561); 12,000 draws, χ²
    with 3 degrees of freedom below 16.27 (its 0.1 % quantile; the seeds are fixed, so this is deterministic)."""
    weights = [0.9, 0.81, 0.729, 0.6561]
    pmf = [w / sum(weights) for w in weights]
    gens = [prefix_generator(1000 + r) for r in range(200)]
    draws = draw_prefix_lengths(gens, 60, 6, 0.9)
    assert draws.shape == (200, 60) and draws.dtype == torch.long
    counts = torch.bincount(draws.flatten(), minlength=6).tolist()
    assert counts[0] == 0 and counts[5] == 0  # never the anchor-only block, never a block with nothing to predict
    total = draws.numel()
    chi2 = sum((counts[p] - total * q) ** 2 / (total * q) for p, q in zip(range(1, 5), pmf))
    assert chi2 < 16.27, (counts, chi2)
    # a base below 1 favours short prefixes, one above 1 long ones; 1 is uniform
    short = draw_prefix_lengths(gens[:50], 60, 6, 0.3).float().mean()
    long = draw_prefix_lengths(gens[:50], 60, 6, 3.0).float().mean()
    assert short < 1.6 and long > 3.4
    # bs = 3 leaves one prefix length (1), as the reference's l ∈ [min(2, bs − 1), bs − 1] does
    assert (draw_prefix_lengths(gens[:4], 8, 3, 0.9) == 1).all()


# ---------------------------------------------------------------------------------------- the strategy


@pytest.fixture(scope="module")
def pair():
    """A frozen 5-layer target and a 2-layer draft of block 4 (tests/stagekit.py), as test_dflash_decoding.py builds."""
    torch.manual_seed(1)
    return tiny_dflash_target(), DFlashDraftModel(tiny_draft_config()).eval()


def _strategy(pair, draft=None, **cfg):
    target, d = pair
    draft = d if draft is None else draft
    return assemble_strategy(
        "dflash",
        {"block_size": 4, "num_blocks_per_sample": 3, **cfg},
        draft,
        None,
        mask_token_id=MASK,
        resources={"target": target, "features": OnlineFeatures(target, list(draft.config.target_layer_ids))},
    )


def _rows(n=4, length=24):
    ids = torch.randint(0, 60, (n, length), generator=torch.Generator().manual_seed(3))
    return ids, Microbatch(ids, torch.ones(n, length), torch.ones_like(ids), torch.arange(n))


def _pre(built, draft, mbs, step=0, loss_fn=True):
    """`pre_step` at `step` (grad_acc = number of micro-batches), with or without a loss; returns (ctx, its output)."""
    ctx = StepContext(
        model=draft,
        loss_fn=built.loss_fn if loss_fn else None,
        mask_token_id=MASK,
        step=step,
        base_seed=7,
        grad_acc_steps=len(mbs),
    )
    return ctx, built.strategy.pre_step(ctx, mbs)


def test_shown_prefix_is_the_clean_tokens_and_is_not_supervised(pair):
    ids, mb = _rows()
    vp, decay = _strategy(pair, loss_type="variable_prefix"), _strategy(pair)
    _, ([batch], n_vp, _) = _pre(vp, pair[1], [mb])
    _, ([plain], n_decay, _) = _pre(decay, pair[1], [mb])
    e, d = batch.extras, plain.extras
    assert torch.equal(e.anchors, d.anchors)  # the prefix draws come from their own stream
    assert e.prefix.shape == (4, 3) and ((e.prefix >= 1) & (e.prefix <= 2)).all()
    assert n_vp == int(e.block_mask.sum()) < n_decay
    for b in range(4):
        for n in range(3):
            a, p = int(e.anchors[b, n]), int(e.prefix[b, n])
            block = e.block_ids[b, n * 4 : n * 4 + 4].tolist()
            assert block == [int(ids[b, a + k]) for k in range(p + 1)] + [MASK] * (3 - p)
            mask = e.block_mask[b, n * 3 : n * 3 + 3].tolist()
            assert mask == [0.0] * p + d.block_mask[b, n * 3 + p : n * 3 + 3].tolist()
            assert e.targets[b, n * 3 : n * 3 + 3].tolist() == d.targets[b, n * 3 : n * 3 + 3].tolist()
    # no loss (the evaluate stage's teacher-forced acceptance): anchor-only blocks, as decoding drafts them
    _, ([bare], _, _) = _pre(vp, pair[1], [mb], loss_fn=False)
    assert bare.extras.prefix is None and torch.equal(bare.extras.block_ids, d.block_ids)


def test_shown_prefix_stays_inside_the_row_and_the_document(pair):
    """A prefix token past the row's end or in the next document stays [MASK] (and predicts nothing)."""
    ids = torch.arange(1, 25).view(1, 24)
    attn = torch.ones_like(ids)
    attn[0, 20:] = 0
    docs = torch.zeros_like(ids)
    docs[0, 10:] = 1
    mb = Microbatch(ids, attn.float(), attn, torch.arange(1), "train", docs)
    built = _strategy(pair, loss_type="variable_prefix", num_blocks_per_sample=16)
    _, ([batch], _, _) = _pre(built, pair[1], [mb])
    e = batch.extras
    for n in range(16):
        a, p = int(e.anchors[0, n]), int(e.prefix[0, n])
        for k in range(1, p + 1):
            inside = a + k < 20 and (a + k < 10) == (a < 10)
            assert int(e.block_ids[0, n * 4 + k]) == (int(ids[0, a + k]) if inside else MASK)
            assert e.block_mask[0, n * 3 + k - 1] == 0
    assert ((e.anchors < 10) & (e.anchors + e.prefix >= 10)).any()  # the case is exercised


def test_prefix_draws_are_a_function_of_seed_step_and_row(pair):
    """Same step: the same prefixes, whether the rows come as one micro-batch or two; another step: others."""
    _, mb = _rows()
    built = _strategy(pair, loss_type="variable_prefix")
    _, ([one], _, _) = _pre(built, pair[1], [mb], step=5)
    halves = [
        Microbatch(mb.input_ids[r], mb.loss_mask[r], mb.attention_mask[r], mb.row_ids[r]) for r in ([0, 1], [2, 3])
    ]
    # the row's global index is what seeds it: two micro-batches of 2 at grad_acc 2 hold rows 0, 1 | 2, 3
    _, (two, _, _) = _pre(built, pair[1], halves, step=5)
    _, ([again], _, _) = _pre(built, pair[1], [mb], step=5)
    _, ([later], _, _) = _pre(built, pair[1], [mb], step=6)
    assert torch.equal(one.extras.prefix, again.extras.prefix)
    assert torch.equal(one.extras.prefix, torch.cat([b.extras.prefix for b in two]))
    assert not torch.equal(one.extras.prefix, later.extras.prefix)


def test_prefix_zero_through_the_strategy_is_the_decay_loss(pair, monkeypatch):
    """With every drawn prefix 0 the variable-prefix step computes the decay step's loss, to the bit."""
    _, mb = _rows()
    monkeypatch.setattr(
        dflash_strategy, "draw_prefix_lengths", lambda gens, n, bs, base: torch.zeros(len(gens), n, dtype=torch.long)
    )
    losses = []
    for loss_type in ("variable_prefix", "decay"):
        built = _strategy(pair, loss_type=loss_type)
        ctx, (batches, n, _) = _pre(built, pair[1], [mb])
        out = built.strategy.forward_backward(ctx, batches[0], num_diffusion_tokens=n, num_ar_tokens=n, is_train=False)
        losses.append(out.total_loss)
    assert torch.equal(losses[0], losses[1])


def test_a_draft_trains_under_the_variable_prefix_loss(pair):
    target, _ = pair
    draft = copy.deepcopy(pair[1]).train()
    built = _strategy(pair, draft, loss_type="variable_prefix", prefix_weight_base=0.8)
    ids = (torch.arange(4)[:, None] * 7 + torch.arange(24)[None]) % 60  # predictable continuations
    mb = Microbatch(ids, torch.ones(4, 24), torch.ones_like(ids), torch.arange(4))
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-2)
    losses = []
    for step in range(25):
        ctx, (batches, n, _) = _pre(built, draft, [mb], step=step % 2)
        out = built.strategy.forward_backward(ctx, batches[0], num_diffusion_tokens=n, num_ar_tokens=n, is_train=True)
        opt.step()
        opt.zero_grad()
        losses.append(float(out.total_loss.detach()))
    assert sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4  # 3.6 → 2.9 over 25 steps
    assert all(p.grad is None for p in target.parameters())


# ---------------------------------------------------------------------------------------- options


def test_bad_option_values_are_refused_by_name(pair):
    dflash = REGISTRY["dflash"]
    for bad in (0, -0.5, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="prefix_weight_base"):
            _validated(dflash, {"loss_type": "variable_prefix", "prefix_weight_base": bad}, "dflash")
    with pytest.raises(ConfigError, match="loss_type"):
        _validated(dflash, {"loss_type": "variable-prefix"}, "dflash")
    with pytest.raises(ValueError, match=r"dflash.prefix_weight_base \(0.5\) is the prefix prior of loss_type"):
        DFlashOptions(prefix_weight_base=0.5)  # with the default loss_type decay
    with pytest.raises(ValueError, match="does nothing with loss_type dpace"):
        DFlashOptions(loss_type="dpace", prefix_weight_base=0.5)
    with pytest.raises(ValueError, match="variable_prefix needs dflash.block_size ≥ 3"):
        DFlashOptions(loss_type="variable_prefix", block_size=2)
    assert DFlashOptions(loss_type="variable_prefix", prefix_weight_base=1.5).prefix_weight_base == 1.5
    # a dump of decay options (the default base in it) loads back, as a checkpoint's recorded options do
    assert DFlashOptions.model_validate(DFlashOptions().model_dump()).loss_type == "decay"
    # a block size read from the draft: refused when the loss is built
    completed = DFlashOptions(loss_type="variable_prefix").model_copy(update={"block_size": 2})  # complete_options
    with pytest.raises(ValueError, match=r"variable_prefix needs dflash.block_size ≥ 3 \(got 2\)"):
        dflash_strategy.DFlashStrategy(completed).create_loss_fn()
    built = _strategy(pair, loss_type="variable_prefix")
    assert type(built.loss_fn) is DFlashDecayLoss and built.loss_fn.loss_gamma == 2.0


def test_the_config_names_where_a_stray_prefix_weight_base_was_written():
    """`prefix_weight_base` written with another loss type is refused at config load by the key as written, even
    at its default value; with `loss_type: variable_prefix` it is a resolved option."""
    raw = yaml.safe_load((Path(__file__).parents[3] / "configs/dflash.yaml").read_text())
    stray = copy.deepcopy(raw)
    stray["dflash"]["prefix_weight_base"] = 0.9
    with pytest.raises(ConfigError, match=r"^dflash.prefix_weight_base is the prefix prior of loss_type variable_"):
        validate_config(stray)
    stray = copy.deepcopy(raw)
    stray["dllm"] = {"overrides": {"dflash": {"prefix_weight_base": 0.9}}}
    with pytest.raises(ConfigError, match=r"^dllm.overrides.dflash.prefix_weight_base is the prefix prior"):
        validate_config(stray)
    raw["dflash"].update(loss_type="variable_prefix", prefix_weight_base=0.8)
    assert printed_options(validate_config(raw))["dflash"]["prefix_weight_base"] == 0.8
