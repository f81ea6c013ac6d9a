"""DFlash 2 (docs/strategies.md §10.11): the identity start (a fresh DFlash 2 draft gives the plain draft's logits),
the in-block convolution against an element-wise reference and its block boundary, the selector's score and walk
by hand, the objective and `candidate_recall` by hand, speculative decoding = target greedy through the selector,
exact speculative sampling through it, and the published layout's export → import."""

import json

import pytest
import torch
import torch.nn.functional as F
from stagekit import tiny_dflash_target, tiny_draft_config

from strategies import Microbatch, StepContext, assemble_strategy
from strategies.dflash.blocks import sample_anchor_blocks
from strategies.dflash.config import draft_keys, parse_draft_config
from strategies.dflash.decoding import greedy_generate, speculative_generate
from strategies.dflash.dflash2 import (
    CandidateSelector,
    block_predecessors,
    candidate_recall,
    dflash2_parameters,
    in_block_conv,
    selector_loss,
    selector_scores,
)
from strategies.dflash.draft import (
    DFlashDraftConfig,
    DFlashDraftModel,
    draft_block_hidden,
    draft_block_logits,
    target_features,
)
from strategies.dflash.features import OnlineFeatures
from strategies.dflash.serving_layout import write_serving_layout
from strategies.options import DFlashOptions
from tasks.speculative.export import draft_format

MASK, V, BS = 63, 64, 4
SHAPES = {"conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}


@pytest.fixture(scope="module")
def target():
    return tiny_dflash_target()


def _cfg(**kw) -> DFlashDraftConfig:
    return tiny_draft_config(**kw)


def _dflash2(seed=1, randomize=False, **kw) -> DFlashDraftModel:
    torch.manual_seed(seed)
    draft = DFlashDraftModel(_cfg(variant="dflash2", **{**SHAPES, **kw})).eval()
    if randomize:  # move the convolutions and the selector off the identity
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if "conv" in name or "selector" in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return draft


def _rows(n=2, length=24, seed=0):
    return torch.randint(0, 60, (n, length), generator=torch.Generator().manual_seed(seed))


def _blocks(ids, n_blocks=3):
    return sample_anchor_blocks(
        ids, torch.ones_like(ids), None, block_size=BS, num_blocks=n_blocks, mask_token_id=MASK, generators=None
    )


# ---------------------------------------------------------------------------------------- identity and the conv


def test_a_fresh_dflash2_draft_gives_exactly_the_plain_drafts_logits_and_decoding(target):
    torch.manual_seed(1)
    plain = DFlashDraftModel(_cfg()).eval()
    draft2 = _dflash2(seed=1)
    shared = plain.state_dict()
    assert all(torch.equal(draft2.state_dict()[k], v) for k, v in shared.items())  # one seed, one backbone
    added = sorted(set(draft2.state_dict()) - set(shared))
    assert added == sorted(set(draft_keys(draft2.config)) - set(draft_keys(plain.config)))
    assert sum(p.numel() for p in draft2.parameters()) - sum(p.numel() for p in plain.parameters()) == (
        dflash2_parameters(draft2.config)
    )
    ids = _rows()
    feats, _, _ = target_features(target, ids, plain.config.target_layer_ids)
    b = _blocks(ids)
    with torch.no_grad():
        a = draft_block_logits(plain, target, feats, b.anchors, b.keep, b.block_ids)
        c = draft_block_logits(draft2, target, feats, b.anchors, b.keep, b.block_ids)
    assert torch.equal(a, c)
    for prompt in ([1, 2, 3], [5, 9, 9, 4, 2, 7]):
        x, y = speculative_generate(target, plain, prompt, 16), speculative_generate(target, draft2, prompt, 16)
        assert (x.tokens, x.acceptance) == (y.tokens, y.acceptance)


def _reference_conv(x, base, dynamic, group_size, block_size):
    out = torch.zeros_like(x)
    bsz, length, hidden = x.shape
    for b in range(bsz):
        for t in range(length):
            for c in range(hidden):
                for j in range(base.shape[0]):
                    if t % block_size - j < 0:  # before the block's start: zero padding, never the previous block
                        continue
                    k = base[j, c] + dynamic[b, t, j, c // group_size]
                    out[b, t, c] += k * x[b, t - j, c]
    return out


@pytest.mark.parametrize("kernel", [2, 3])
def test_the_in_block_convolution_matches_an_elementwise_reference(kernel):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3 * BS, 8, generator=g, dtype=torch.float64)
    base = torch.randn(kernel, 8, generator=g, dtype=torch.float64)
    dynamic = torch.randn(2, 3 * BS, kernel, 2, generator=g, dtype=torch.float64)
    got = in_block_conv(x, base, dynamic, 4, BS)
    torch.testing.assert_close(got, _reference_conv(x, base, dynamic, 4, BS), rtol=0, atol=1e-12)
    # nothing of block 0 reaches block 1
    y = x.clone()
    y[:, BS - 1] += 5.0
    assert torch.equal(in_block_conv(y, base, dynamic, 4, BS)[:, BS:], got[:, BS:])


def test_blocks_laid_end_to_end_draft_exactly_as_each_block_alone(target):
    """The training layout (N blocks in one forward) and the decoding one (a single block) agree for a DFlash 2
    draft whose convolutions and selector are far from the identity: the taps stop at the block boundary."""
    draft = _dflash2(randomize=True).double()  # float64: the two layouts differ by rounding only
    ids = _rows(n=1)
    feats, _, _ = target_features(target, ids, draft.config.target_layer_ids)
    feats = feats.double()
    b = _blocks(ids)
    emb = target.get_input_embeddings()
    with torch.no_grad():
        together = draft_block_hidden(draft, BS, emb, feats, b.anchors, b.keep, b.block_ids)
        for n in range(3):
            alone = draft_block_hidden(
                draft,
                BS,
                emb,
                feats,
                b.anchors[:, n : n + 1],
                b.keep[:, n : n + 1],
                b.block_ids[:, n * BS : (n + 1) * BS],
            )
            torch.testing.assert_close(together[:, n * BS : (n + 1) * BS], alone, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------- the selector


def _selector(vocab=5, hidden=3, rank=2, top_k=3, seed=0):
    sel = CandidateSelector(vocab, hidden, rank, top_k)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return sel


def test_the_selector_score_is_the_logit_plus_the_gated_codebook_match():
    sel = _selector()
    A, B, W = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    h = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]])
    unary = torch.tensor([[3.0, 1.0, -2.0], [0.5, 0.0, 4.0]])
    cands = torch.tensor([[4, 0, 2], [1, 3, 0]])
    prev = torch.tensor([2, 4])
    got = sel.scores(h, unary, cands, prev)
    for t in range(2):
        gate = [sum(W[r, i] * h[t, i] for i in range(3)) for r in range(2)]
        for j in range(3):
            expect = unary[t, j] + sum(A[prev[t], r] * gate[r] * B[cands[t, j], r] for r in range(2))
            assert float(got[t, j].detach()) == pytest.approx(float(expect.detach()), abs=1e-5)


def test_the_walk_scores_each_position_after_the_token_it_picked():
    """Greedy walk by hand: candidates = top-k of the logits, position t scored after the pick at t − 1 (the
    anchor first); the returned proposal logits are the scores on the candidates and −inf elsewhere."""
    sel = _selector(vocab=6, top_k=3, seed=3)
    g = torch.Generator().manual_seed(4)
    h, logits = torch.randn(3, 3, generator=g), torch.randn(3, 6, generator=g)
    with torch.no_grad():
        path, q = sel.walk(h, logits, anchor=5, temperature=0.0, generator=None)
        prev = 5
        for t in range(3):
            unary, cands = logits[t].topk(3)
            s = sel.scores(h[t], unary, cands, torch.tensor(prev))
            assert int(path[t]) == int(cands[s.argmax()])
            assert torch.equal(q[t, cands], s) and torch.isinf(q[t]).sum() == 3
            prev = int(path[t])
    # with forced leading tokens (the context lookup's) the path starts with them and the rest is walked after them
    with torch.no_grad():
        forced_path, forced_q = sel.walk(h, logits, anchor=5, temperature=0.0, generator=None, forced=[2])
        unary, cands = logits[1].topk(3)
        s = sel.scores(h[1], unary, cands, torch.tensor(2))
        assert int(forced_path[0]) == 2 and int(forced_path[1]) == int(cands[s.argmax()])
        torch.testing.assert_close(forced_q[1, cands], s)
        assert torch.equal(forced_q[0], q[0])
    # at the identity (successor codebook zero) the walk is each position's argmax
    with torch.no_grad():
        sel.successor_codebook.zero_()
        assert torch.equal(sel.walk(h, logits, 5, 0.0, None)[0], logits.argmax(-1))


def test_the_selector_loss_and_candidate_recall_by_hand():
    """Two rows of one block (bs 4): candidates are the top-2 of the head's logits, scored after the true
    predecessor (anchor, then the true tokens); the CE is over the candidates, positions whose true token is
    not a candidate are left out, weights and the global count as given."""
    torch.manual_seed(0)
    sel = _selector(vocab=6, hidden=3, rank=2, top_k=2, seed=5)
    head = torch.nn.Linear(3, 6, bias=False)
    hidden = torch.randn(2, 3, 3, requires_grad=True)
    block_ids = torch.tensor([[1, MASK, MASK, MASK], [4, MASK, MASK, MASK]])
    targets = torch.tensor([[2, 3, 0], [5, 5, 1]])
    logits = head(hidden).detach()
    top = logits.topk(2, dim=-1).indices
    targets[0, 0] = int(top[0, 0, 1])  # make sure some true tokens are candidates ...
    targets[1, 2] = int(top[1, 2, 0])
    other = [v for v in range(6) if v not in top[0, 1].tolist()]
    targets[0, 1] = other[0]  # ... and one is not
    preds = block_predecessors(block_ids, targets, 4)
    assert preds.tolist() == [[1, int(targets[0, 0]), int(targets[0, 1])], [4, 5, 5]]
    s = selector_scores(sel, hidden, head, preds, targets, chunk_size=2)
    weights = torch.tensor([[1.0, 0.5, 0.25], [1.0, 0.0, 0.25]])
    got = selector_loss(s, weights, num_tokens=5)
    total, hits, count = 0.0, 0, 0
    A, B, W = (p.detach() for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight))
    hd = hidden.detach()
    for b in range(2):
        for t in range(3):
            cands = logits[b, t].topk(2).indices.tolist()
            scores = [float(logits[b, t, c]) + float((A[preds[b, t]] * (W @ hd[b, t]) * B[c]).sum()) for c in cands]
            count += weights[b, t] > 0
            if int(targets[b, t]) not in cands:
                continue
            hits += weights[b, t] > 0
            i = cands.index(int(targets[b, t]))
            total += float(weights[b, t]) * -(scores[i] - torch.logsumexp(torch.tensor(scores), 0).item())
    assert got.item() == pytest.approx(total / 5, rel=1e-5)
    assert candidate_recall(s, (weights > 0).float()) == (float(hits), float(count))
    got.backward()  # the candidates' logits keep their gradient (through the checkpointed chunks)
    assert sel.successor_codebook.grad.abs().sum() > 0
    assert hidden.grad.abs().sum() > 0 and head.weight.grad.abs().sum() > 0


def _strategy(target, draft, **cfg):
    return assemble_strategy(
        "dflash",
        {"block_size": BS, "num_blocks_per_sample": 3, "draft_variant": "dflash2", **SHAPES, **cfg},
        draft,
        None,
        mask_token_id=MASK,
        resources={"target": target, "features": OnlineFeatures(target, list(draft.config.target_layer_ids))},
    )


def _step(built, draft, ids):
    ctx = StepContext(model=draft, loss_fn=built.loss_fn, mask_token_id=MASK, step=0, base_seed=7)
    mb = Microbatch(ids, torch.ones_like(ids, dtype=torch.float32), torch.ones_like(ids), torch.arange(len(ids)))
    (batch,), n, _ = built.strategy.pre_step(ctx, [mb])
    out = built.strategy.forward_backward(ctx, batch, num_diffusion_tokens=n, num_ar_tokens=n, is_train=False)
    return out, batch.extras, n


@pytest.mark.parametrize("loss_type", ["decay", "variable_prefix"])
def test_the_objective_is_the_block_loss_plus_the_weighted_selector_term(target, loss_type):
    draft = _dflash2(randomize=True)
    ids = _rows(n=3, length=24, seed=2)
    base, _, _ = _step(_strategy(target, draft, loss_type=loss_type, selector_loss_weight=0.0), draft, ids)
    built = _strategy(target, draft, loss_type=loss_type, selector_loss_weight=0.7)
    out, e, n = _step(built, draft, ids)
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        h = draft_block_hidden(draft, BS, emb, e.features, e.anchors, e.keep, e.block_ids)
        b, nb = e.anchors.shape
        pred = h.view(b, nb, BS, -1)[:, :, 1:].reshape(b, -1, h.shape[-1])
        logits = head(pred)
        w = built.loss_fn.position_weights(e.block_mask, e.block_mask, BS, e.prefix) * e.block_mask
        preds = block_predecessors(e.block_ids, e.targets, BS)
        term, right = 0.0, torch.zeros(BS - 1)
        for r in range(b):
            for t in range(pred.shape[1]):
                unary, cands = logits[r, t].topk(4)
                s = draft.candidate_selector.scores(pred[r, t], unary, cands, preds[r, t])
                right[t % (BS - 1)] += float(e.block_mask[r, t]) * (int(cands[s.argmax()]) == int(e.targets[r, t]))
                if int(e.targets[r, t]) in cands.tolist():
                    i = cands.tolist().index(int(e.targets[r, t]))
                    term += float(w[r, t]) * float(-F.log_softmax(s, -1)[i])
    assert out.total_loss.item() == pytest.approx(base.total_loss.item() + 0.7 * term / n, rel=1e-5)
    assert torch.equal(out.draft_correct_per_pos, right)  # train/draft_acc_k*: the selector's picks


def test_the_loss_and_gradient_do_not_depend_on_the_micro_batch_split(target):
    """The selector term is divided by the step's global count, like the block loss, so two micro-batches give
    the one-batch loss and gradient (rows keep their seeds, so their anchors)."""
    draft = _dflash2(randomize=True)
    built = _strategy(target, draft, loss_type="variable_prefix")
    ids = _rows(n=4, length=24, seed=5)
    ones = torch.ones_like(ids)
    results = []
    for parts in ([slice(0, 4)], [slice(0, 2), slice(2, 4)]):
        draft.zero_grad()
        ctx = StepContext(
            model=draft, loss_fn=built.loss_fn, mask_token_id=MASK, step=3, base_seed=7, grad_acc_steps=len(parts)
        )
        mbs = [Microbatch(ids[p], ones[p].float(), ones[p], torch.arange(4)[p]) for p in parts]
        batches, n, _ = built.strategy.pre_step(ctx, mbs)
        loss = sum(
            built.strategy.forward_backward(ctx, b, num_diffusion_tokens=n, num_ar_tokens=n, is_train=True)
            .total_loss.detach()
            .item()
            for b in batches
        )
        results.append((loss, [p.grad.clone() for p in draft.parameters()]))
    (one, g1), (two, g2) = results
    assert one == pytest.approx(two, rel=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert draft.candidate_selector.successor_codebook.grad.abs().sum() > 0


def test_dflash2_options_refuse_what_it_cannot_train():
    with pytest.raises(ValueError, match="not dpace"):
        DFlashOptions(loss_type="dpace", draft_variant="dflash2")
    with pytest.raises(ValueError, match="no copy hint"):
        DFlashOptions(copy_hint=True, draft_variant="dflash2")
    with pytest.raises(ValueError, match="conv_group_size \\(12\\) must divide hidden_size \\(32\\)"):
        _cfg(variant="dflash2", conv_group_size=12)


def test_the_strategy_refuses_a_draft_of_the_other_variant(target):
    torch.manual_seed(1)
    with pytest.raises(ValueError, match="draft_variant is dflash2 but the draft is a dflash draft"):
        _strategy(target, DFlashDraftModel(_cfg()))


# ---------------------------------------------------------------------------------------- decoding


def test_speculative_decoding_through_the_selector_equals_target_greedy(target):
    draft = _dflash2(randomize=True)
    for prompt in ([1, 2, 3], [5, 9, 9, 4, 2, 7], [3, 1, 4, 1, 5, 3, 1, 4]):
        spec = speculative_generate(target, draft, prompt, max_new_tokens=20)
        assert spec.tokens == greedy_generate(target, prompt, 20)
        assert len(spec.acceptance) == spec.target_forwards - 1
        looked = speculative_generate(target, draft, prompt, max_new_tokens=20, lookup_ngram=1)
        assert looked.tokens == spec.tokens


def test_the_walk_draws_from_the_distributions_it_returns():
    """T > 0: each position's pick is a draw from softmax(proposal logits / T) given the pick before it (the
    distribution the rejection step reads), here the first position's over 3000 walks (chi-square)."""
    from scipy.stats import chisquare

    sel = _selector(vocab=6, top_k=3, seed=3)
    g = torch.Generator().manual_seed(4)
    h, logits = torch.randn(2, 3, generator=g), torch.randn(2, 6, generator=g)
    gen, seen, n = torch.Generator().manual_seed(0), torch.zeros(6), 3000
    with torch.no_grad():
        for _ in range(n):
            path, q = sel.walk(h, logits, anchor=5, temperature=0.7, generator=gen)
            seen[int(path[0])] += 1
    probs = torch.softmax(q[0].double() / 0.7, -1)
    assert int((probs > 0).sum()) == 3 and seen[probs == 0].sum() == 0  # only candidates are ever proposed
    keep = probs > 0
    assert chisquare(seen[keep].numpy(), (probs[keep] / probs[keep].sum() * n).numpy()).pvalue > 1e-4


def test_sampled_decoding_proposes_from_the_backbone_unless_the_walk_is_asked_for(target):
    """At T > 0 the decoder proposes from the backbone's one-pass distribution (docs/strategies.md §10.13): the
    output and acceptance do not depend on the selector's weights. `sampled_proposals="walk"` samples the selector's
    path, as the engines do, and then they do."""
    prompts = [[1, 2, 3, 4], [5, 9, 2, 7, 1]]

    def run(draft, **kw):
        out = []
        for i, p in enumerate(prompts):
            g = torch.Generator().manual_seed(i)
            r = speculative_generate(target, draft, p, 12, temperature=1.0, generator=g, **kw)
            out.append((r.tokens, r.acceptance))
        return out

    a, b = _dflash2(randomize=True, selector_top_k=2), _dflash2(randomize=True, selector_top_k=2)
    with torch.no_grad():  # another selector over the same backbone
        for p in b.candidate_selector.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 2)
    assert run(a) == run(b)
    assert run(a, sampled_proposals="walk") != run(b, sampled_proposals="walk")
    assert run(a, sampled_proposals="backbone") == run(a)


def test_speculative_sampling_through_the_selector_matches_target_sampling(target):
    """T = 1: the second generated token (the first the draft proposes, drawn by the selector's walk from only
    2 candidates) is distributed as the target's own marginal: chi-square over the target's 7 likeliest tokens
    and the rest, 150 runs."""
    from scipy.stats import chisquare

    draft = _dflash2(randomize=True, selector_top_k=2)
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        rows = torch.cat([torch.tensor([prompt]).expand(V, -1), torch.arange(V)[:, None]], dim=1)
        p2 = (p1[:, None] * torch.softmax(target(input_ids=rows).logits[:, -1], -1)).sum(0).double()
    top = p2.topk(7).indices
    g, n, seen = torch.Generator().manual_seed(0), 150, torch.zeros(8)
    for _ in range(n):
        token = speculative_generate(
            target, draft, prompt, 2, temperature=1.0, generator=g, sampled_proposals="walk"
        ).tokens[1]
        seen[top.tolist().index(token) if token in top.tolist() else 7] += 1
    # the rest as p2's own total minus the top 7, so the expected counts sum to n exactly (chisquare checks it)
    expected = torch.cat([p2[top], (p2.sum() - p2[top].sum()).reshape(1)]) / p2.sum() * n
    assert chisquare(seen.numpy(), expected.numpy()).pvalue > 1e-3


# ---------------------------------------------------------------------------------------- the layout


def test_export_in_the_published_layout_and_import_back(tmp_path):
    draft = _dflash2(randomize=True)
    draft.save(tmp_path / "saved")
    raw = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert raw["dflash_config"] == {
        "block_size": BS,
        "conv_group_size": 8,
        "conv_kernel_size": 2,
        "final_logit_softcapping": None,
        "mask_token_id": MASK,
        "output_multiplier": 1.0,
        "selector_rank": 8,
        "selector_top_k": 4,
        "target_layer_ids": [1, 2],
    }
    loaded = DFlashDraftModel.load(tmp_path / "saved")
    assert loaded.config == draft.config and loaded.config.variant == "dflash2"
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in draft.state_dict().items())
    tensors = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    (tmp_path / "export").mkdir()
    write_serving_layout(tmp_path / "export", draft.config, tensors, "zlab", {})
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "export" / name).read_bytes() == (tmp_path / "saved" / name).read_bytes()
    assert draft_format(raw, None) == "zlab" and draft_format(raw, "speculators") == "speculators"


def test_published_configs_that_rescale_logits_or_lack_shapes_are_refused():
    raw = json.loads(json.dumps(_cfg(variant="dflash2", **SHAPES).to_zlab()))
    assert parse_draft_config(raw, "x").config.variant == "dflash2"
    raw["block_size"] = None  # published drafters keep it in dflash_config only
    assert parse_draft_config(raw, "x").config.block_size == BS
    for key, value in (("output_multiplier", 0.5), ("final_logit_softcapping", 30.0)):
        bad = json.loads(json.dumps(raw))
        bad["dflash_config"][key] = value
        with pytest.raises(ValueError, match="rescales the target's logits"):
            parse_draft_config(bad, "x")
    del raw["dflash_config"]["selector_rank"]
    with pytest.raises(ValueError, match="has no selector_rank"):
        parse_draft_config(raw, "x")


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_train_compile_compiles_the_drafts_layers_and_keeps_its_loss_and_gradients(target, variant):
    """`train.compile` reaches a DFlash draft (it once did nothing for one): its decoder layers are compiled in place,
    the state dict keeps its names, and a training step gives the eager loss and gradients."""
    from tasks.training.trainee import compile_layers

    ids = _rows(n=2, length=24, seed=3)
    ones = torch.ones_like(ids)
    results = []
    for compiled in (False, True):
        torch.manual_seed(1)
        draft = _dflash2(randomize=True) if variant == "dflash2" else DFlashDraftModel(_cfg())
        names = list(draft.state_dict())
        if compiled:
            assert compile_layers(draft) == len(draft.layers) > 0
            assert list(draft.state_dict()) == names
        built = _strategy(target, draft, draft_variant=variant)
        ctx = StepContext(model=draft, loss_fn=built.loss_fn, mask_token_id=MASK, step=0, base_seed=7)
        (batch,), n, _ = built.strategy.pre_step(ctx, [Microbatch(ids, ones.float(), ones, torch.arange(2))])
        out = built.strategy.forward_backward(ctx, batch, num_diffusion_tokens=n, num_ar_tokens=n, is_train=True)
        results.append((out.total_loss.item(), [p.grad.clone() for p in draft.parameters()]))
    (eager, g_eager), (comp, g_comp) = results
    assert comp == pytest.approx(eager, rel=1e-5)
    assert any(g.abs().sum() > 0 for g in g_eager)
    for a, b in zip(g_eager, g_comp):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # fused kernels round differently


def test_an_imported_draft_refuses_shape_options_that_differ_from_its_own(target, tiny_spec, tmp_path):
    """Shape options set explicitly for a pretrained DFlash 2 / Domino draft must be the draft's: one error that
    names the option and the draft's value; left unset, the draft's own shapes are used."""
    from strategies.options import validate_config
    from tasks.speculative.setup import import_draft

    torch.manual_seed(1)
    drafts = {"dflash2": _dflash2(), "domino": DFlashDraftModel(_cfg(variant="domino", gru_hidden_dim=6, emb_dim=5))}
    for variant, draft in drafts.items():
        draft.save(tmp_path / variant)
        raw = tiny_spec.model_dump(mode="json")
        raw["pipeline"]["strategies"] = ["dflash"]
        raw["model"].update(kind="pretrained", path=str(tmp_path / variant))
        spec = validate_config(raw)
        loaded = import_draft(spec, DFlashOptions(draft_variant=variant), target)  # unset: the draft's shapes
        assert loaded.config == draft.config
        same = {"selector_top_k": 4} if variant == "dflash2" else {"domino_emb_dim": 5}
        assert import_draft(spec, DFlashOptions(draft_variant=variant, **same), target).config == draft.config
        wrong, message = (
            ({"selector_top_k": 8}, "dflash.selector_top_k is 8 but the dflash2 draft at .* with selector_top_k 4: "
             "unset dflash.selector_top_k .* or set it to 4")
            if variant == "dflash2"
            else ({"domino_gru_hidden_dim": 7}, "dflash.domino_gru_hidden_dim is 7 but the domino draft at .* with "
                  "gru_hidden_dim 6: unset dflash.domino_gru_hidden_dim .* or set it to 6")
        )  # fmt: skip
        with pytest.raises(ValueError, match=message):
            import_draft(spec, DFlashOptions(draft_variant=variant, **wrong), target)
