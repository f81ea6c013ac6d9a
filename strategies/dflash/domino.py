"""Domino (docs/strategies.md §10.15): the DFlash draft plus a small serial correction head. The backbone drafts the
block in one pass, so position k cannot see what was drafted before it; Domino runs a GRU over the tokens before
each position (the anchor, then the block's tokens) and adds `W₂·SiLU(W₁·[h_k ; g_k])` to position k's logits,
h_k the backbone's hidden state, g_k the GRU's state after the tokens before k.

Training is teacher-forced (the GRU reads the true tokens) and supervises both logits with a base-anchor curriculum,
`(1 − λ)·L(final) + λ·L(base)`, λ falling linearly from `lambda_start` to 0 over the first `decay_ratio` of the
steps, so the backbone learns first and the head takes over. Decoding walks the block once: position k's token is
drawn from its corrected logits, then fed to the GRU for position k + 1, and those logits are the proposal
distribution speculative sampling needs.

The maths is SpecForge's Domino (sgl-project/SpecForge#571) as NVIDIA NeMo Automodel trains it
(`nemo_automodel/components/speculative/dflash/domino_core.py`: `projector_type: domino`, `prefix_gru` a one-layer
bias-free GRU over the target's embeddings, `embed_proj` Linear → SiLU → Linear, both bias-free) and the
`speculators` main branch serves it (`DominoHead`); the weight names are theirs. One difference, on purpose: the
head's output layer starts at zero here, so a fresh Domino draft gives exactly the plain draft's logits (the
references start it at random, which adds noise to every logit before the head has learnt anything).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from strategies.dflash.dflash2_config import DFLASH2, DOMINO
from strategies.drawing import draw


def attach_domino_head(model: nn.Module, cfg) -> None:
    """Give the draft `model` its `prefix_gru` and `embed_proj` (top-level, as the references name them)."""
    h, g, e = cfg.hidden_size, cfg.gru_hidden_dim, cfg.emb_dim
    if cfg.vocab_size is None:
        raise ValueError("a Domino draft needs the target's vocabulary (vocab_size) for its correction head")
    model.prefix_gru = nn.GRU(h, g, num_layers=1, batch_first=True, bias=False)
    model.embed_proj = nn.Sequential(
        nn.Linear(h + g, e, bias=False), nn.SiLU(), nn.Linear(e, cfg.vocab_size, bias=False)
    )
    nn.init.zeros_(model.embed_proj[2].weight)


def lambda_base(step: int, total_steps: int | None, lambda_start: float, decay_ratio: float) -> float:
    """The weight of the backbone's own loss at `step` (0-based): `lambda_start` falling linearly to 0 over the first
    ⌊total_steps · decay_ratio⌋ steps (at least 1), then 0; 0 when the total is unknown (validation, evaluation)."""
    if not total_steps:
        return 0.0
    span = max(1, int(total_steps * decay_ratio))
    return max(0.0, min(1.0, lambda_start * (1.0 - min(step / span, 1.0))))


def prefix_states(model: nn.Module, previous: Tensor, embed: nn.Module, dtype: torch.dtype) -> Tensor:
    """`[B, N·(bs − 1), G]`: the GRU's state at each prediction of N blocks, run over each block's true tokens before
    it, `previous` `[B, N·(bs − 1)]` (the anchor, then the true tokens at offsets 1 … bs − 2), from zero per block."""
    b, t = previous.shape
    n = t // (model.config.block_size - 1)
    states, _ = model.prefix_gru(embed(previous).to(dtype).reshape(b * n, t // n, -1))
    return states.reshape(b, t, -1)


def correction(model: nn.Module, hidden: Tensor, states: Tensor) -> Tensor:
    """The head's logit correction `embed_proj([h ; g])` of hidden states and GRU states (any leading shape)."""
    return model.embed_proj(torch.cat([hidden, states.to(hidden.dtype)], dim=-1))


def corrected_logits(model: nn.Module, hidden: Tensor, base: Tensor, previous: Tensor, embed: nn.Module) -> Tensor:
    """Teacher-forced final logits `[B, N·(bs − 1), V]` of N blocks: `base` (the backbone's, at the predicted positions)
    plus the head's correction from `hidden` `[B, N·(bs − 1), H]` and the GRU states after each prediction's true
    predecessors `previous` (`prefix_states`)."""
    states = prefix_states(model, previous, embed, hidden.dtype)
    return base + correction(model, hidden, states).to(base.dtype)


def domino_walk(
    model: nn.Module,
    embed: nn.Module,
    hidden: Tensor,
    base: Tensor,
    anchor: int,
    temperature: float,
    generator: torch.Generator | None,
    forced: list[int] = (),
) -> tuple[Tensor, Tensor]:
    """One chain through a block (`hidden` `[T, H]`, `base` `[T, V]` of its T predicted positions): the GRU reads the
    anchor, then each token drawn; position t's token is the argmax of its corrected logits at temperature 0, else a
    draw from softmax(logits / temperature). Returns the tokens `[T]` and the corrected logits `[T, V]` they were
    drawn from (the proposal distribution of speculative sampling). `forced`: the chain's first tokens are these (the
    context lookup's), and the GRU reads them."""
    state, previous, path, rows = None, torch.tensor([[anchor]], device=base.device), [], []
    for t in range(base.shape[0]):
        out, state = model.prefix_gru(embed(previous).to(hidden.dtype), state)
        logits = base[t] + model.embed_proj(torch.cat([hidden[t], out[0, 0]], dim=-1)).to(base.dtype)
        pick = int(forced[t]) if t < len(forced) else int(draw(logits[None], temperature, generator)[0])
        rows.append(logits)
        path.append(pick)
        previous = torch.tensor([[pick]], device=base.device)
    return torch.tensor(path, device=base.device), torch.stack(rows)


def serial_walk(
    model: nn.Module, embed: nn.Module, hidden: Tensor, logits: Tensor, anchor: int, temperature, generator, forced=()
):
    """The decoder's block for a draft that drafts serially after its backbone: DFlash 2's selector path or Domino's
    corrected chain, with the distributions they drew from; `forced`: the tokens the path starts with (a lookup's),
    so what follows is walked after them."""
    variant = model.config.variant
    if variant == DFLASH2:
        return model.candidate_selector.walk(hidden, logits, anchor, temperature, generator, forced)
    if variant == DOMINO:
        return domino_walk(model, embed, hidden, logits, anchor, temperature, generator, forced)
    raise ValueError(f"a {variant} draft drafts its block in one pass")
