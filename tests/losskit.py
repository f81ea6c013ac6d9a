"""The loss contract's arguments from plain tensors, for tests that call a loss directly: a loss takes the logits, a
`CorruptedBatch` and the `TokenCounts`, plus the causal logits where the strategy has them
(`strategies.base.DiffusionLoss`)."""

from torch import Tensor

from strategies.base import CorruptedBatch

__all__ = ["corrupted"]


def corrupted(
    target: Tensor,
    noise: Tensor | None,
    p: Tensor | None,
    loss_mask: Tensor,
    *,
    noisy: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> CorruptedBatch:
    """The `CorruptedBatch` a loss reads: clean ids x = `target`, the corrupted positions `noise`, the levels `p`,
    the supervised positions `loss_mask`, the ids the model saw `noisy` (z; None where the loss reads none). No
    loss reads the attention mask: None unless a test gives one."""
    return CorruptedBatch(target, noisy, noise, p, loss_mask, attention_mask)
