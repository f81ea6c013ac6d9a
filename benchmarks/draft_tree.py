"""Tree verification against the one-path decoder: same draft, same prompts, one run (docs/strategies.md §10.16).

For each K of `--branches`: τ of the one-path decoder (the baseline), of the tree with K branches continued by the
draft's own proposals (`marginal`), and, with `--redraft CKPT` (a draft for the same target trained with
`dflash.loss_type: variable_prefix`), of the tree whose branches that draft re-drafts behind their shown prefix
(`redraft`, D²SD's use of such a draft). Each against the baseline, paired over the prompts (bootstrap 95 %), with
the rows verified per target forward (what a tree-attention forward pays in width) and the decode time on this
machine, where the branches are a batch (an engine shares their prefix). Every output is checked equal to the
baseline's: greedy verification keeps the target's text.

    python benchmarks/draft_tree.py --draft CKPT [--redraft CKPT] --rows DIR [--branches 1 2 4] [--prompts 32]
        [--prompt-len 16] [--new-tokens 32] [--val-rows 32] [--lookup 0]

CKPT: a DFlash draft's checkpoint folder (its target is loaded from the path the checkpoint records); DIR: the rows
its evaluation read, the run's `prepare_data` store entry (with `--val-rows` = `eval.val_rows` and the `dflash.eval_*`
values, the prompts are the evaluation's own, so the one-path τ here is its `dflash/tau`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from strategies.dflash.decoding import speculative_generate
from strategies.dflash.tree import MARGINAL, REDRAFT, DraftTree
from tasks.evaluation.trained_model import load_for_generation, load_trained_model
from tasks.rows import load_split
from tasks.speculative.acceptance import speculative_prompts
from tasks.speculative.served import paired_bootstrap, ratio


def decode_all(target, draft, prompts, new_tokens, eos, lookup, tree=None) -> tuple[list, list[list[int]], float]:
    t0 = time.perf_counter()
    runs = [speculative_generate(target, draft, p, new_tokens, eos, lookup_ngram=lookup, tree=tree) for p in prompts]
    return [r.tokens for r in runs], [r.acceptance for r in runs], time.perf_counter() - t0


COLUMNS = (
    "tree",
    "K",
    "rows per forward",
    "τ",
    "Δτ vs one path [95 %]",
    "Δτ vs marginal, same K [95 %]",
    "τ ratio",
    "time ratio",
    "same text",
)


def interval(a: list[list[int]], b: list[list[int]], seed: int) -> str:
    """τ(b) − τ(a), paired over prompts, with its bootstrap 95 % interval."""
    d, lo, hi, _ = paired_bootstrap(a, b, seed)
    return f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", required=True, type=Path)
    ap.add_argument("--redraft", type=Path, default=None)
    ap.add_argument("--rows", required=True, type=Path)
    ap.add_argument("--branches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--val-rows", type=int, default=32)
    ap.add_argument("--lookup", type=int, default=0, help="the context lookup in front of the draft (lookup_ngram)")
    ap.add_argument("--seed", type=int, default=0, help="the bootstrap's")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    loaded = load_for_generation(args.draft, "cpu")
    target, draft, eos = loaded.strategy.target, loaded.model, loaded.tokenizer.eos_token_id
    redraft = load_trained_model(args.redraft, "cpu") if args.redraft else None
    ids, _, attn = (t[: args.val_rows] for t in load_split(args.rows, "val"))
    prompts = speculative_prompts(ids, attn, args.prompts, args.prompt_len)
    base_out, base_acc, base_s = decode_all(target, draft, prompts, args.new_tokens, eos, args.lookup)
    print(f"{len(prompts)} prompts × {args.new_tokens} tokens, block {draft.config.block_size}, lookup {args.lookup}")
    print(f"one path: τ {ratio(base_acc):.3f}, {base_s:.1f} s")
    print(f"| {' | '.join(COLUMNS)} |\n|{'---|' * len(COLUMNS)}")
    for k in args.branches:
        marginal = None
        for mode in (MARGINAL, REDRAFT) if redraft is not None else (MARGINAL,):
            tree = DraftTree(k, redraft if mode == REDRAFT else None)
            out, acc, seconds = decode_all(target, draft, prompts, args.new_tokens, eos, args.lookup, tree)
            vs_marginal = "–" if marginal is None else interval(marginal, acc, args.seed)
            marginal = acc if mode == MARGINAL else marginal
            same = sum(a == b for a, b in zip(out, base_out))
            vs_one = interval(base_acc, acc, args.seed)
            cells = [mode, k, f"≤ {k + 1}", f"{ratio(acc):.3f}", vs_one, vs_marginal]
            cells += [f"{ratio(acc) / ratio(base_acc):.3f}", f"{seconds / base_s:.2f}", f"{same}/{len(prompts)}"]
            print(f"| {' | '.join(map(str, cells))} |")
            if same != len(prompts):
                raise SystemExit("a tree decoder changed the greedy text: a bug (the output must be the target's)")


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    main()
