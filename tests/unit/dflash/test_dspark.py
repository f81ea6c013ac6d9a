"""DSpark (docs/strategies.md §10.17): the DFlash draft plus a Markov logit-bias head and a confidence head. The heads
against their formulas written out position by position (vanilla, gated, rnn), a fresh draft against the plain one,
the objective's TV and confidence terms by hand, training (the loss falls; decoding keeps the target's greedy text;
the walk's logits are the teacher-forced ones along its own path), confidence-scheduled verification (θ cuts blocks,
the output stays the target's) and the refusals. speculators' own DSpark is the oracle in test_dspark_speculators.py."""

import math

import pytest
import torch
from dflashkit import MASK, _loss, _strategy, second_token_pvalue, trained_dspark
from stagekit import tiny_dflash_target, tiny_draft_config

from dllm_common.config import ConfigError
from strategies import Microbatch
from strategies.dflash.config import parse_draft_config
from strategies.dflash.decoding import check_threshold, greedy_generate, speculative_generate
from strategies.dflash.draft import DFlashDraftModel, draft_block_hidden, embed_and_head
from strategies.dflash.dspark import (
    block_predecessors_all,
    confident_length,
    dspark_terms,
    dspark_walk,
    teacher_forced,
)
from strategies.dflash.loss import SoftLabels
from strategies.dflash.options import DFlashOptions

BS = 4


@pytest.fixture(scope="module")
def target():
    return tiny_dflash_target()


def _dspark(head_type="vanilla", seed=1, randomize=True, **changes) -> DFlashDraftModel:
    torch.manual_seed(seed)
    cfg = tiny_draft_config(variant="dspark", markov_rank=8, markov_head_type=head_type, **changes)
    draft = DFlashDraftModel(cfg).eval()
    if randomize:  # off the zero start of W2, so the bias changes the logits
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if "markov" in name or "confidence" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return draft


def _bias_by_hand(draft, hidden, prev):
    """The Markov bias at every position of `[N, bs]` blocks, one position at a time from the formulas of §10.17."""
    head = draft.markov_head
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    n, bs = prev.shape
    out = torch.zeros(n, bs, w2.shape[0])
    for i in range(n):
        s = torch.zeros(head.rank)
        for k in range(bs):
            e, h = w1[prev[i, k]], hidden[i, k]
            if head.head_type == "vanilla":
                f = e
            elif head.head_type == "gated":
                f = torch.sigmoid(head.gate_proj.weight @ torch.cat([h, e]) + head.gate_proj.bias) * e
            else:
                z = head.joint_proj.weight @ torch.cat([s, e, h]) + head.joint_proj.bias
                g, c, o = z[: head.rank], z[head.rank : 2 * head.rank], z[2 * head.rank :]
                g = torch.sigmoid(g)
                s = g * s + (1 - g) * torch.tanh(c)
                f = torch.tanh(o)
            out[i, k] = w2 @ f
    return out


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_the_heads_compute_their_formulas_position_by_position(head_type):
    draft = _dspark(head_type)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 3, BS, 32, generator=g)
    block_ids = torch.full((1, 3 * BS), MASK)
    block_ids[0, ::BS] = torch.tensor([5, 9, 11])
    targets = torch.randint(0, 60, (1, 3 * (BS - 1)), generator=g)
    prev = block_predecessors_all(block_ids, targets, BS)
    assert prev[0, 1].tolist() == [9, 9, *targets[0, 3:5].tolist()]  # anchor, anchor, then the true tokens
    with torch.no_grad():
        heads = teacher_forced(draft, hidden, prev)
        expected = _bias_by_hand(draft, hidden[0], prev[0])
        w1 = draft.markov_head.markov_w1.weight
        feats = torch.cat([hidden[0], w1[prev[0]]], dim=-1)
        conf = feats @ draft.confidence_head.proj.weight[0] + draft.confidence_head.proj.bias
    torch.testing.assert_close(heads.bias[0], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(heads.confidence[0], conf, rtol=1e-5, atol=1e-5)


def test_a_fresh_dspark_draft_proposes_what_the_plain_draft_proposes(target):
    """W2 starts at zero and the heads are built after the backbone: from one seed the backbone's weights are the
    plain draft's and the proposals (hence the whole speculative decode) are its."""
    torch.manual_seed(1)
    plain = DFlashDraftModel(tiny_draft_config()).eval()
    fresh = _dspark(randomize=False)
    assert all(torch.equal(p, fresh.state_dict()[k]) for k, p in plain.state_dict().items())
    for prompt in ([1, 2, 3], [5, 9, 9, 4, 2, 7]):
        a = speculative_generate(target, plain, prompt, 16)
        b = speculative_generate(target, fresh, prompt, 16)
        assert (a.tokens, a.acceptance) == (b.tokens, b.acceptance)


def test_the_tv_and_confidence_terms_by_hand():
    """Two predictions over 3 tokens: q = softmax(logits). Hard labels: overlap = q(label); soft labels: Σ min(p, q)
    over the target's top-k; TV = Σ w (1 − overlap) / n; BCE against the overlap (or 1[argmax = label])."""
    logits = torch.tensor([[[math.log(2), 0.0, 0.0], [0.0, math.log(3), 0.0]]])  # q = (.5 .25 .25), (.2 .6 .2)
    targets = torch.tensor([[0, 2]])
    conf = torch.tensor([[0.0, math.log(3)]])  # σ: 0.5, 0.75
    w = torch.tensor([[1.0, 0.5]])
    tv, bce = dspark_terms(logits, targets, None, conf, w, 2, "overlap")
    assert tv.item() == pytest.approx((1 * 0.5 + 0.5 * 0.8) / 2, abs=1e-6)

    def b(c, y):
        return -(y * math.log(c) + (1 - y) * math.log(1 - c))

    assert bce.item() == pytest.approx((b(0.5, 0.5) + 0.5 * b(0.75, 0.2)) / 2, abs=1e-6)
    _, greedy = dspark_terms(logits, targets, None, conf, w, 2, "greedy")  # argmax 0 = label; argmax 1 ≠ 2
    assert greedy.item() == pytest.approx((b(0.5, 1.0) + 0.5 * b(0.75, 0.0)) / 2, abs=1e-6)
    soft = SoftLabels(torch.tensor([[[0, 1], [1, 2]]]), torch.tensor([[[0.7, 0.3], [0.9, 0.1]]]))
    tv_soft, _ = dspark_terms(logits, targets, soft, conf, w, None, "overlap")
    assert tv_soft.item() == pytest.approx(1 * (1 - 0.5 - 0.25) + 0.5 * (1 - 0.6 - 0.1), abs=1e-6)


def test_the_strategy_adds_tv_and_confidence_to_the_block_loss(target):
    """Total = w_ce·(decay loss of the biased logits) + w_tv·TV + w_conf·BCE: with TV and confidence weighed 0 it is
    the block loss of the biased logits; each weight moves the total by its term."""
    draft = _dspark()
    ids = torch.randint(0, 60, (4, 24), generator=torch.Generator().manual_seed(3))
    mb = Microbatch(ids, torch.ones_like(ids, dtype=torch.float32), torch.ones_like(ids), torch.arange(4))
    base = {"draft_variant": "dspark", "dspark_markov_rank": 8, "loss_decay_gamma": 2.0}
    with torch.no_grad():
        parts = {}
        for name, cfg in {
            "ce": {"dspark_tv_weight": 0.0, "dspark_confidence_weight": 0.0},
            "ce_tv": {"dspark_confidence_weight": 0.0},
            "all": {},
            "scaled": {"dspark_ce_weight": 2.0, "dspark_tv_weight": 3.0, "dspark_confidence_weight": 0.5},
        }.items():
            out, batches = _loss(_strategy(target, draft, **base, **cfg), draft, mb)
            parts[name] = out.total_loss.item()
        e = batches[0].extras
        emb, head = embed_and_head(target)
        h = draft_block_hidden(draft, BS, emb, e.features, e.anchors, e.keep, e.block_ids)
        b, n = e.anchors.shape
        heads = teacher_forced(draft, h.view(b, n, BS, -1), block_predecessors_all(e.block_ids, e.targets, BS))
        logits = head(h.view(b, n, BS, -1)[:, :, 1:]) + heads.bias[:, :, 1:]
        logp = logits.reshape(b, -1, 64).log_softmax(-1)
        nll = -logp.gather(-1, e.targets[..., None]).squeeze(-1)
        w = torch.tensor([math.exp(-k / 2.0) for k in range(BS - 1)]).repeat(n)[None] * e.block_mask
        count = int(e.block_mask.sum())
        tv, bce = dspark_terms(logits.reshape(b, -1, 64), e.targets, None, heads.confidence[:, :, 1:].reshape(b, -1),
                               w, count, "overlap")  # fmt: skip
    assert parts["ce"] == pytest.approx(float((nll * w).sum()) / count, rel=1e-5)
    assert parts["ce_tv"] == pytest.approx(parts["ce"] + tv.item(), rel=1e-5)
    assert parts["all"] == pytest.approx(parts["ce_tv"] + bce.item(), rel=1e-5)
    assert parts["scaled"] == pytest.approx(2 * parts["ce"] + 3 * tv.item() + 0.5 * bce.item(), rel=1e-5)


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_dspark_trains_and_decodes_the_targets_greedy_text(target, head_type):
    """40 steps on the target's greedy text: the loss falls; decoding through the Markov chain gives the target's
    greedy tokens with proposals accepted; the walk's logits and confidences are the teacher-forced ones along the
    path it picked."""
    untrained, rows, built = trained_dspark(target, head_type, steps=0)
    mb = Microbatch(rows, torch.ones_like(rows, dtype=torch.float32), torch.ones_like(rows), torch.arange(len(rows)))
    before = _loss(built, untrained, mb, step=10_000)[0].total_loss.item()
    draft, _, built = trained_dspark(target, head_type)
    assert _loss(built, draft, mb, step=10_000)[0].total_loss.item() < 0.9 * before
    accepted = 0
    for prompt in ([1, 2, 3], [5, 9, 9, 4, 2, 7], rows[0, :6].tolist()):
        spec = speculative_generate(target, draft, prompt, max_new_tokens=20)
        assert spec.tokens == greedy_generate(target, prompt, 20)
        accepted += sum(spec.acceptance) - len(spec.acceptance)
    assert accepted > 0
    emb, head = embed_and_head(target)
    feats = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(4))
    block = torch.full((1, BS), MASK)
    block[0, 0] = 7
    with torch.no_grad():
        hidden = draft_block_hidden(
            draft, BS, emb, feats, torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.bool), block
        )
        path, logits, conf = dspark_walk(draft, hidden[0], head(hidden[0, 1:]), 7, 0.0, None)
        forced = teacher_forced(draft, hidden.view(1, 1, BS, -1), torch.tensor([[[7, 7, *path[:-1].tolist()]]]))
    torch.testing.assert_close(logits, head(hidden[0, 1:]) + forced.bias[0, 0, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conf, torch.sigmoid(forced.confidence[0, 0, 1:]), rtol=1e-5, atol=1e-5)
    assert path.tolist() == logits.argmax(-1).tolist()


def test_confidence_scheduled_verification_cuts_blocks_and_keeps_the_targets_text(target):
    draft, rows, _ = trained_dspark(target)
    conf = torch.tensor([0.9, 0.8, 0.3])  # running product 0.9, 0.72, 0.216
    assert [confident_length(conf, t) for t in (0.0, 0.5, 0.8, 0.95)] == [None, 2, 1, 1]
    # DeepSpec's rule: each position's own confidence, and a block may verify nothing
    assert [confident_length(conf, t, "position") for t in (0.0, 0.5, 0.85, 0.95, 0.2)] == [None, 2, 1, 0, 3]
    whole_verified = cut_verified = 0
    for prompt in ([1, 2, 3], rows[1, :5].tolist(), rows[2, :8].tolist()):
        whole = speculative_generate(target, draft, prompt, 24)
        cut = speculative_generate(target, draft, prompt, 24, confidence_threshold=0.6)
        assert cut.tokens == whole.tokens == greedy_generate(target, prompt, 24)
        assert all(1 <= v <= BS - 1 for v in cut.verified) and set(whole.verified) == {BS - 1}
        for c, v in zip(cut.confidences, cut.verified):  # every verified proposal but the first stands above θ
            assert len(c) == v and (v == 1 or math.prod(c) >= 0.6)
        whole_verified += sum(whole.verified)
        cut_verified += sum(cut.verified)
        none = speculative_generate(target, draft, prompt, 24, confidence_threshold=0.99, confidence_rule="position")
        assert none.tokens == whole.tokens and set(none.verified) == {0}  # every cycle a plain decoding step
        assert none.acceptance == [1] * len(none.acceptance)
    assert cut_verified < whole_verified


def test_what_is_refused(target):
    with pytest.raises(ValueError, match="confidence head"):
        check_threshold(tiny_draft_config(), 0.5)
    with pytest.raises(ValueError, match="must be one of product, position"):
        check_threshold(tiny_draft_config(variant="dspark", markov_rank=8), 0.5, rule="prefix")
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        check_threshold(tiny_draft_config(variant="dspark", markov_rank=8), 1.5)
    with pytest.raises(ValueError, match="dspark_confidence_head_with_markov: false"):
        DFlashOptions(draft_variant="dspark", dspark_markov_rank=0)
    DFlashOptions(draft_variant="dspark", dspark_markov_rank=0, dspark_confidence_head_with_markov=False)
    with pytest.raises(ValueError, match="loss_type decay or variable_prefix"):
        DFlashOptions(loss_type="dpace", draft_variant="dspark")
    with pytest.raises(ValueError, match="markov_rank > 0"):
        tiny_draft_config(variant="dspark", markov_rank=0)
    with pytest.raises(ValueError, match="markov_head_type"):
        tiny_draft_config(variant="dspark", markov_head_type="lstm")
    _ = ConfigError  # (the config-level refusal of dspark_* keys on another variant: test_dflash_option_bounds)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_the_zlab_config_round_trips(head_type):
    cfg = tiny_draft_config(variant="dspark", markov_rank=8, markov_head_type=head_type, enable_confidence_head=True)
    raw = cfg.to_zlab()
    assert raw["architectures"] == ["DSparkSpeculator"]
    assert raw["dflash_config"]["markov_head_type"] == head_type and raw["dflash_config"]["sample_from_anchor"] is False
    assert parse_draft_config(raw, "here").config == cfg
    raw["dflash_config"]["sample_from_anchor"] = True
    with pytest.raises(ValueError, match="sample_from_anchor true"):
        parse_draft_config(raw, "here")


def test_the_planner_counts_the_heads_and_their_flops():
    """`dllm-flow plan` traces the DSpark step itself: the trained parameters are the plain draft's plus both heads'
    (`dspark_parameters`), and the step counts more FLOPs (the bias's projection to the vocabulary, the TV term)."""
    from strategies.dflash.dspark import dspark_parameters
    from strategies.options import load_config
    from tasks.commands.plan import Cluster, plan_strategy

    cluster = Cluster(gpus=1, device="cuda", memory=None)
    plans = {}
    for variant in ("dflash", "dspark"):
        spec = load_config("configs/dflash.yaml", [f"dflash.draft_variant={variant}"], note=False)
        plans[variant] = plan_strategy(spec, "dflash", cluster, variants=False, sizing=False)
    cfg = tiny_draft_config(variant="dspark", hidden_size=128, vocab_size=2048, markov_rank=256)
    added = plans["dspark"].resident.trainable - plans["dflash"].resident.trainable
    assert added == dspark_parameters(cfg) == 2 * 2048 * 256 + 128 + 256 + 1
    assert plans["dspark"].flops_per_token > plans["dflash"].flops_per_token


@pytest.mark.parametrize(("theta", "rule"), [(0.0, "product"), (0.6, "product"), (0.6, "position")])
def test_speculative_sampling_through_the_markov_chain_matches_target_sampling(target, theta, rule):
    """T = 1, whole blocks and blocks cut by θ: the second generated token (the first the draft proposes, drawn from
    the Markov-biased logits) follows the target's own marginal (chi-square, 200 runs)."""
    assert second_token_pvalue(target, _dspark(), confidence_threshold=theta, confidence_rule=rule) > 1e-4
