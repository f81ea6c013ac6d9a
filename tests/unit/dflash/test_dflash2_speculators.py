"""A DFlash 2 draft in the speculators layout (docs/strategies.md §10.11), the one vLLM reads: speculators 0.9.0's
own `DFlash2SpeculatorConfig` / `DFlash2DraftModel` load dllm-flow's export (every weight as dllm-flow holds it,
the verifier's embedding and head from the target's folder) and compute the same block hidden states, logits and
selector scores (≤ 1e-5, fp32); the folder imports back into dllm-flow."""

import json
import sys
from dataclasses import replace

import pytest
import torch
from stagekit import tiny_dflash_target, tiny_draft_config

from strategies.dflash.config import read_draft_config
from strategies.dflash.draft import DFlashDraftModel, draft_block_hidden, target_features
from strategies.dflash.serving_layout import write_serving_layout

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="the speculators package needs Python 3.11+")
BS = 4


def _draft() -> DFlashDraftModel:
    cfg = tiny_draft_config(variant="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4)
    torch.manual_seed(1)
    draft = DFlashDraftModel(cfg).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # off the identity: the convolutions and the selector do something
        for name, p in draft.named_parameters():
            if "conv" in name or "selector" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return draft


def test_speculators_loads_a_dflash2_export_and_computes_the_same_block(tmp_path):
    from speculators.models.attention import create_float_mask
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    target = tiny_dflash_target()
    verifier = tmp_path / "verifier"
    target.save_pretrained(verifier)
    draft, out = _draft(), tmp_path / "speculators"
    out.mkdir()
    tensors = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    write_serving_layout(out, draft.config, tensors, "speculators", {"path": str(verifier)})
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash2" and raw["architectures"] == ["DFlash2DraftModel"]
    assert raw["speculators_config"]["algorithm"] == "dflash2"
    assert (raw["conv_group_size"], raw["conv_kernel_size"], raw["selector_rank"], raw["selector_top_k"]) == (
        8,
        2,
        8,
        4,
    )
    # import back: the same draft (a speculators config does not record the target's layer count)
    read = read_draft_config(out)
    assert read == (replace(draft.config, num_target_layers=None), "speculators", str(verifier))
    assert all(torch.equal(DFlashDraftModel.load(out).state_dict()[k], v) for k, v in tensors.items())

    config = DFlash2SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"
    model = DFlash2DraftModel.from_pretrained(str(out), config=config).eval()
    model._attn_impl = "eager"  # its default flex attention needs torch.compile
    model._create_mask_fn = lambda *a, **kw: create_float_mask(*a, **kw, dtype=torch.float32)
    theirs = model.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in tensors.items())

    ids = torch.randint(0, 60, (1, 24), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[3, 9, 11, 12, 17]])
    docs = torch.zeros_like(ids)
    block = torch.full((1, anchors.shape[1] * BS), 63)
    block[0, ::BS] = ids[0, anchors[0]]
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, anchors[0]] = 1  # exactly these anchors (speculators draws every marked one, sorted)
    with torch.no_grad():
        feats, _, _ = target_features(target, ids, draft.config.target_layer_ids)
        keep = torch.ones_like(anchors, dtype=torch.bool)
        ours = draft_block_hidden(draft, BS, target.get_input_embeddings(), feats, anchors, keep, block, docs)
        hidden, logits, *_ = model._backbone_forward(
            hidden_states=feats,
            input_ids=ids,
            loss_mask=loss_mask,
            verifier_last_hidden_states=target(ids, output_hidden_states=True).hidden_states[-1],
            document_ids=docs,
            position_ids=torch.arange(24)[None],
            max_anchors=anchors.shape[1],
        )
        ours_logits = target.lm_head(ours)
        tokens = torch.stack([ids[0, anchors[0] + k] for k in range(BS)], dim=-1)  # the true block tokens
        before = torch.cat([tokens[:, :1], tokens[:, :-1]], dim=-1).reshape(1, -1)  # each position's predecessor
        candidates = logits.topk(4, dim=-1).indices
        their_scores = model.candidate_selector.score_candidates(logits, hidden, before, candidates)
        our_scores = draft.candidate_selector.scores(ours, ours_logits.gather(-1, candidates), candidates, before)
    assert (hidden - ours).abs().max() <= 1e-5
    assert (logits - ours_logits).abs().max() <= 1e-5
    assert (their_scores - our_scores).abs().max() <= 1e-5
