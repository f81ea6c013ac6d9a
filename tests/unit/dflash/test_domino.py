"""Domino (docs/strategies.md §10.15): the DFlash draft plus a serial GRU correction head. Its maths against the
reference's on small inputs (NeMo Automodel's DominoTrainerModule, unshifted labels: the GRU reads each block's
anchor and true tokens, position k's state after the tokens before it, `embed_proj([h_k ; g_k])` added to the
backbone's logits, written out here on the reference's `[B, N, bs]` layout), the curriculum's weights by hand,
the strategy's mixed loss, decoding (target-greedy outputs, the walk's logits = the teacher-forced ones along its
own path, exact speculative sampling) and the config.json round trip. No package that runs Domino installs here
(z-lab's `dflash` 0.1.0 and speculators 0.9.0 have none), so no independent decoder is the oracle."""

import pytest
import torch
from dflashkit import second_token_pvalue
from stagekit import tiny_dflash_target, tiny_draft_config

from strategies import Microbatch, StepContext, assemble_strategy
from strategies.dflash.config import parse_draft_config
from strategies.dflash.decoding import greedy_generate, sample_continuations, speculative_generate
from strategies.dflash.dflash2 import block_predecessors
from strategies.dflash.domino import corrected_logits, domino_walk, lambda_base
from strategies.dflash.draft import DFlashDraftModel, draft_block_hidden, draft_block_logits, embed_and_head
from strategies.dflash.features import OnlineFeatures
from strategies.dflash.loss import DFlashDecayLoss
from strategies.dflash.options import DFlashOptions

MASK, V, BS = 63, 64, 4
SHAPES = {"variant": "domino", "gru_hidden_dim": 12, "emb_dim": 8}
OPTIONS = {"draft_variant": "domino", "domino_gru_hidden_dim": 12, "domino_emb_dim": 8}


@pytest.fixture(scope="module")
def target():
    return tiny_dflash_target()


def _domino(seed=1, randomize=True) -> DFlashDraftModel:
    torch.manual_seed(seed)
    draft = DFlashDraftModel(tiny_draft_config(**SHAPES)).eval()
    if randomize:  # off the zero start, so the head changes the logits
        with torch.no_grad():
            draft.embed_proj[2].weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed + 7))
    return draft


def _reference_final_logits(draft, embed, hidden4d, base4d, block_tokens):
    """NeMo Automodel's `_apply_domino_head` (unshifted labels, no pure-draft prefix) on its own layout: `block_tokens`
    `[B, N, bs]` the anchor and the true tokens, `hidden4d` / `base4d` every block position's; returns the logits of
    positions 1 … bs − 1."""
    b, n, bs = block_tokens.shape
    gru_in = embed(block_tokens)[:, :, : bs - 1, :].reshape(b * n, bs - 1, -1)
    gru_out, _ = draft.prefix_gru(gru_in)
    states = gru_out.reshape(b, n, bs - 1, -1)
    delta = draft.embed_proj(torch.cat([hidden4d[:, :, 1:, :], states], dim=-1))
    return base4d[:, :, 1:, :] + delta


def test_the_corrected_logits_are_the_references(target):
    draft = _domino()
    emb, head = embed_and_head(target)
    g = torch.Generator().manual_seed(0)
    b, n = 2, 3
    block_tokens = torch.randint(0, 60, (b, n, BS), generator=g)
    hidden4d = torch.randn(b, n, BS, 32, generator=g)
    base4d = head(hidden4d)
    with torch.no_grad():
        reference = _reference_final_logits(draft, emb, hidden4d, base4d, block_tokens)
        block_ids = block_tokens.clone()
        block_ids[:, :, 1:] = MASK  # dllm-flow's layout: [anchor, MASK …] blocks, targets the true tokens after
        targets = block_tokens[:, :, 1:].reshape(b, -1)
        previous = block_predecessors(block_ids.reshape(b, -1), targets, BS)
        pred = hidden4d[:, :, 1:].reshape(b, n * (BS - 1), -1)
        ours = corrected_logits(draft, pred, head(pred), previous, emb)
    torch.testing.assert_close(ours, reference.reshape(b, n * (BS - 1), V), rtol=1e-5, atol=1e-5)
    assert float((ours - head(pred)).abs().max()) > 0.1  # the head did change them


def test_a_fresh_domino_draft_gives_the_plain_drafts_logits(target):
    """The head's output layer starts at zero and is built after the backbone: from one seed a fresh Domino draft has
    the plain draft's weights and, through the head, its logits."""
    torch.manual_seed(1)
    plain = DFlashDraftModel(tiny_draft_config()).eval()
    fresh = _domino(randomize=False)
    assert all(torch.equal(p, fresh.state_dict()[k]) for k, p in plain.state_dict().items())
    emb, head = embed_and_head(target)
    feats = torch.randn(1, 6, 64)
    anchor, keep, block = torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.bool), torch.tensor([[7, MASK, MASK, MASK]])
    with torch.no_grad():
        h = draft_block_hidden(fresh, BS, emb, feats, anchor, keep, block)[0, 1:]
        _, walked = domino_walk(fresh, emb, h, head(h), 7, 0.0, None)
        torch.testing.assert_close(walked, draft_block_logits(plain, target, feats, anchor, keep, block)[0, 1:])


def test_the_curriculum_weight_by_hand():
    assert [lambda_base(s, 10, 1.0, 0.5) for s in (0, 1, 2, 4, 5, 9)] == pytest.approx([1.0, 0.8, 0.6, 0.2, 0.0, 0.0])
    assert lambda_base(3, 100, 0.5, 0.1) == pytest.approx(0.5 * (1 - 3 / 10))
    assert lambda_base(3, None, 1.0, 0.5) == 0.0  # total unknown: no curriculum


def _built(target, draft, **options):
    return assemble_strategy(
        "dflash",
        {"block_size": BS, "num_blocks_per_sample": 3, "loss_decay_gamma": 2.0} | OPTIONS | options,
        draft,
        None,
        mask_token_id=MASK,
        resources={"target": target, "features": OnlineFeatures(target, list(draft.config.target_layer_ids))},
    )


def test_the_strategy_mixes_the_final_and_backbone_losses_by_the_curriculum(target):
    """At step 2 of 10 (λ = 0.6): 0.4 × the decay loss of the corrected logits + 0.6 × the backbone's, both over the
    same blocks; in validation the corrected logits' alone. Through the checkpointed chunks of
    `use_fused_linear_ce` (5 rows a chunk) the value and the gradients are those of whole logits."""
    draft = _domino()
    ids = torch.randint(0, 60, (2, 24), generator=torch.Generator().manual_seed(3))
    ones = torch.ones_like(ids)
    mb = Microbatch(ids, ones.float(), ones, torch.arange(2))
    emb, head = embed_and_head(target)
    weights = [draft.embed_proj[2].weight, draft.prefix_gru.weight_ih_l0, draft.fc.weight]
    for training, weight in ((True, 0.6), (False, 0.0)):
        grads = []
        for fused in (True, False):
            built = _built(target, draft, use_fused_linear_ce=fused, ce_chunk_size=5)
            ctx = StepContext(
                model=draft, loss_fn=built.loss_fn, mask_token_id=MASK, step=2, base_seed=5, training=training,
                total_steps=10,
            )  # fmt: skip
            (batch,), n, _ = built.strategy.pre_step(ctx, [mb])
            out = built.strategy.forward_backward(ctx, batch, num_diffusion_tokens=n, num_ar_tokens=n, is_train=False)
            grads.append(torch.autograd.grad(out.total_loss, weights))
            with torch.no_grad():
                e = batch.extras
                h = draft_block_hidden(draft, BS, emb, e.features, e.anchors, e.keep, e.block_ids)
                b, nb = e.anchors.shape
                pred = h.view(b, nb, BS, -1)[:, :, 1:].reshape(b, nb * (BS - 1), -1)
                final = corrected_logits(draft, pred, head(pred), block_predecessors(e.block_ids, e.targets, BS), emb)
                loss = DFlashDecayLoss(2.0)
                expected = (1 - weight) * loss(final, e.targets, e.block_mask, num_tokens=n, block_size=BS).total_loss
                expected += weight * loss(head(pred), e.targets, e.block_mask, num_tokens=n, block_size=BS).total_loss
            torch.testing.assert_close(out.total_loss.detach(), expected)
        for fused_grad, whole_grad in zip(*grads):
            torch.testing.assert_close(fused_grad, whole_grad, rtol=1e-5, atol=1e-7)


def test_domino_trains_and_decodes_the_targets_greedy_text(target):
    """60 steps on the target's greedy text: the loss on fixed anchors falls; speculative decoding through the
    corrected chain gives the target's greedy tokens, and the walk's logits are the teacher-forced ones along the
    path it drew."""
    torch.manual_seed(0)
    draft = DFlashDraftModel(tiny_draft_config(**SHAPES))
    prompts = torch.randint(0, 60, (16, 4), generator=torch.Generator().manual_seed(1))
    rows = sample_continuations(target, prompts, 28, temperature=0.0)
    built = _built(target, draft)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    mb = Microbatch(rows, torch.ones_like(rows, dtype=torch.float32), torch.ones_like(rows), torch.arange(len(rows)))

    def step(i: int, train: bool) -> float:
        ctx = StepContext(model=draft, loss_fn=built.loss_fn, mask_token_id=MASK, step=i, base_seed=0, total_steps=60)
        ctx = ctx if train else StepContext(**{**ctx.__dict__, "training": False})
        (batch,), n, _ = built.strategy.pre_step(ctx, [mb])
        out = built.strategy.forward_backward(ctx, batch, num_diffusion_tokens=n, num_ar_tokens=n, is_train=train)
        return float(out.total_loss.detach())

    before = step(10_000, False)
    for i in range(60):
        step(i, True)
        opt.step()
        opt.zero_grad()
    assert step(10_000, False) < 0.9 * before
    draft.eval()
    accepted = 0
    for prompt in ([1, 2, 3], [5, 9, 9, 4, 2, 7], [3, 1, 4, 1, 5, 3, 1, 4]):
        spec = speculative_generate(target, draft, prompt, max_new_tokens=20)
        assert spec.tokens == greedy_generate(target, prompt, 20)
        accepted += sum(spec.acceptance) - len(spec.acceptance)
    assert accepted > 0
    emb, head = embed_and_head(target)
    feats = torch.randn(1, 6, 64)
    anchor, keep, block = torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.bool), torch.tensor([[7, MASK, MASK, MASK]])
    with torch.no_grad():
        h = draft_block_hidden(draft, BS, emb, feats, anchor, keep, block)[0, 1:]
        path, walked = domino_walk(draft, emb, h, head(h), 7, 0.8, torch.Generator().manual_seed(2))
        previous = torch.tensor([[7, *path[:-1].tolist()]])
        forced = corrected_logits(draft, h[None], head(h)[None], previous, emb)[0]
        # a chain that starts with the context lookup's tokens: they lead it and the GRU reads them
        led, led_rows = domino_walk(draft, emb, h, head(h), 7, 0.0, None, forced=[11, 12])
        after = corrected_logits(draft, h[None], head(h)[None], torch.tensor([[7, 11, 12]]), emb)[0]
    torch.testing.assert_close(walked, forced, rtol=1e-5, atol=1e-5)
    assert led[:2].tolist() == [11, 12] and int(led[2]) == int(after[2].argmax())
    torch.testing.assert_close(led_rows, after, rtol=1e-5, atol=1e-5)


def test_sampled_decoding_walks_the_chain_unless_the_backbone_is_asked_for(target):
    """At T > 0 a Domino draft samples its corrected chain by default (its backbone trains alone only during the
    curriculum; docs/strategies.md §10.13): the output moves with the head's weights. With
    `sampled_proposals="backbone"` it proposes from the backbone's one pass, and the head no longer matters."""
    prompts = [[1, 2, 3, 4], [5, 9, 2, 7, 1]]

    def run(draft, **kw):
        return [
            speculative_generate(
                target, draft, p, 12, temperature=1.0, generator=torch.Generator().manual_seed(i), **kw
            )
            for i, p in enumerate(prompts)
        ]

    def outcome(results):
        return [(r.tokens, r.acceptance) for r in results]

    a, b = _domino(seed=1), _domino(seed=1)
    with torch.no_grad():  # another head over the same backbone
        b.embed_proj[2].weight.normal_(0, 2.0, generator=torch.Generator().manual_seed(3))
    assert outcome(run(a)) != outcome(run(b))
    assert outcome(run(a)) == outcome(run(a, sampled_proposals="walk"))
    assert outcome(run(a, sampled_proposals="backbone")) == outcome(run(b, sampled_proposals="backbone"))


def test_speculative_sampling_through_the_chain_matches_target_sampling(target):
    """T = 1: the second generated token (the first the draft proposes, drawn from the corrected logits) follows the
    target's own marginal: chi-square over the target's 7 likeliest tokens and the rest, 200 runs."""
    assert second_token_pvalue(target, _domino()) > 1e-4


def test_a_domino_draft_is_written_in_automodels_layout_and_read_back(tmp_path):
    draft = _domino()
    raw = draft.config.to_zlab()
    assert raw["dflash_config"]["projector_type"] == "domino"
    assert (raw["dflash_config"]["gru_hidden_dim"], raw["dflash_config"]["emb_dim"]) == (12, 8)
    assert parse_draft_config(raw, "x").config == draft.config
    draft.save(tmp_path / "d")
    back = DFlashDraftModel.load(tmp_path / "d")
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in draft.state_dict().items())
    assert {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"} <= set(
        draft.state_dict()
    )
    with pytest.raises(ValueError, match="no speculators layout"):
        draft.config.to_speculators("org/target", [])
    for change, message in (
        ({"projector_type": "mlp"}, "projector_type 'mlp'"),
        ({"shift_label": True}, "shift_label"),
        ({"gru_hidden_dim": None}, "has no gru_hidden_dim"),
    ):
        dflash = {k: v for k, v in {**raw["dflash_config"], **change}.items() if v is not None}
        with pytest.raises(ValueError, match=message):
            parse_draft_config({**raw, "dflash_config": dflash}, "x")


def test_the_domino_options_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match="domino trains with loss_type decay or variable_prefix, not dpace"):
        DFlashOptions(loss_type="dpace", draft_variant="domino")
    with pytest.raises(ValueError, match="domino has no copy hint"):
        DFlashOptions(copy_hint=True, draft_variant="domino")


def test_the_config_names_a_stray_domino_or_kd_key_where_it_was_written():
    """A Domino or forward-KL key written for a draft or a loss it does nothing for is refused at config load, by the
    key as written; with the matching variant or loss type it is a resolved option."""
    import copy
    from pathlib import Path

    import yaml

    from dllm_common.config import ConfigError
    from strategies.options import validate_config

    raw = yaml.safe_load((Path(__file__).parents[3] / "configs/dflash.yaml").read_text())
    for key, value, message in (
        ("domino_emb_dim", 64, r"^dflash.domino_emb_dim shapes or trains a Domino draft"),
        ("kd_temperature", 0.5, r"^dflash.kd_temperature is the temperature of loss_type forward_kl"),
    ):
        stray = copy.deepcopy(raw)
        stray["dflash"][key] = value
        with pytest.raises(ConfigError, match=message):
            validate_config(stray)
    fits = copy.deepcopy(raw)
    fits["dflash"].update(draft_variant="domino", domino_emb_dim=64)
    validate_config(fits)
    fits = copy.deepcopy(raw)
    fits["dflash"].update(draft_variant="jetspec", distill_top_k=8, kd_temperature=0.5)
    validate_config(fits)
