"""DSpark (docs/strategies.md §10.17): the DFlash draft plus a low-rank **Markov head** and a **confidence head**.

The backbone drafts a block in one pass, so position k cannot see what was drafted before it. The Markov head adds a
logit bias that depends on the token before position k: `b_k = W₂·f(W₁[x_{k−1}], h_k)` with W₁ `[V, r]`, W₂ `[r → V]`
and f the identity (`vanilla`), a gate `σ(G·[h_k ; e]) ⊙ e` (`gated`), or a recurrent state carried along the block
(`rnn`: `s_k = g ⊙ s_{k−1} + (1 − g) ⊙ tanh(c)`, the output `tanh(o)`, with [g; c; o] = J·[s_{k−1} ; e ; h_k]). The
confidence head `c_k = σ(w·[h_k ; W₁[x_{k−1}]] + b)` predicts whether position k's proposal will be accepted given that
everything before it was, so `Π_{j≤k} c_j` predicts that the first k proposals all stand: a decoder cuts the block
where that product falls below θ (`strategies.dflash.decoding`, confidence-scheduled verification).

Training is teacher-forced (x_{k−1} is the true token): `w_ce·CE + w_tv·TV + w_conf·BCE`, each position weighed by the
block loss's decay weights; TV is the total-variation distance `1 − Σ_v min(p_v, q_v)` between the target's
distribution p (its top-k with `distill_top_k`, else the label as a point mass: a greedy target's distribution on
its own regenerated text) and the draft's q; the confidence's label is the acceptance the proposal gets, by default
the overlap `Σ_v min(p_v, q_v)` (what speculative sampling accepts), or `1[argmax q = label]` (what greedy
verification accepts).

The maths is DeepSeek's DSpark (DeepSpec, arXiv 2607.05147) as the `speculators` package (0.9.0,
`speculators.models.dspark`) implements it, whose weight names these are; its DSpark loads dllm-flow's export
(tests/unit/dflash/test_dspark_speculators.py). As there, the heads see every block position, the anchor's too (its
output is not a proposal): the anchor position's predecessor is the anchor itself, which also starts the `rnn` head's
state. Two differences, on purpose: W₂ starts at zero here, so a fresh DSpark draft drafts exactly what the plain draft
drafts (speculators starts it at random); and the anchor stays the target's own token (`sample_from_anchor: false`,
which speculators also runs): block position k proposes the token at k, as in every other DFlash draft here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from strategies.drawing import draw

CONFIDENCE_TARGETS = ("overlap", "greedy")


class MarkovHead(nn.Module):
    """The low-rank bias `W₂·f(W₁[x_prev], h)` (module and weight names speculators' `MarkovHead`'s)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, head_type: str):
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)  # a fresh head adds nothing: the plain draft's proposals
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def features(self, prev_emb: Tensor, hidden: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """`f` at one or more positions (`[..., r]`) and the recurrent state after them (`rnn`; else None).
        `state` is the `rnn` state before the position (None: zeros)."""
        if self.head_type == "vanilla":
            return prev_emb, None
        hidden = hidden.to(prev_emb.dtype)
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1))) * prev_emb, None
        state = prev_emb.new_zeros(prev_emb.shape) if state is None else state
        gate, cand, out = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1.0 - gate) * torch.tanh(cand)

    def block_bias(self, prev_emb: Tensor, hidden: Tensor) -> Tensor:
        """`[B, N, bs, V]`: the bias at every position of N blocks (`prev_emb` `[B, N, bs, r]`, `hidden` `[B, N, bs,
        H]`), the `rnn` state running from zero along each block."""
        if self.head_type != "rnn":
            return self.markov_w2(self.features(prev_emb, hidden, None)[0])
        outs, state = [], None
        for k in range(prev_emb.shape[2]):
            out, state = self.features(prev_emb[:, :, k], hidden[:, :, k], state)
            outs.append(out)
        return self.markov_w2(torch.stack(outs, dim=2))


class ConfidenceHead(nn.Module):
    """One logit per position (speculators' `ConfidenceHead`: `proj`, a linear map to a scalar)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(features).squeeze(-1)


def attach_dspark_heads(model: nn.Module, cfg) -> None:
    """Give the draft `model` its `markov_head` (rank > 0) and `confidence_head` (when enabled), after the backbone."""
    if cfg.vocab_size is None:
        raise ValueError("a DSpark draft needs the target's vocabulary (vocab_size) for its Markov head")
    h = cfg.hidden_size
    if cfg.markov_rank:
        model.markov_head = MarkovHead(cfg.vocab_size, h, cfg.markov_rank, cfg.markov_head_type)
    if cfg.enable_confidence_head:
        model.confidence_head = ConfidenceHead(h + (cfg.markov_rank if cfg.confidence_head_with_markov else 0))


def block_predecessors_all(block_ids: Tensor, targets: Tensor, block_size: int) -> Tensor:
    """`[B, N, bs]`: the token before every block position, teacher-forced: the anchor before the anchor position and
    before offset 1, the true token at offset k − 1 before offset k (`targets` `[B, N·(bs − 1)]`)."""
    bsz = targets.shape[0]
    anchors = block_ids.view(bsz, -1, block_size)[:, :, :1]
    truth = targets.view(bsz, -1, block_size - 1)[:, :, :-1]
    return torch.cat([anchors, anchors, truth], dim=2)


def _confidence_logits(model: nn.Module, hidden: Tensor, prev_emb: Tensor | None) -> Tensor | None:
    if not hasattr(model, "confidence_head"):
        return None
    with_markov = model.config.confidence_head_with_markov
    feats = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1) if with_markov else hidden
    return model.confidence_head(feats)


class DSparkBlock(NamedTuple):
    """A teacher-forced view of N blocks at every block position `[B, N, bs, ·]` (the anchor position included)."""

    bias: Tensor | None  # [B, N, bs, V] the Markov bias (None without a Markov head)
    confidence: Tensor | None  # [B, N, bs] the confidence logits (None without a confidence head)


def teacher_forced(model: nn.Module, hidden: Tensor, previous: Tensor) -> DSparkBlock:
    """The heads on N blocks' hidden states `hidden` `[B, N, bs, H]` after the true predecessors `previous` `[B, N,
    bs]` (`block_predecessors_all`)."""
    head = getattr(model, "markov_head", None)
    prev_emb = None if head is None else head.markov_w1(previous)
    bias = None if head is None else head.block_bias(prev_emb, hidden)
    return DSparkBlock(bias, _confidence_logits(model, hidden, prev_emb))


def dspark_walk(
    model: nn.Module,
    hidden: Tensor,
    base: Tensor,
    anchor: int,
    temperature: float,
    generator: torch.Generator | None,
    forced: list[int] = (),
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chain through a block: `hidden` `[bs, H]` every block position's hidden state (the anchor's first), `base`
    `[bs − 1, V]` the backbone's logits at the proposed positions. Position k's token is the argmax of `base_k + b_k`
    (b_k after the token picked at k − 1, the anchor before offset 1) at temperature 0, else a draw from their softmax
    at `temperature`. Returns the tokens `[bs − 1]`, the logits they were drawn from `[bs − 1, V]` and the confidences
    `[bs − 1]` (probabilities; None without a confidence head). `forced`: the chain's first tokens (a lookup's)."""
    head = getattr(model, "markov_head", None)
    device = base.device
    state, prev = None, torch.tensor(anchor, device=device)
    if head is not None and head.head_type == "rnn":  # the anchor position starts the state, as in training
        _, state = head.features(head.markov_w1(prev), hidden[0], None)
    path, rows, conf = [], [], []
    for t in range(base.shape[0]):
        h = hidden[t + 1]
        prev_emb = None if head is None else head.markov_w1(prev)
        logits = base[t]
        if head is not None:
            out, state = head.features(prev_emb, h, state)
            logits = logits + head.markov_w2(out).to(logits.dtype)
        c = _confidence_logits(model, h, prev_emb)
        if c is not None:
            conf.append(torch.sigmoid(c.float()))
        pick = int(forced[t]) if t < len(forced) else int(draw(logits[None], temperature, generator)[0])
        rows.append(logits)
        path.append(pick)
        prev = torch.tensor(pick, device=device)
    confidence = torch.stack(conf) if conf else None
    return torch.tensor(path, device=device), torch.stack(rows), confidence


CONFIDENCE_RULES = ("product", "position")


def confident_length(confidence: Tensor | None, threshold: float, rule: str = "product") -> int | None:
    """How many of a block's proposals to verify; None (all of them) at θ ≤ 0 or without a confidence head.
    `product` (dllm-flow's default): up to, not including, the first position where the running product of
    confidences (the predicted chance that every proposal so far stands) falls below θ, at least one. `position`
    (DeepSpec's rule): up to the first position whose own confidence falls below θ, possibly none (the cycle is then
    a plain decoding step)."""
    if confidence is None or threshold <= 0:
        return None
    if rule not in CONFIDENCE_RULES:
        raise ValueError(f"confidence rule {rule!r} is not one of {', '.join(CONFIDENCE_RULES)}")
    score = torch.cumprod(confidence.float(), dim=0) if rule == "product" else confidence.float()
    below = (score < threshold).nonzero()
    if not len(below):
        return len(confidence)
    return max(1, int(below[0, 0])) if rule == "product" else int(below[0, 0])


# ---------------------------------------------------------------------------------------- the objective


def overlap(logits: Tensor, targets: Tensor, soft) -> Tensor:
    """`Σ_v min(p_v, q_v)` per prediction: q = softmax(`logits`), p the target's top-k (`soft`, renormalized) or, with
    hard labels, a point mass on `targets` (then it is q(label))."""
    q = logits.float().softmax(dim=-1)
    if soft is None:
        return q.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return torch.minimum(soft.probs.float(), q.gather(-1, soft.ids.long())).sum(dim=-1)


def dspark_terms(
    logits: Tensor, targets: Tensor, soft, confidence: Tensor | None, weights: Tensor, num_tokens, how: str
) -> tuple[Tensor, Tensor]:
    """(Σ w·TV, Σ w·BCE) over the predictions `[B, T]`, each divided by `num_tokens` (None: sums): TV = 1 − overlap,
    BCE of the confidence logits against the acceptance the proposal gets (`how`: `overlap`, detached, or `greedy`,
    1[argmax = label]); `weights`: the block loss's position weights times its block mask."""
    both = overlap(logits, targets, soft)
    w = weights.float()
    tv = ((1.0 - both) * w).sum()
    bce = tv.new_zeros(())
    if confidence is not None:
        label = both.detach() if how == "overlap" else (logits.argmax(dim=-1) == targets).float()
        bce = (F.binary_cross_entropy_with_logits(confidence.float(), label, reduction="none") * w).sum()
    scale = max(int(num_tokens), 1) if num_tokens is not None else 1
    return tv / scale, bce / scale


def dspark_parameters(cfg) -> int:
    """Parameters DSpark adds to a DFlash draft of the same shape (both heads)."""
    r, h, v = cfg.markov_rank, cfg.hidden_size, cfg.vocab_size or 0
    markov = 0
    if r:
        markov = 2 * v * r + {"gated": (h + r) * r + r, "rnn": (2 * r + h) * 3 * r + 3 * r}.get(cfg.markov_head_type, 0)
    conf = (h + (r if cfg.confidence_head_with_markov else 0) + 1) if cfg.enable_confidence_head else 0
    return markov + conf
