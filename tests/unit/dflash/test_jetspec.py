"""JetSpec (docs/strategies.md §10.14): the DFlash draft with causal attention inside the block, trained by the forward
KL to the target's distribution. The loss against the reference's maths (`T² · KL(softmax(t/T) ‖ softmax(s/T))`,
uniform over the supervised predictions) computed here with torch's own `kl_div`, the mask against the causal
element-wise predicate, the options and the config.json round trip. The draft against z-lab's decoder:
tests/unit/dflash/test_dflash2_oracle.py."""

import pytest
import torch
import torch.nn.functional as F
from stagekit import tiny_draft_config

from strategies.dflash.blocks import create_dflash_sdpa_mask
from strategies.dflash.config import parse_draft_config
from strategies.dflash.loss import DFlashForwardKLLoss, SoftLabels, block_soft_labels, top_k_labels
from strategies.dflash.options import DFlashOptions
from strategies.dflash.window import draft_masks

V = 11


def _case(seed=0, b=2, n=3, bs=4):
    g = torch.Generator().manual_seed(seed)
    t = n * (bs - 1)
    student = torch.randn(b, t, V, generator=g) * 2
    teacher = torch.randn(b, t, V, generator=g) * 2
    targets = torch.randint(0, V, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    return student, teacher, targets, mask


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_the_forward_kl_over_the_whole_vocabulary_is_the_reference_objective(temperature):
    """k = V: the soft label is the target's whole distribution, and the loss is the reference's KDLoss: T² × the
    mean over supervised predictions of KL(p_T ‖ q_T) (here num_tokens = their count)."""
    student, teacher, targets, mask = _case()
    soft = top_k_labels(teacher, V)
    soft = SoftLabels(soft.ids, soft.probs / soft.probs.sum(-1, keepdim=True))
    count = int(mask.sum())
    loss = DFlashForwardKLLoss(temperature)(student, targets, mask, num_tokens=count, block_size=4, soft=soft)
    kl = F.kl_div(
        F.log_softmax(student / temperature, -1),
        F.log_softmax(teacher / temperature, -1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    reference = temperature**2 * kl[mask > 0].mean()
    torch.testing.assert_close(loss.total_loss, reference, rtol=1e-5, atol=1e-6)


def test_a_truncated_teacher_is_renormalized_over_its_top_k_and_the_fused_path_agrees():
    """k < V: the teacher is p^(1/T) renormalized over the target's top k (p: the full softmax); every supervised
    position weighs 1; chunked linear + loss (`forward_fused`) gives the same value and gradient."""
    student, teacher, targets, mask = _case(seed=1)
    k, temperature = 4, 2.0
    top = top_k_labels(teacher, k)
    soft = SoftLabels(top.ids, top.probs / top.probs.sum(-1, keepdim=True))
    loss = DFlashForwardKLLoss(temperature)(student, targets, mask, num_tokens=7, block_size=4, soft=soft)
    p = top.probs ** (1 / temperature)
    p = p / p.sum(-1, keepdim=True)
    logq = F.log_softmax(student / temperature, -1).gather(-1, top.ids.long())
    by_hand = (temperature**2 * (p * (p.log() - logq)).sum(-1) * mask).sum() / 7
    torch.testing.assert_close(loss.total_loss, by_hand, rtol=1e-5, atol=1e-6)

    hidden = torch.randn(2, 9, 5, generator=torch.Generator().manual_seed(2), requires_grad=True)
    head = torch.randn(V, 5, generator=torch.Generator().manual_seed(3))
    fn = DFlashForwardKLLoss(temperature, chunk_size=5)
    plain = fn(hidden @ head.T, targets, mask, num_tokens=7, block_size=4, soft=soft).total_loss
    (g_plain,) = torch.autograd.grad(plain, hidden)
    fused = fn.forward_fused(hidden, head, targets, mask, num_tokens=7, block_size=4, soft=soft).total_loss
    (g_fused,) = torch.autograd.grad(fused, hidden)
    torch.testing.assert_close(fused, plain)
    torch.testing.assert_close(g_fused, g_plain)


def test_the_loss_is_zero_when_the_draft_is_the_teacher_and_needs_a_teacher():
    """A draft whose logits are the target's own (k = V) has nothing left to learn; without soft labels the loss
    says what to set."""
    _, teacher, targets, mask = _case(seed=2)
    top = top_k_labels(teacher, V)
    anchors = torch.tensor([[0, 3, 6]] * 2)
    soft = block_soft_labels(SoftLabels(top.ids, top.probs), anchors * 0, 4, V)  # positions 0..2 of each row
    rows = teacher[:, :3].repeat(1, 3, 1)
    loss = DFlashForwardKLLoss(1.5)(rows, targets, mask, num_tokens=5, block_size=4, soft=soft)
    assert abs(float(loss.total_loss)) < 1e-5
    with pytest.raises(ValueError, match="set dflash.distill_top_k"):
        DFlashForwardKLLoss()(teacher, targets, mask, num_tokens=5, block_size=4)


def test_a_jetspec_draft_attends_causally_inside_its_block():
    """The mask a JetSpec draft's layers read is the causal DFlash mask (offset o sees offsets ≤ o of its block and
    the context before its anchor); a DFlash draft's, the bidirectional one."""
    anchors, keep = torch.tensor([[2, 7], [4, 9]]), torch.tensor([[True, True], [True, False]])
    jet = draft_masks(tiny_draft_config(variant="jetspec"), anchors, keep, 12, 4, torch.float32)
    plain = draft_masks(tiny_draft_config(), anchors, keep, 12, 4, torch.float32)
    assert torch.equal(jet, create_dflash_sdpa_mask(anchors, keep, 12, 4, causal=True))
    assert torch.equal(plain, create_dflash_sdpa_mask(anchors, keep, 12, 4, causal=False))
    noise = jet[0, 0, :, 12:].isfinite()  # [8 queries, 8 noise keys]
    for q in range(8):
        assert noise[q].nonzero().flatten().tolist() == list(range(q - q % 4, q + 1))


def test_the_jetspec_options_default_to_its_objective_and_refuse_what_does_not_fit():
    assert DFlashOptions(draft_variant="jetspec", distill_top_k=8).loss_type == "forward_kl"
    assert DFlashOptions(draft_variant="jetspec", loss_type="decay").loss_type == "decay"  # causal attention alone
    with pytest.raises(ValueError, match="set dflash.distill_top_k"):
        DFlashOptions(draft_variant="jetspec")
    with pytest.raises(ValueError, match="dflash2 trains with loss_type decay or variable_prefix, not forward_kl"):
        DFlashOptions(loss_type="forward_kl", distill_top_k=4, draft_variant="dflash2")
    with pytest.raises(ValueError, match="kd_temperature"):
        DFlashOptions(kd_temperature=0)


def test_a_jetspec_draft_is_written_with_is_causal_and_read_back():
    cfg = tiny_draft_config(variant="jetspec")
    raw = cfg.to_zlab()
    assert raw["is_causal"] is True and raw["architectures"] == ["DFlashDraftModel"]
    assert parse_draft_config(raw, "x").config == cfg
    assert tiny_draft_config().to_zlab()["is_causal"] is False
    with pytest.raises(ValueError, match="no speculators layout"):
        cfg.to_speculators("org/target", [])
    dflash2 = tiny_draft_config(variant="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4).to_zlab()
    with pytest.raises(ValueError, match="DFlash 2 draft with is_causal true"):
        parse_draft_config({**dflash2, "is_causal": True}, "x")


def test_a_speculators_config_that_says_causal_is_refused():
    """speculators and vLLM run DFlash layers bidirectionally inside the block: a speculators config whose layer
    config says `is_causal: true` would be served otherwise than it trains, so it is refused, not read as JetSpec."""
    raw = tiny_draft_config().to_speculators("org/target", [])
    raw["transformer_layer_config"]["is_causal"] = True
    with pytest.raises(ValueError, match="is_causal true, which speculators does not run"):
        parse_draft_config(raw, "x")
