"""DFlash as a strategy (docs/strategies.md §5.7, §10): cached and online features, seeds, setup errors, training
that lowers the loss and touches only the draft, D-PACE's split invariance (micro-batches and gloo ranks), and
speculative sampling distributed as the target's own."""

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from dflashkit import _batch, _ctx, _loss, _strategy
from rankkit import run_ranks
from stagekit import dflash_pair

from strategies import Microbatch, SetupContext, StepContext, assemble_strategy
from strategies.base import global_sum
from strategies.dflash.decoding import speculative_generate
from strategies.dflash.features import CachedFeatures, OnlineFeatures, write_feature_cache
from strategies.dflash.loss import (
    DFlashDecayLoss,
    DFlashDPACELoss,
    scored_blocks,
)
from strategies.dflash.strategy import DFlashBlocks, DFlashStrategy
from strategies.options import DFlashOptions

MASK = 63


@pytest.fixture(scope="module")
def pair():
    """A frozen 5-layer target and a 2-layer draft (tests/stagekit.py: dflash_pair)."""
    return dflash_pair()


# ---------------------------------------------------------------------------------------- the strategy


def test_cached_and_online_features_give_the_same_loss(pair, tmp_path):
    target, draft = pair
    ids, mb = _batch()
    online, batches = _loss(_strategy(target, draft), draft, mb)
    index = write_feature_cache(
        target,
        {"train": ids},
        draft.config.target_layer_ids,
        tmp_path / "fp32",
        dtype="fp32",
        batch_size=3,
        shard_rows=3,
    )  # 2 shards, batches across them
    assert [s["rows"] for s in index["splits"]["train"]] == [3, 1] and index["bytes"] > 0
    cached, cached_batches = _loss(_strategy(target, draft, CachedFeatures(tmp_path / "fp32")), draft, mb)
    assert isinstance(batches[0].extras, DFlashBlocks) and isinstance(cached_batches[0].extras, DFlashBlocks)
    assert torch.equal(batches[0].extras.anchors, cached_batches[0].extras.anchors)
    assert torch.allclose(online.total_loss, cached.total_loss, atol=1e-6)
    write_feature_cache(target, {"train": ids}, draft.config.target_layer_ids, tmp_path / "bf16", dtype="bf16")
    half, _ = _loss(_strategy(target, draft, CachedFeatures(tmp_path / "bf16")), draft, mb)
    assert abs(float(half.total_loss) - float(online.total_loss)) < 0.02 * float(online.total_loss)
    with pytest.raises(FileNotFoundError, match="no target-feature cache"):
        CachedFeatures(tmp_path)


def test_soft_labels_from_the_cache_equal_the_online_ones_and_are_refused_when_missing(pair, tmp_path):
    """`distill_top_k`: the cache stores the target's top-k per position, the loss is the same as with the
    target run online, it differs from the hard-label loss, and a cache without them is refused at setup."""
    target, draft = pair
    ids, mb = _batch()
    online, batches = _loss(
        _strategy(target, draft, OnlineFeatures(target, draft.config.target_layer_ids, 8), distill_top_k=4), draft, mb
    )
    soft = batches[0].extras.soft
    assert soft.ids.shape == (4, 9, 4) and torch.allclose(soft.probs.sum(-1), torch.ones(4, 9))
    index = write_feature_cache(
        target, {"train": ids}, draft.config.target_layer_ids, tmp_path / "k8", dtype="fp32", top_k=8
    )
    assert index["top_k"] == 8
    cached, _ = _loss(_strategy(target, draft, CachedFeatures(tmp_path / "k8"), distill_top_k=4), draft, mb)
    assert torch.allclose(online.total_loss, cached.total_loss, atol=1e-6)
    hard, _ = _loss(_strategy(target, draft), draft, mb)
    assert not torch.allclose(hard.total_loss, online.total_loss)
    write_feature_cache(target, {"train": ids}, draft.config.target_layer_ids, tmp_path / "k0", dtype="fp32")
    with pytest.raises(
        ValueError, match="dflash.distill_top_k is 4 but the target-feature source holds the target's top 0"
    ):
        _strategy(target, draft, CachedFeatures(tmp_path / "k0"), distill_top_k=4)


def test_anchors_are_a_function_of_seed_step_and_row(pair):
    target, draft = pair
    built = _strategy(target, draft)
    s = built.strategy
    _, mb = _batch()
    first = s.pre_step(_ctx(built, draft, 5), [mb])[0][0].extras.anchors
    again = s.pre_step(_ctx(built, draft, 5), [mb])[0][0].extras.anchors
    later = s.pre_step(_ctx(built, draft, 6), [mb])[0][0].extras.anchors
    assert torch.equal(first, again) and not torch.equal(first, later)


def test_setup_errors_name_what_to_change(pair):
    target, draft = pair
    s = DFlashStrategy({"block_size": 4})
    with pytest.raises(ValueError, match="dflash.target_model_id must be set in config."):
        s.setup_extra(SetupContext(model=draft, tokenizer=None, mask_token_id=MASK))
    with pytest.raises(ValueError, match="dflash.target_model_id must be set in config."):
        assemble_strategy("dflash", {"block_size": 4}, draft, None, mask_token_id=MASK)
    with pytest.raises(ValueError, match="dflash.block_size must be at least 2"):
        DFlashStrategy({"block_size": 1})  # refused by the options
    with pytest.raises(ValueError, match=r"block_size \(1\) must be at least 2"):  # a draft config can't hold it
        replace(draft.config, block_size=1)
    with pytest.raises(ValueError, match="dflash.block_size must be at least 2."):  # a model reporting block 1
        DFlashStrategy.complete_options(DFlashOptions(), SimpleNamespace(config=SimpleNamespace(block_size=1)))
    with pytest.raises(ValueError, match="Cannot infer block_size from draft config"):
        DFlashStrategy.complete_options(DFlashOptions(), SimpleNamespace(config=None))
    with pytest.raises(ValueError, match="Cannot infer block_size from draft config"):
        DFlashStrategy().create_loss_fn()  # block size 0 is resolved only against a draft
    with pytest.raises(ValueError, match="the target-feature cache holds layers .* but the draft reads"):
        DFlashStrategy({"block_size": 4}, target=target, features=OnlineFeatures(target, [99])).setup_extra(
            SetupContext(model=draft, tokenizer=None, mask_token_id=MASK)
        )
    assert DFlashStrategy().block_size is None  # unset until completed against the draft
    built = assemble_strategy("dflash", {}, draft, None, mask_token_id=MASK, resources={"target": target})
    s = built.strategy
    assert s.block_size == draft.config.block_size and built.loss_fn.loss_gamma == 2.0  # γ = max(2, bs/2) for bs 4
    assert isinstance(built.loss_fn, DFlashDecayLoss) and s.target is target and built.mask_token_id == MASK


def test_draft_training_lowers_the_loss_and_touches_only_the_draft(pair):
    target, draft = pair
    draft = copy.deepcopy(draft).train()
    built = _strategy(target, draft)
    s = built.strategy
    ids = (torch.arange(4)[:, None] * 7 + torch.arange(24)[None]) % 60  # predictable continuations
    mb = Microbatch(ids, torch.ones(4, 24), torch.ones_like(ids), torch.arange(4))
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    losses = []
    for step in range(40):
        ctx = _ctx(built, draft, step % 2)
        batches, n, _ = s.pre_step(ctx, [mb])
        out = s.forward_backward(ctx, batches[0], num_diffusion_tokens=n, num_ar_tokens=n, is_train=True)
        opt.step()
        opt.zero_grad()
        losses.append(float(out.total_loss))
    assert losses[-1] < 0.85 * losses[0]  # a frozen random 64-token head makes this slow; it does fall
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in target.parameters())
    assert not target.training and not any(p.requires_grad for p in target.parameters())  # still frozen


def _uneven_rows():
    """Four rows whose scored-block counts differ (row 1 is too short to keep any block; row 3 has its first
    eight tokens unsupervised), so a per-micro-batch or per-rank denominator would change the loss."""
    ids = torch.randint(0, 60, (4, 24), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0
    loss_mask = attn.float().clone()
    loss_mask[3, :8] = 0
    return ids, loss_mask, attn


def _split_step(built, draft, rows, microbatches: int, dp_rank: int = 0, dp_size: int = 1):
    """One training step over `rows` (global row indices) split into `microbatches`: pre_step, the
    (all-reduced) denominators, forward/backward × loss_scale. Returns (Σ micro-batch losses, denominator)."""
    ids, loss_mask, attn = _uneven_rows()
    per = len(rows) // microbatches
    mbs = [
        Microbatch(ids[r], loss_mask[r], attn[r], torch.tensor(r))
        for r in (rows[i * per : (i + 1) * per] for i in range(microbatches))
    ]
    ctx = StepContext(
        model=draft,
        loss_fn=built.loss_fn,
        mask_token_id=MASK,
        step=3,
        base_seed=7,
        dp_rank=dp_rank,
        dp_size=dp_size,
        grad_acc_steps=microbatches,
        loss_scale=float(dp_size),
    )
    s = built.strategy
    batches, n_noise, n_sup = s.pre_step(ctx, mbs)
    n_diff, n_ar = s.loss_denominators(batches, global_sum(n_noise), global_sum(n_sup))
    total = sum(
        float(s.forward_backward(ctx, b, num_diffusion_tokens=n_diff, num_ar_tokens=n_ar, is_train=True).dllm_loss)
        for b in batches
    )
    return total, n_diff


@pytest.mark.parametrize("loss_type", ["decay", "dpace"])
def test_loss_and_gradient_do_not_depend_on_the_micro_batch_split(pair, loss_type):
    """The same 4 rows as one micro-batch of 4 or two of 2: same anchors (per-row seeds), same loss, same
    gradient, because each micro-batch divides by the step's global count (docs/strategies.md §7.2)."""
    target, draft = pair
    results = []
    for microbatches in (1, 2):
        d = copy.deepcopy(draft)
        built = _strategy(target, d, loss_type=loss_type)
        loss, denominator = _split_step(built, d, [0, 1, 2, 3], microbatches)
        results.append((loss, denominator, [p.grad.clone() for p in d.parameters()]))
    (one, den_one, g_one), (two, den_two, g_two) = results
    assert den_one == den_two and one == pytest.approx(two, rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7, rtol=1e-5) for a, b in zip(g_one, g_two))
    if loss_type == "dpace":
        assert den_one == 8  # 3 + 0 + 3 + 2 scored blocks of 3 rows kept
        assert isinstance(built.loss_fn, DFlashDPACELoss)
    else:
        assert isinstance(built.loss_fn, DFlashDecayLoss) and built.loss_fn.loss_gamma == 2.0


def test_a_per_micro_batch_dpace_denominator_would_change_the_update(pair):
    """Sensitivity of the test above: dividing each micro-batch by its own block count (what a rank-local
    denominator does, then averaged over ranks) weights the blocks of the smaller share more: another
    gradient on the same rows."""
    target, draft = pair
    ids, loss_mask, attn = _uneven_rows()
    grads = {}
    for name in ("global", "local"):
        d = copy.deepcopy(draft)
        built = _strategy(target, d, loss_type="dpace")
        ctx = StepContext(model=d, loss_fn=built.loss_fn, mask_token_id=MASK, step=3, base_seed=7, grad_acc_steps=2)
        mbs = [Microbatch(ids[r], loss_mask[r], attn[r], torch.tensor(r)) for r in ([0, 1], [2, 3])]
        batches, _, _ = built.strategy.pre_step(ctx, mbs)
        local = [scored_blocks(b.extras.block_mask, 4) for b in batches]
        assert local == [3, 5]
        for b, n in zip(batches, local):
            count, scale = (sum(local), 1.0) if name == "global" else (n, 0.5)
            out = built.strategy.forward_backward(ctx, b, num_diffusion_tokens=count, num_ar_tokens=1, is_train=False)
            (out.total_loss * scale).backward()
        grads[name] = torch.cat([p.grad.flatten() for p in d.parameters()])
    gap = (grads["global"] - grads["local"]).norm() / grads["global"].norm()
    assert gap > 0.05


def _gloo_worker(rank: int, world: int, out_file: str, loss_type: str):
    """Rank `rank` of `world`: rows rank, rank + world, … of the global batch, gloo all-reduces, gradients
    averaged over ranks as DDP averages them."""
    import torch.distributed as dist

    target, draft = dflash_pair()
    built = _strategy(target, draft, loss_type=loss_type)
    loss, denominator = _split_step(built, draft, list(range(rank, 4, world)), 1, rank, world)
    grads = [p.grad for p in draft.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
        grad /= world
    if rank == 0:
        torch.save({"loss": global_sum(loss), "denominator": denominator, "grads": grads}, out_file)
    else:
        global_sum(loss)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dpace"])
def test_dpace_under_two_gloo_processes_matches_one_process(tmp_path, loss_type):
    """Two CPU processes (gloo), two rows each, against one process with all four: the D-PACE denominator
    (scored blocks) is all-reduced, so the loss and the DDP-averaged gradient are the one-process ones."""
    target, draft = dflash_pair()
    built = _strategy(target, draft, loss_type=loss_type)
    loss, denominator = _split_step(built, draft, [0, 1, 2, 3], 1)
    out = tmp_path / "rank0.pt"
    run_ranks(_gloo_worker, str(out), loss_type, tmp_path=tmp_path)
    two = torch.load(out)
    assert two["denominator"] == denominator == 8
    assert two["loss"] == pytest.approx(loss, rel=1e-6)
    assert all(torch.allclose(p.grad, g, atol=1e-7, rtol=1e-5) for p, g in zip(draft.parameters(), two["grads"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention has no CPU backward in torch 2.13; GPU check")
def test_flex_block_mask_trains_like_the_dense_mask_on_gpu(pair):
    """On CUDA the draft trains through the flex BlockMask: same loss and gradients as the dense mask, on packed
    rows (three documents in row 0) as on plain ones."""
    target, draft = (m.cuda() for m in copy.deepcopy(pair))
    ids = torch.randint(0, 60, (2, 256), generator=torch.Generator().manual_seed(4)).cuda()
    docs = torch.zeros_like(ids)
    docs[0, 90:], docs[0, 170:] = 1, 2
    mb = Microbatch(
        ids, torch.ones_like(ids, dtype=torch.float32), torch.ones_like(ids), torch.arange(2), "train", docs
    )
    grads, losses = [], []
    for backend in ("sdpa", "flex_attention"):
        d = copy.deepcopy(draft).train()
        built = _strategy(target, d, attention_backend=backend, num_blocks_per_sample=8)
        s = built.strategy
        ctx = _ctx(built, d)
        batches, n, _ = s.pre_step(ctx, [mb])
        out = s.forward_backward(ctx, batches[0], num_diffusion_tokens=n, num_ar_tokens=n, is_train=True)
        losses.append(float(out.total_loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-3)


def test_speculative_accept_commits_tokens_distributed_as_the_target():
    """Rejection step, k = 2, V = 5, a draft far from the target: the first committed token follows p_0
    exactly, and so does the second wherever the first proposal stood (p does not depend on the prefix
    here). A chi-square test over 20k draws at significance 1e-4; the draft itself fails the same test."""
    from scipy.stats import chisquare

    from strategies.dflash.decoding import speculative_accept

    p = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05], [0.05, 0.05, 0.10, 0.30, 0.50], [0.2] * 5])
    q = torch.tensor([[0.05, 0.05, 0.30, 0.30, 0.30], [0.40, 0.30, 0.10, 0.10, 0.10]])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    first, second, accepted_counts = [], [], []
    for _ in range(n):
        proposal = torch.multinomial(q, 1, generator=g)[:, 0]
        accepted, nxt = speculative_accept(p, q, proposal, g)
        tokens = proposal[:accepted].tolist() + [nxt]
        first.append(tokens[0])
        if len(tokens) > 1:
            second.append(tokens[1])
        accepted_counts.append(accepted)

    def pvalue(seen, probs):
        expected = probs.double() / probs.double().sum() * float(seen.sum())
        return chisquare(seen.double().numpy(), expected.numpy()).pvalue

    assert pvalue(torch.bincount(torch.tensor(first), minlength=5), p[0]) > 1e-4
    assert pvalue(torch.bincount(torch.tensor(second), minlength=5), p[1]) > 1e-4
    # sensitivity: draws from the draft itself are rejected by the same test
    assert pvalue(torch.bincount(torch.multinomial(q[0], n, replacement=True, generator=g), minlength=5), p[0]) < 1e-4
    # expected acceptance of the first proposal is Σ min(p, q)
    rate = sum(a >= 1 for a in accepted_counts) / n
    assert rate == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=0.015)


def test_speculative_sampling_matches_target_sampling_on_a_model(pair):
    """The first two generated tokens of a prompt, 1,500 runs at T = 1: their joint frequencies are those
    of the target's own ancestral sampling (exact probabilities from the target, chi-square over the
    64 + 64 marginals), while the argmax path stays the greedy one."""
    from scipy.stats import chisquare

    target, draft = pair
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        nxt = torch.arange(64)[:, None]
        rows = torch.cat([torch.tensor([prompt]).expand(64, -1), nxt], dim=1)
        p2 = (p1[:, None] * torch.softmax(target(input_ids=rows).logits[:, -1], -1)).sum(0)  # marginal of token 2
    g = torch.Generator().manual_seed(0)
    n = 1500
    counts = torch.zeros(2, 64)
    for _ in range(n):
        out = speculative_generate(target, draft, prompt, max_new_tokens=2, temperature=1.0, generator=g).tokens
        counts[0, out[0]] += 1
        counts[1, out[1]] += 1
    for seen, probs in ((counts[0], p1), (counts[1], p2)):
        expected = probs.double() / probs.double().sum() * n
        assert chisquare(seen.numpy(), expected.numpy()).pvalue > 1e-4
    again = speculative_generate(target, draft, prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(3))
    same = speculative_generate(target, draft, prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert again.tokens == same.tokens  # the seed alone decides the sample


def test_a_draft_trained_on_the_targets_top_k_loads_from_its_checkpoints_options(pair):
    """`dllm-flow generate` rebuilds a draft's strategy from the options its checkpoint records (a dict): a draft
    trained with `distill_top_k` gets online features holding that many of the target's tokens, as evaluation's
    typed options do (it used to get none and was refused: 'the target-feature source holds the target's top 0')."""
    from tasks.speculative.setup import draft_strategy

    target, draft = pair
    options = {"block_size": 4, "distill_top_k": 8}
    built = draft_strategy("dflash", options, draft, target, mask_token_id=MASK)
    assert built.strategy.features.top_k == 8
    assert draft_strategy("dflash", {"block_size": 4}, draft, target, mask_token_id=MASK).strategy.features.top_k == 0
