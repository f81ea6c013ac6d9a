"""DFlash 2 (docs/strategies.md §10.11): the DFlash draft plus two cheap modules, both started at the identity so a
fresh DFlash 2 draft computes exactly the plain DFlash draft's logits.

- **In-block convolution.** Before and after the attention and the MLP of every layer, a two-tap depthwise
  convolution over block positions, `Conv(x)_t = k_{t,0}·x_t + k_{t,1}·x_{t−1}`: each tap is a learned base
  kernel (per channel) plus a correction predicted from the sublayer's input at position t, shared by the
  `conv_group_size` channels of a group. The taps never reach across a block: block position 0 (the anchor)
  reads zeros, so N blocks laid end to end in training convolve exactly as one block drafted alone.
- **Pairwise path selector.** Each predicted position keeps its `selector_top_k` candidates and scores candidate
  b after predecessor a as `S_t(a, b) = U_t(b) + ⟨A(a) ⊙ H(h_t), B(b)⟩`: U the draft's logit, A / B rank
  `selector_rank` predecessor / successor codebooks, H a projection of the draft's hidden state. Scoring is
  parallel; decoding walks the block once over the precomputed candidates, each step after the token it picked.

The maths follows the DFlash 2 blog (https://inco.ai/blog/dflash2/) as NVIDIA NeMo Automodel implements it
(`nemo_automodel/components/speculative/dflash/draft_qwen3_dflash2.py`, `dflash2_core.py`) and z-lab's `dflash`
package (0.1.0, `dflash.model.DFlash2DraftModel`), which loads the drafts dllm-flow exports
(tests/unit/dflash/test_dflash2_oracle.py). Weight names are the published drafters'.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from strategies.dflash.config import DFlashDraftConfig
from strategies.drawing import draw

CODEBOOK_STD = 0.02  # the reference's initializer_range for the predecessor codebook and the context gate

# ---------------------------------------------------------------------------------------- the convolution


class ZeroLinear(nn.Module):
    """A bias-free linear map whose weight starts at zero, drawing nothing from the random stream (so a DFlash 2
    draft's backbone is initialized exactly like the plain draft's from the same seed)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


def in_block_conv(x: Tensor, base: Tensor, dynamic: Tensor, group_size: int, block_size: int) -> Tensor:
    """`out_t = Σ_j (base_j + dynamic_{t,j}) ⊙ x_{t−j}` over the block positions of `x` `[B, N·bs, H]`, each block
    on its own (`x_{t−j}` is zero where t − j falls before the block's start). `base` `[K, H]`: tap j's kernel per
    channel; `dynamic` `[B, N·bs, K, G]`: position t's correction of tap j, one per group of `group_size`
    channels (channel c in group c // group_size)."""
    bsz, length, hidden = x.shape
    if length % block_size:
        raise ValueError(f"the in-block convolution needs whole blocks: {length} positions, block size {block_size}")
    groups, n = hidden // group_size, length // block_size
    blocks = x.view(bsz, n, block_size, groups, group_size)
    taps = dynamic.view(bsz, n, block_size, base.shape[0], groups, 1)
    out = torch.zeros_like(blocks)
    for j in range(base.shape[0]):
        shifted = blocks if j == 0 else F.pad(blocks[:, :, :-j], (0, 0, 0, 0, j, 0))  # position < j reads zeros
        out = out + (base[j].view(groups, group_size).to(x.dtype) + taps[:, :, :, j]) * shifted
    return out.view(bsz, length, hidden)


class InBlockConv(nn.Module):
    """The pair of convolutions around one sublayer (index 0 before it, 1 after it): `base_kernel` `[2, K, H]`
    (tap 0 = 1, the others 0: the identity) and `kernel_projection` `H → 2·K·G` (zero), which predicts both
    convolutions' corrections from the sublayer's input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = ZeroLinear(hidden_size, 2 * kernel_size * (hidden_size // group_size))

    def corrections(self, h: Tensor) -> Tensor:
        """`[B, T, 2, K, G]`: the per-position tap corrections of both convolutions, from the sublayer input."""
        return self.kernel_projection(h).view(*h.shape[:-1], 2, self.kernel_size, h.shape[-1] // self.group_size)

    def conv(self, x: Tensor, corrections: Tensor, which: int, block_size: int) -> Tensor:
        return in_block_conv(x, self.base_kernel[which], corrections[:, :, which], self.group_size, block_size)


def conv_sublayer(conv: InBlockConv, sublayer, h: Tensor, block_size: int, *args) -> Tensor:
    """`Conv_post(sublayer(Conv_pre(h), *args))`, both convolutions' corrections predicted from `h` (the normed
    sublayer input), as a DFlash 2 layer runs its attention and its MLP inside the residual branch."""
    k = conv.corrections(h)
    return conv.conv(sublayer(conv.conv(h, k, 0, block_size), *args), k, 1, block_size)


# ---------------------------------------------------------------------------------------- the selector


class CandidateSelector(nn.Module):
    """`S_t(a, b) = U_t(b) + ⟨A(a) ⊙ H(h_t), B(b)⟩` with A = `predecessor_codebook` `[V, R]`, B =
    `successor_codebook` `[V, R]` (zero: every score is the draft's own logit) and H = `hidden_projection`."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * CODEBOOK_STD)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=CODEBOOK_STD)

    def scores(self, hidden: Tensor, unary: Tensor, candidates: Tensor, predecessors: Tensor) -> Tensor:
        """`[..., k]` scores of `candidates` `[..., k]` (their logits `unary`) after `predecessors` `[...]`, with
        the draft's hidden states `hidden` `[..., H]` at the scored positions."""
        gate = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden)
        pairwise = (gate.unsqueeze(-2) * F.embedding(candidates, self.successor_codebook)).sum(-1)
        return unary + pairwise.to(unary.dtype)

    def walk(
        self,
        hidden: Tensor,
        logits: Tensor,
        anchor: int,
        temperature: float,
        generator: torch.Generator | None,
        forced: list[int] = (),
    ) -> tuple[Tensor, Tensor]:
        """One path through a block's candidates (`hidden` `[T, H]`, `logits` `[T, V]` of its T predicted
        positions), position t scored after the token picked at t − 1 (the anchor before position 0): the argmax
        at temperature 0, else a draw from softmax(S_t / temperature). Returns the path `[T]` and the
        distributions it was drawn from as logits `[T, V]`: the scores on the candidates, −inf elsewhere (the
        proposal distribution the rejection step of speculative sampling needs). `forced`: the first tokens of the
        path are these (the context lookup's), and the walk goes on after them."""
        unary, candidates = logits.topk(self.top_k, dim=-1)
        gate_h = self.hidden_projection(hidden)
        proposal_logits = torch.full_like(logits, float("-inf"))
        path, previous = [], torch.tensor(anchor, device=logits.device)
        for t in range(logits.shape[0]):
            gate = F.embedding(previous, self.predecessor_codebook) * gate_h[t]
            s = unary[t] + (F.embedding(candidates[t], self.successor_codebook) * gate).sum(-1).to(unary.dtype)
            proposal_logits[t, candidates[t]] = s
            if t < len(forced):
                previous = torch.tensor(forced[t], device=logits.device)
            else:
                previous = candidates[t, draw(s[None], temperature, generator)[0]]
            path.append(previous)
        return torch.stack(path), proposal_logits


# ---------------------------------------------------------------------------------------- the objective


class SelectorScores(NamedTuple):
    """The selector's teacher-forced view of every prediction `[B, T]` (T = N·(bs − 1)): its candidates' scores
    after the true predecessor `[B, T, k]`, the candidates, where the true token sits among them and whether it
    does."""

    scores: Tensor
    candidates: Tensor
    target_index: Tensor
    has_target: Tensor

    def picks(self) -> Tensor:
        """`[B, T]`: the selector's choice at every position (teacher-forced: after the true predecessor)."""
        return self.candidates.gather(-1, self.scores.argmax(-1, keepdim=True)).squeeze(-1)


def block_predecessors(block_ids: Tensor, targets: Tensor, block_size: int) -> Tensor:
    """`[B, N·(bs − 1)]`: the true token before each prediction: the anchor's before offset 1, the true token at
    offset k − 1 before offset k (`block_ids` `[B, N·bs]` hold the anchor tokens; `targets` the true tokens)."""
    bsz = targets.shape[0]
    anchors = block_ids.view(bsz, -1, block_size)[:, :, :1]
    return torch.cat([anchors, targets.view(bsz, -1, block_size - 1)[:, :, :-1]], dim=2).reshape(bsz, -1)


def selector_scores(
    selector: CandidateSelector,
    hidden: Tensor,
    head: nn.Module,
    predecessors: Tensor,
    targets: Tensor,
    chunk_size: int = 1024,
) -> SelectorScores:
    """Each prediction's top-k candidates under the target's head (their logits keep their gradient; chunks of
    `chunk_size` rows under activation checkpointing, so the `[B·T, V]` logits never stay alive) scored after
    its true predecessor. `hidden` `[B, T, H]`: the draft's hidden states of the predictions."""
    weight, bias, k = head.weight, getattr(head, "bias", None), selector.top_k

    def top(h):
        return F.linear(h, weight, bias).topk(k, dim=-1)

    flat = hidden.flatten(0, 1)
    parts = [checkpoint(top, flat[i : i + chunk_size], use_reentrant=False) for i in range(0, len(flat), chunk_size)]
    unary = torch.cat([p[0] for p in parts]).view(*hidden.shape[:2], k)
    candidates = torch.cat([p[1] for p in parts]).view(*hidden.shape[:2], k)
    scores = selector.scores(hidden, unary, candidates, predecessors)
    found = candidates == targets.unsqueeze(-1)
    return SelectorScores(scores, candidates, found.long().argmax(-1), found.any(-1))


def selector_loss(sel: SelectorScores, weights: Tensor, num_tokens: int | None) -> Tensor:
    """`Σ w_t · CE(S_t, index of the true token) / num_tokens` over the predictions whose true token is among the
    candidates (a miss leaves nothing to select and is left out, as in the reference); `weights` `[B, T]`: the
    block loss's position weights times its block mask, so a position counts the same in both terms."""
    ce = F.cross_entropy(sel.scores.flatten(0, 1).float(), sel.target_index.flatten(), reduction="none")
    w = weights.float() * sel.has_target.float()
    total = (ce.view_as(w) * w).sum()
    return total / max(int(num_tokens), 1) if num_tokens is not None else total


def candidate_recall(sel: SelectorScores, block_mask: Tensor) -> tuple[float, float]:
    """(Σ supervised predictions whose true token is among the candidates, Σ supervised predictions): the ceiling
    the selector can reach (`dflash/candidate_recall` is their ratio)."""
    m = block_mask.float()
    return float((sel.has_target.float() * m).sum()), float(m.sum())


def per_offset_correct(correct: Tensor, block_mask: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Per-offset sums `[bs − 1]` of `correct` and of the block mask (the training loop's `draft_acc_k*`)."""
    shape = (correct.shape[0], -1, block_size - 1)
    m = block_mask.float().reshape(shape)
    return (correct.float().reshape(shape) * m).sum(dim=(0, 1)), m.sum(dim=(0, 1))


def dflash2_parameters(cfg: DFlashDraftConfig) -> int:
    """Parameters DFlash 2 adds to a DFlash draft of the same shape (the convolutions and the selector)."""
    groups = cfg.hidden_size // cfg.conv_group_size
    conv = 2 * cfg.conv_kernel_size * (cfg.hidden_size + cfg.hidden_size * groups)
    return 2 * cfg.num_hidden_layers * conv + cfg.selector_rank * (2 * cfg.vocab_size + cfg.hidden_size)
