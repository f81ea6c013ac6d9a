"""What the samplers share with the DFlash draft models: one token per row drawn from logits (`draw`) and the
longest suffix the context lookup matches (`LOOKUP_MAX_NGRAM`, which sizes a `copy_hint` draft's embedding).

It sits apart from `strategies.sampling` because the draft models are trained (their module is in every training
stage's key) while the rest of what samplers share is evaluation-only: editing a sampler re-runs evaluation and
never training (docs/architecture.md, "Stage keys"). `strategies.sampling` re-exports both names.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOOKUP_MAX_NGRAM = 4  # the longest suffix speculative decoding's context lookup matches (`lookup_ngram` ≤ it)


def draw(logits: Tensor, temperature: float, generator: torch.Generator | None = None) -> Tensor:
    """Tokens `[n]` from logits `[n, V]`: the argmax at temperature 0, else one draw per row from
    softmax(logits / temperature), on the CPU so that a seeded `generator` gives the same tokens on any device."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)
