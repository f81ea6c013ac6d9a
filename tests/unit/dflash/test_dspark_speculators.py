"""A DSpark draft in the speculators layout (docs/strategies.md §10.17): speculators 0.9.0's own
`DSparkSpeculatorConfig` / `DSparkDraftModel` load dllm-flow's export of a trained draft with no missing and no
unexpected weight (the verifier's embedding, head and norm come from the target's folder) and compute the same block
logits after its Markov bias and the same confidences (≤ 1e-5, fp32) for every Markov head; walked greedily through
speculators' own heads (its `block_bias` over the block, one position at a time after the tokens picked so far), its
proposals are ours token for token; the folder imports back into dllm-flow as the same draft. speculators has no
decoding loop for DSpark, so the walk around its modules is ours (`tasks.speculative.speculators_check`); everything
it computes is its own."""

import json
import sys

import pytest
import torch
from dflashkit import MASK, trained_dspark
from stagekit import tiny_dflash_target

from strategies.dflash.config import read_draft_config
from strategies.dflash.draft import DFlashDraftModel, draft_block_hidden, target_features
from strategies.dflash.dspark import block_predecessors_all, dspark_walk, teacher_forced
from strategies.dflash.serving_layout import write_serving_layout
from tasks.speculative.speculators_check import load_theirs, their_block, their_walk

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="the speculators package needs Python 3.11+")
BS = 4


@pytest.fixture(scope="module")
def target():
    return tiny_dflash_target()


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_speculators_loads_a_trained_dspark_export_and_computes_the_same_block(target, tmp_path, head_type):
    draft, rows, _ = trained_dspark(target, head_type)
    verifier = tmp_path / "verifier"
    target.save_pretrained(verifier)
    out = tmp_path / "speculators"
    out.mkdir()
    tensors = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    write_serving_layout(out, draft.config, tensors, "speculators", {"path": str(verifier)})
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["architectures"] == ["DSparkSpeculator"]
    assert raw["speculators_config"]["algorithm"] == "dspark" and raw["sample_from_anchor"] is False
    assert (raw["markov_rank"], raw["markov_head_type"], raw["enable_confidence_head"]) == (8, head_type, True)
    assert raw["confidence_head_with_markov"] is True
    read = read_draft_config(out)  # import back: the same draft
    assert read.layout == "speculators" and read.config.variant == "dspark"
    assert read.config.markov_head_type == head_type
    back = DFlashDraftModel.load(out)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in tensors.items())

    model, info = load_theirs(out)
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    # what it does not read from the export is the verifier's, loaded from the target's folder
    assert not info["missing_keys"]  # (the verifier-owned weights are declared as loaded from the verifier)
    theirs = model.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in tensors.items())
    torch.testing.assert_close(theirs["embed_tokens.weight"], target.get_input_embeddings().weight)

    ids = rows[3:4, :24]
    anchors = torch.tensor([[3, 9, 11, 12, 17]])
    with torch.no_grad():
        feats, _, _ = target_features(target, ids, draft.config.target_layer_ids)
        last = target(ids, output_hidden_states=True).hidden_states[-1]
        blocks, biased, confidence = their_block(model, ids, feats, last, anchors, BS)
        block = torch.full((1, anchors.shape[1] * BS), MASK)
        block[0, ::BS] = ids[0, anchors[0]]
        keep = torch.ones_like(anchors, dtype=torch.bool)
        emb = target.get_input_embeddings()
        h = draft_block_hidden(draft, BS, emb, feats, anchors, keep, block).view(1, -1, BS, 32)
        targets = torch.stack([ids[0, anchors[0] + k] for k in range(1, BS)], dim=-1).reshape(1, -1)
        heads = teacher_forced(draft, h, block_predecessors_all(block, targets, BS))
        ours = target.lm_head(h) + heads.bias
        assert (blocks - h[0]).abs().max() <= 1e-5
        assert (biased[:, 1:] - ours[0, :, 1:]).abs().max() <= 1e-5  # the proposed positions' logits
        assert (confidence[:, 1:] - heads.confidence[0, :, 1:]).abs().max() <= 1e-5
        assert float((heads.bias[0, :, 1:]).abs().max()) > 0.05  # the trained head does move the logits
        for i, a in enumerate(anchors[0].tolist()):  # a block drafted alone after each anchor: the same proposals
            ours_walk, _, _ = dspark_walk(draft, h[0, i], target.lm_head(h[0, i, 1:]), int(ids[0, a]), 0.0, None)
            assert ours_walk.tolist() == their_walk(model, blocks[i], int(ids[0, a]))
