"""Several branches of one block verified in one target forward (docs/strategies.md §10.16), greedy only.

A block draft commits to one path: after its first wrong proposal the rest of the block is lost. A tree verifier
(DDTree, Ringel & Romano 2026, arXiv 2604.12989; D²SD, Zhang et al. 2026, arXiv 2606.04446) proposes a few
alternatives beside it and keeps the longest branch the target accepts. Here the branches are:

- the proposal itself (what the one-path decoder verifies), then
- at each of the `branches` positions where the draft's first wrong proposal most likely falls (`rejection_positions`),
  the proposal up to there, the draft's runner-up token at that position, and after it either the draft's own
  proposals (`marginal`: a one-pass draft's later guesses do not depend on the earlier ones; a DFlash 2 or Domino
  draft's walk does, so behind it they continue the original token, not the runner-up) or a second draft's,
  re-drafted behind that shown prefix (`redraft`). The second draft is one trained with `loss_type: variable_prefix`
  (§5.7), the regime D²SD trains its second drafter for: a block whose first tokens are shown.

Every branch is verified exactly (the target's greedy choice at each of its positions), so the output is the
target's greedy text whatever the branches; only the tokens per target forward move. In a serving engine the branches
share their prefix in one forward under a tree mask; here each branch is a row of one batched forward over a copy of
the target's cache, the same arithmetic per branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dllm_common.config.dflash import tree_branches_problem
from strategies.dflash.dflash2_config import SERIAL
from strategies.dflash.draft import DFlashDraftModel, draft_block_logits
from strategies.dflash.window import trims

MARGINAL, REDRAFT = "marginal", "redraft"
# what the second draft shares with the first: the target (width, layers, vocabulary), its features and the blocks
SAME_FIELDS = ("hidden_size", "vocab_size", "num_target_layers", "target_layer_ids", "block_size", "mask_token_id")


def rejection_positions(confidence: Tensor, count: int) -> list[int]:
    """The `count` positions where the draft's first wrong proposal most likely falls, likeliest first: position j
    scores r_j = Π_{i<j} c_i · (1 − c_j), c_i the draft's probability of its own proposal at i. Positions with
    r_j = 0 (the draft certain of its proposal there, as of a looked-up token) are never chosen."""
    c = confidence.double()
    before = torch.cat([c.new_ones(1), torch.cumprod(c, 0)[:-1]])
    r = before * (1 - c)
    order = sorted(range(len(c)), key=lambda j: (-float(r[j]), j))
    return [j for j in order if float(r[j]) > 0][:count]


def marginal_branches(proposal: Tensor, d_logits: Tensor, count: int) -> tuple[Tensor, list[int]]:
    """(`[1 + K, k]` rows, the K changed positions): the proposal, then per rejection position j the proposal with
    the draft's runner-up token at j (its most probable token other than the proposal's) and its proposals after j."""
    probs = torch.softmax(d_logits.float(), dim=-1)
    confidence = probs.gather(1, proposal[:, None])[:, 0]
    positions = rejection_positions(confidence, count)
    rows = [proposal]
    for j in positions:
        alternative = probs[j].clone()
        alternative[proposal[j]] = -1.0
        row = proposal.clone()
        row[j] = int(alternative.argmax())
        rows.append(row)
    return torch.stack(rows), positions


@dataclass(frozen=True)
class DraftTree:
    """What the decoder verifies each cycle beside the proposal: `branches` alternatives, continued by the draft's
    own proposals or re-drafted by `redraft` (a draft for the same target, block size, target layers and mask id)."""

    branches: int
    redraft: DFlashDraftModel | None = None

    def check(self, cfg, temperature: float) -> None:
        """Refuse what the tree cannot verify or the second draft cannot read, naming what to change."""
        if self.branches < 0:
            raise ValueError(f"tree branches must be ≥ 0 (0: the one-path decoder); got {self.branches}")
        # a draft imported with dflash.block_size 0 learns its block here
        problem = tree_branches_problem(self.branches, cfg.block_size, "tree branches", "the draft's")
        if problem:
            raise ValueError(f"{problem} (--tree-branches, dflash.eval_tree_branches)")
        if temperature > 0:
            raise ValueError(
                "tree verification (--tree-branches, dflash.eval_tree_branches) is greedy only: decode at temperature "
                f"0 (--temperature 0; got {temperature}), or drop the branches to sample (several branches would need "
                "a multi-draft rejection step this decoder does not implement)"
            )
        if self.redraft is None:
            return
        other = self.redraft.config
        for field in SAME_FIELDS:
            ours, theirs = getattr(cfg, field), getattr(other, field)  # (layer ids: lists, as the config keeps them)
            if ours != theirs:
                raise ValueError(
                    f"the re-drafting draft has {field} {theirs!r} where the proposing draft has {ours!r}: it must be "
                    "a draft for the same target, reading the same features and blocks; train it from the same "
                    "config with dflash.loss_type: variable_prefix"
                )
        if other.variant in SERIAL:
            raise ValueError(
                f"the re-drafting draft is a {other.variant} draft, which drafts serially: the tree re-drafts with one "
                "pass (its selector or chain would be ignored); give a dflash or jetspec draft"
            )
        if other.copy_hint:
            raise ValueError("a copy_hint draft cannot re-draft branches (it reads hints per anchor); use one without")
        if trims(cfg) and not (trims(other) and other.sliding_window <= cfg.sliding_window):
            raise ValueError(
                f"the proposing draft slides over {cfg.sliding_window} positions in every layer, so the decoder keeps "
                "only that much context, and the re-drafting draft would read further back; give one whose every "
                f"layer slides over at most {cfg.sliding_window}"
            )

    def rows(
        self, target: nn.Module, ctx: Tensor, anchor: Tensor, block: Tensor, proposal: Tensor, d_logits: Tensor, **kw
    ) -> Tensor:
        """`[1 + K, bs − 1]`: the proposal, then its branches (`marginal_branches`), re-drafted after their changed
        position when a second draft is given. `anchor`, `block`: the cycle's `[1, 1]` anchor index and `[1, bs]`
        block input; `kw`: the decoder's context offset."""
        rows, positions = marginal_branches(proposal, d_logits, self.branches)
        if self.redraft is None:
            return rows
        k = rows.shape[1]
        todo = [(i + 1, j) for i, j in enumerate(positions) if j < k - 1]  # a change at the last position ends it
        if not todo:
            return rows
        n = len(todo)
        shown = block.expand(n, -1).clone()
        for r, (i, j) in enumerate(todo):
            shown[r, 1 : j + 2] = rows[i, : j + 1]  # offsets 1 … j + 1 shown, the rest [MASK]
        keep = torch.ones((n, 1), dtype=torch.bool, device=block.device)
        contexts, anchors = ctx.expand(n, -1, -1), anchor.expand(n, -1)
        redrafted = draft_block_logits(self.redraft, target, contexts, anchors, keep, shown, **kw)[:, 1:].argmax(-1)
        for r, (i, j) in enumerate(todo):
            rows[i, j + 1 :] = redrafted[r, j + 1 :]
        return rows


def select_branch(rows: Tensor, target_logits: Tensor) -> tuple[int, int, int]:
    """(branch, proposals of it that stand, the target's next token) under greedy verification: per branch the
    longest prefix equal to the target's greedy choices along it; the longest wins, the earliest row on ties (so the
    proposal itself when no alternative does better)."""
    greedy = target_logits.argmax(-1)  # [rows, bs]
    stands = (rows == greedy[:, :-1]).long().cumprod(1).sum(1)
    best = int(stands.argmax())  # argmax returns the first maximum
    accepted = int(stands[best])
    return best, accepted, int(greedy[best, accepted])
