"""Speculative decoding with a DFlash draft (docs/strategies.md §10.8): the draft proposes a block after each
anchor, the frozen target verifies it in one forward; greedy output equals target-only greedy decoding, sampled
output follows the target's distribution (the rejection step). Also the target-only greedy decoder it is checked
against and the batched sampler that regenerates training rows. Several branches per cycle: `strategies.dflash.tree`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from strategies.dflash.blocks import copy_hints
from strategies.dflash.config import DFlashDraftConfig
from strategies.dflash.dflash2_config import DSPARK, SAMPLED_DEFAULT, SERIAL, WALK
from strategies.dflash.domino import serial_walk
from strategies.dflash.draft import (
    DFlashDraftModel,
    draft_block_hidden,
    draft_block_logits,
    embed_and_head,
    target_features,
)
from strategies.dflash.dspark import CONFIDENCE_RULES, confident_length, dspark_walk
from strategies.dflash.tree import DraftTree, select_branch
from strategies.dflash.window import trim_context
from strategies.drawing import LOOKUP_MAX_NGRAM, draw


@dataclass
class SpeculativeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    acceptance: list[int]  # a_c + 1 per cycle
    target_forwards: int
    lookups: int = 0  # cycles whose first proposals came from the context lookup (`lookup_ngram`)
    verified: list[int] | None = None  # proposals the target verified per cycle (fewer than bs − 1 when cut by θ)
    confidences: list[list[float]] | None = None  # a DSpark draft's predicted acceptance of each verified proposal

    @property
    def verified_per_token(self) -> float:
        """Tokens through the target's verifying forwards (the anchor and the verified proposals, per cycle) per
        token committed: 1 when every verified proposal stands, up to bs when none does."""
        verified = self.verified or []
        return sum(v + 1 for v in verified) / max(sum(self.acceptance), 1)

    @property
    def tau(self) -> float:
        return sum(self.acceptance) / max(len(self.acceptance), 1)


def speculative_accept(
    target_probs: Tensor, draft_probs: Tensor, proposal: Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """The rejection step of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    `target_probs` [k+1, V]: the target's next-token distribution after the anchor and after each
    proposal; `draft_probs` [k, V]: the draft's; `proposal` [k] drawn from `draft_probs`. Proposal i
    stands with probability min(1, p_i(x_i)/q_i(x_i)); at the first rejection the next token is drawn
    from the residual max(0, p_i − q_i) (normalized), and when all stand a bonus token is drawn from
    p_k. Returns (proposals that stand, next token); the committed tokens follow the target's
    distribution exactly, whatever the draft."""
    k = proposal.shape[0]
    p, q, x = target_probs.float().cpu(), draft_probs.float().cpu(), proposal.cpu()
    u = torch.rand(k, generator=generator)
    for i in range(k):
        if u[i] * q[i, x[i]] < p[i, x[i]]:
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def context_lookup(history: list[int], min_ngram: int, count: int) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the longest suffix of `history`
    (from `LOOKUP_MAX_NGRAM` down to `min_ngram` tokens) inside `history`; [] when no suffix recurs.
    Prompt lookup (Saxena 2023) / n-gram speculation: text that repeats itself is proposed from itself."""
    for n in range(min(LOOKUP_MAX_NGRAM, len(history) - 1), min_ngram - 1, -1):
        suffix = history[-n:]
        for end in range(len(history) - 2, n - 2, -1):  # `end`: last index of an earlier occurrence
            if history[end - n + 1 : end + 1] == suffix:
                return history[end + 1 : end + 1 + count]
    return []


def _with_lookup(found: list[int], d_logits: Tensor, proposal: Tensor) -> tuple[Tensor, Tensor, bool]:
    """Proposals (and the distributions they were drawn from) with the context lookup's tokens `found` in front: a
    looked-up token is a draw from a point mass, so the rejection step stays exact (docs/strategies.md §10.8)."""
    if not found:
        return d_logits, proposal, False
    n = len(found)
    proposal, d_logits = proposal.clone(), d_logits.clone()
    proposal[:n] = torch.tensor(found, device=proposal.device)
    d_logits[:n] = float("-inf")
    d_logits[torch.arange(n, device=d_logits.device), proposal[:n]] = 0.0
    return d_logits, proposal, True


def sampled_from(cfg: DFlashDraftConfig, choice: str | None) -> str | None:
    """What a serial draft proposes from at T > 0: `choice` (`walk` or `backbone`), else its variant's default."""
    return choice or SAMPLED_DEFAULT.get(cfg.variant)


@torch.no_grad()
def speculative_generate(
    target: nn.Module,
    draft: DFlashDraftModel,
    prompt: list[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    lookup_ngram: int = 0,
    sampled_proposals: str | None = None,
    tree: DraftTree | None = None,
    confidence_threshold: float = 0.0,
    confidence_rule: str = "product",
) -> SpeculativeResult:
    """DFlash decoding (docs/strategies.md §10.8): the draft proposes after the anchor (`_propose`), the target verifies
    in one forward (`_verify`) and what stands plus its next token is committed. Greedy at temperature 0, speculative
    sampling above it. Options, none of which changes the output: `lookup_ngram` (§10.8), `sampled_proposals` (§10.13),
    `tree` (§10.16), `confidence_threshold` / `confidence_rule` (§10.17)."""
    cfg = draft.config
    if tree is not None:
        tree.check(cfg, temperature)
    check_threshold(cfg, confidence_threshold, tree, confidence_rule)
    bs, device = cfg.block_size, next(draft.parameters()).device
    ids = torch.tensor([prompt], device=device)
    feats, logits, cache = target_features(target, ids, cfg.target_layer_ids, past_key_values=_new_cache(target))
    out: list[int] = [int(draw(logits[:, -1], temperature, generator))]  # the prefill's token: the first anchor
    committed = len(prompt)  # tokens the target has processed (and whose features we hold)
    ctx, start = trim_context(cfg, feats, 0, committed)  # `start`: the position of ctx's first feature (§10.12)
    acceptance, forwards, lookups, verified, confidences = [], 1, 0, [], []
    drawing = (temperature, generator, (confidence_threshold, confidence_rule))
    while len(out) < max_new_tokens and not (eos_token_id is not None and out[-1] == eos_token_id):
        found = context_lookup(list(prompt) + out, lookup_ngram, bs - 1) if lookup_ngram else []
        trimmed = {"offset": start} if start else {}  # a windowed draft's context starts at `start`
        anchor = torch.tensor([[committed - start]], device=device)
        block, proposal, d_logits, conf = _propose(
            target, draft, (ctx, anchor, trimmed), list(prompt) + out, found, drawing, sampled_proposals
        )
        d_logits, proposal, looked_up = _with_lookup(found[: len(proposal)], d_logits, proposal)
        verified.append(len(proposal))
        confidences.extend([] if conf is None else [conf.tolist()])
        lookups += looked_up
        rows = proposal[None] if tree is None else tree.rows(target, ctx, anchor, block, proposal, d_logits, **trimmed)
        v_feats, cache, branch, accepted, nxt = _verify(target, cfg, cache, block, rows, d_logits, drawing[:2])
        forwards += 1
        new = rows[branch, :accepted].tolist() + [nxt]
        acceptance.append(accepted + 1)
        out.extend(new)
        # keep features/cache for the anchor and the accepted proposals; the bonus is the next anchor
        ctx = torch.cat([ctx, v_feats[branch : branch + 1, : accepted + 1]], dim=1)
        committed += accepted + 1
        ctx, start = trim_context(cfg, ctx, start, committed)
        surplus = cache.get_seq_length() - committed  # rejected proposals the target already cached
        if surplus > 0:
            cache.crop(-surplus)
        if eos_token_id is not None and eos_token_id in new:
            break
    tokens = _up_to_eos(out[:max_new_tokens], eos_token_id)
    return SpeculativeResult(tokens, acceptance, forwards, lookups, verified, confidences if confidences else None)


def check_threshold(cfg: DFlashDraftConfig, threshold: float, tree: DraftTree | None = None, rule="product") -> None:
    """Refuse a confidence threshold a draft cannot apply, naming what to change."""
    if rule not in CONFIDENCE_RULES:
        raise ValueError(f"the confidence rule must be one of {', '.join(CONFIDENCE_RULES)}; got {rule!r}")
    if not threshold:
        return
    if not 0 < threshold < 1:
        raise ValueError(f"the confidence threshold θ must be in (0, 1) (0: verify whole blocks); got {threshold}")
    if cfg.variant != DSPARK or not cfg.enable_confidence_head:
        raise ValueError(
            f"a confidence threshold cuts a block by a DSpark draft's confidence head, and this is a {cfg.variant} "
            "draft without one: drop the threshold (--confidence-threshold, dflash.eval_confidence_thresholds), or "
            "train a draft with dflash.draft_variant: dspark"
        )
    if tree is not None and tree.branches:
        raise ValueError("a confidence threshold and tree branches do not combine: the tree verifies whole blocks")


def _up_to_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    return tokens[: tokens.index(eos_token_id) + 1] if eos_token_id is not None and eos_token_id in tokens else tokens


def _propose(target, draft, at, history: list[int], found: list[int], drawing, sampled_proposals):
    """One cycle's proposal after the anchor (the history's last token; `at`: the context features, the anchor's
    position in them, a windowed draft's offset): the block, the proposed tokens (bs − 1, fewer when a DSpark draft's
    confidence cuts the block below θ), the distributions they were drawn from and (DSpark) their confidences. A
    DFlash 2 / Domino / DSpark draft walks serially after its backbone (sampled: its backbone's distribution unless it
    samples its walk, §10.13), after the looked-up tokens `found`, which lead the block; a copy-hint draft reads the
    history's copy hints."""
    (ctx, anchor, trimmed), (temperature, generator, threshold) = at, drawing
    cfg, device = draft.config, anchor.device
    bs = cfg.block_size
    block = torch.full((1, bs), cfg.mask_token_id, device=device)
    block[0, 0] = history[-1]
    keep = torch.ones_like(anchor, dtype=torch.bool)
    hints = None
    if cfg.copy_hint:  # the history's last token is the anchor
        seen = torch.tensor([history], device=device)
        hints = copy_hints(seen, torch.tensor([[seen.shape[1] - 1]], device=device), bs, cfg.mask_token_id)
    walks = cfg.variant in SERIAL and (temperature <= 0 or sampled_from(cfg, sampled_proposals) == WALK)
    if walks and cfg.variant == DSPARK:  # (its heads read the anchor position too)
        emb, head = embed_and_head(target)
        hidden = draft_block_hidden(draft, bs, emb, ctx, anchor, keep, block, **trimmed)[0]
        walk = dspark_walk(draft, hidden, head(hidden[1:]), history[-1], temperature, generator, found)
        proposal, d_logits, conf = walk
        k = confident_length(conf, *threshold)
        return block, proposal[:k], d_logits[:k], None if conf is None else conf[:k]
    if walks:
        emb, head = embed_and_head(target)  # (walked after the looked-up tokens, which lead the block)
        hidden = draft_block_hidden(draft, bs, emb, ctx, anchor, keep, block, **trimmed)[0, 1:]
        proposal, d_logits = serial_walk(draft, emb, hidden, head(hidden), history[-1], temperature, generator, found)
    else:
        d_logits = draft_block_logits(draft, target, ctx, anchor, keep, block, hints=hints, **trimmed)[0, 1:]
        proposal = draw(d_logits, temperature, generator)
    return block, proposal, d_logits, None


def _verify(target, cfg, cache, block, rows, d_logits, drawing):
    """The target's verification of every row (a tree's branches beside the proposal) in one forward: its features,
    its cache cut back to the chosen branch, the branch, how many proposals it accepted and its next token."""
    temperature, generator = drawing
    verify_in = torch.cat([block[:, :1].expand(len(rows), 1), rows], dim=1)  # anchor + bs − 1 proposals per row
    if len(rows) > 1:  # one copy of the target's cache per branch (an engine shares it under a tree mask)
        cache.batch_repeat_interleave(len(rows))
    v_feats, v_logits, cache = target_features(target, verify_in, cfg.target_layer_ids, past_key_values=cache)
    if temperature <= 0:  # the longest prefix equal to the target's greedy choices, over every row
        branch, accepted, nxt = select_branch(rows, v_logits)
    else:  # one row (a tree is greedy only): the rejection step of speculative sampling
        p = torch.softmax(v_logits[0].float() / temperature, dim=-1)
        q = torch.softmax(d_logits.float() / temperature, dim=-1)
        branch, (accepted, nxt) = 0, speculative_accept(p, q, rows[0], generator)
    if len(rows) > 1:
        cache.batch_select_indices(torch.tensor([branch], device=rows.device))
    return v_feats, cache, branch, accepted, nxt


def speculative_prompts(ids, attn, count: int, length: int) -> list[list[int]]:
    """Held-out prompts: the first `length` tokens of `count` validation rows spread over the split."""
    rows = [r for r in range(len(ids)) if int(attn[r].sum()) >= length + 1]
    if not rows:
        raise ValueError(f"no validation row has more than the prompt length={length} tokens; lower it")
    stride = max(len(rows) // count, 1)
    return [ids[r, :length].tolist() for r in rows[::stride][:count]]


@torch.no_grad()
def probe_tau(target, draft, ids, attn, count: int, length: int, max_new_tokens: int) -> float:
    """τ of greedy speculative decoding of `count` held-out prompts (`speculative_prompts`), `max_new_tokens` each:
    the train stage's `dflash/train_tau` (docs/evaluation.md §4.7.3)."""
    runs = [
        speculative_generate(target, draft, p, max_new_tokens) for p in speculative_prompts(ids, attn, count, length)
    ]
    cycles = [a for r in runs for a in r.acceptance]
    return sum(cycles) / max(len(cycles), 1)


def _new_cache(target: nn.Module):
    return DynamicCache(config=target.config)


@torch.no_grad()
def greedy_generate(
    target: nn.Module, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """Target-only greedy decoding with a KV cache (the reference DFlash must reproduce)."""
    device = next(target.parameters()).device
    cache = _new_cache(target)
    logits = target(input_ids=torch.tensor([prompt], device=device), cache=cache, use_cache=True).logits
    out = [int(logits[0, -1].argmax())]
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        logits = target(input_ids=torch.tensor([[out[-1]]], device=device), cache=cache, use_cache=True).logits
        out.append(int(logits[0, -1].argmax()))
    return out


@torch.no_grad()
def sample_continuations(
    target: nn.Module, prompts: Tensor, new_tokens: int, temperature: float, generator: torch.Generator | None = None
) -> Tensor:
    """`[B, P + new_tokens]`: each prompt row continued by the target, batched with one KV cache,
    sampled at `temperature` (greedy at 0) from `generator` only — so the same seed regenerates the
    same data (DFlash trains best on the target's own outputs, paper §5.1)."""
    cache = _new_cache(target)
    logits = target(input_ids=prompts, cache=cache, use_cache=True).logits[:, -1]
    out = [prompts]
    for i in range(new_tokens):
        nxt = draw(logits, temperature, generator)[:, None]
        out.append(nxt)
        if i + 1 < new_tokens:
            logits = target(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
    return torch.cat(out, dim=1)
