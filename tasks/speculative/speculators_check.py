"""A DSpark export checked against speculators' own `DSparkDraftModel` (docs/strategies.md §10.17): the package loads
the folder `dllm-flow export --format speculators` wrote, and its backbone and heads compute the block logits,
confidences and greedy proposals dllm-flow's draft computes. speculators has DSpark's model but no decoding loop, so
the walk around its modules is written here (`their_walk`); everything else it computes is its own. Used by
tests/unit/dflash/test_dspark_speculators.py and `benchmarks/dspark_oracle.py` (a trained checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import torch


def load_theirs(folder: str | Path):
    """speculators' `DSparkDraftModel` from an exported folder (eager attention, fp32 masks: its default flex
    attention needs torch.compile), its verifier weights loaded from the target the config names, and the loading
    info (missing / unexpected / mismatched keys)."""
    from speculators.models.attention import create_float_mask
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    config = DSparkSpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    model, info = DSparkDraftModel.from_pretrained(str(folder), config=config, output_loading_info=True)
    model.load_verifier_weights()  # (its from_pretrained does this itself unless asked for the loading info)
    model._attn_impl = "eager"
    model._create_mask_fn = lambda *a, **kw: create_float_mask(*a, **kw, dtype=torch.float32)
    return model.eval(), info


def their_block(model, ids, feats, last_hidden, anchors, block_size: int):
    """speculators' backbone over the blocks at `anchors` `[1, N]` of row `ids` `[1, L]` ([anchor, MASK …]), then its
    heads after the true predecessors (sample_from_anchor false: position k after the token at k − 1, the anchor
    position after itself): hidden `[N, bs, H]`, biased logits `[N, bs, V]`, confidence logits `[N, bs]`."""
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, anchors[0]] = 1  # exactly these anchors (speculators draws every marked one, sorted)
    hidden, logits, _, _, idx = model._backbone_forward(
        hidden_states=feats,
        input_ids=ids,
        loss_mask=loss_mask,
        verifier_last_hidden_states=last_hidden,
        document_ids=torch.zeros_like(ids),
        position_ids=torch.arange(ids.shape[1], device=ids.device)[None],
        max_anchors=anchors.shape[1],
    )
    tokens = ids[0, idx].view(-1, block_size)
    prev = torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)
    blocks = hidden.view(-1, block_size, hidden.shape[-1])
    emb = model.markov_head.prev_embeddings(prev)
    bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=blocks, prev_emb=emb)
    biased = logits.view(-1, block_size, logits.shape[-1]) + bias
    confidence = model.confidence_head(torch.cat([blocks, emb], dim=-1))
    return blocks, biased, confidence


def their_walk(model, block_hidden, anchor: int) -> list[int]:
    """Greedy proposals of one block through speculators' modules (`block_hidden` `[bs, H]` from its backbone): its
    head's logits, and position k's bias from its `block_bias` over the block with the tokens picked so far as
    predecessors (a position's bias reads only the positions up to it)."""
    bs = block_hidden.shape[0]
    base = model.lm_head(block_hidden)
    prev = torch.full((1, bs), anchor, device=block_hidden.device)
    picks = []
    for k in range(1, bs):
        bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=block_hidden[None])
        pick = int((base[k] + bias[0, k]).argmax())
        picks.append(pick)
        if k + 1 < bs:
            prev[0, k + 1] = pick
    return picks
