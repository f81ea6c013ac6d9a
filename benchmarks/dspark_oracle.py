"""A trained DSpark draft against speculators' own `DSparkDraftModel` (docs/strategies.md §10.17): the checkpoint is
written in the speculators layout, loaded by the package, and both compute the block logits and confidences after
the true predecessors at every anchor of a few rows of the target's own greedy text, and the greedy proposals of a
block drafted alone after each anchor. Prints the largest differences and how many proposals agree, and the exported
config.json and weight names.

    python benchmarks/dspark_oracle.py CHECKPOINT [--rows 8] [--length 48] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strategies.dflash.decoding import sample_continuations  # noqa: E402
from strategies.dflash.draft import draft_block_hidden, target_features  # noqa: E402
from strategies.dflash.dspark import block_predecessors_all, dspark_walk, teacher_forced  # noqa: E402
from strategies.dflash.serving_layout import write_serving_layout  # noqa: E402
from tasks.evaluation.trained_model import load_for_generation  # noqa: E402
from tasks.speculative.speculators_check import load_theirs, their_block, their_walk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    draft, _, strat, mask, _ = load_for_generation(Path(args.checkpoint), "cpu")
    target, cfg, bs = strat.target, draft.config, draft.config.block_size
    if cfg.variant != "dspark":
        raise SystemExit(f"{args.checkpoint} holds a {cfg.variant} draft, not a DSpark one")
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, cfg.vocab_size, (args.rows, 4), generator=g)
    rows = sample_continuations(target, prompts, args.length - 4, temperature=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        out, verifier = Path(tmp) / "draft", Path(tmp) / "verifier"
        out.mkdir()
        # the verifier as transformers writes it (a target saved with tied weights under `lm_head.weight` only, as
        # the embedded default's is, has no `embed_tokens.weight` for speculators' verifier loader to find)
        target.save_pretrained(verifier)
        tensors = {k: v.detach().clone() for k, v in draft.state_dict().items()}
        write_serving_layout(out, cfg, tensors, "speculators", {"path": str(verifier)})
        raw = json.loads((out / "config.json").read_text())
        shown = {k: raw[k] for k in sorted(raw) if k not in ("transformer_layer_config", "speculators_config")}
        print("config.json (less transformer_layer_config):", json.dumps(shown, indent=1))
        print("speculators_config:", json.dumps(raw["speculators_config"]))
        print("weights:", ", ".join(f"{k} {list(v.shape)}" for k, v in sorted(tensors.items()) if "layers." not in k))
        model, info = load_theirs(out)
        missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
        print(f"speculators DSparkDraftModel: missing {missing}, unexpected {unexpected}")
        logit_diff = conf_diff = 0.0
        agree = total = blocks_equal = blocks = 0
        anchors = torch.arange(4, args.length - bs, max(1, (args.length - bs - 4) // 8))[None]
        emb = target.get_input_embeddings()
        with torch.no_grad():
            for r in range(args.rows):
                ids = rows[r : r + 1]
                feats, _, _ = target_features(target, ids, cfg.target_layer_ids)
                last = target(ids, output_hidden_states=True).hidden_states[-1]
                hidden, biased, confidence = their_block(model, ids, feats, last, anchors, bs)
                block = torch.full((1, anchors.shape[1] * bs), mask)
                block[0, ::bs] = ids[0, anchors[0]]
                keep = torch.ones_like(anchors, dtype=torch.bool)
                h = draft_block_hidden(draft, bs, emb, feats, anchors, keep, block).view(1, -1, bs, cfg.hidden_size)
                targets = torch.stack([ids[0, anchors[0] + k] for k in range(1, bs)], dim=-1).reshape(1, -1)
                heads = teacher_forced(draft, h, block_predecessors_all(block, targets, bs))
                ours = target.lm_head(h) + heads.bias
                logit_diff = max(logit_diff, float((biased[:, 1:] - ours[0, :, 1:]).abs().max()))
                conf_diff = max(conf_diff, float((confidence[:, 1:] - heads.confidence[0, :, 1:]).abs().max()))
                for i, a in enumerate(anchors[0].tolist()):
                    mine, _, _ = dspark_walk(draft, h[0, i], target.lm_head(h[0, i, 1:]), int(ids[0, a]), 0.0, None)
                    theirs = their_walk(model, hidden[i], int(ids[0, a]))
                    agree += sum(int(x == y) for x, y in zip(mine.tolist(), theirs))
                    total += len(theirs)
                    blocks_equal += int(mine.tolist() == theirs)
                    blocks += 1
    print(f"blocks compared: {blocks} ({args.rows} rows of the target's greedy text, {anchors.shape[1]} anchors each)")
    print(f"max |logit difference| (biased, proposed positions): {logit_diff:.3g}")
    print(f"max |confidence-logit difference|: {conf_diff:.3g}")
    print(f"greedy proposals equal: {agree}/{total} tokens, {blocks_equal}/{blocks} blocks")


if __name__ == "__main__":
    main()
