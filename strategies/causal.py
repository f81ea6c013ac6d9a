"""Plain next-token training of a causal LM, in the strategy interface so the one training loop runs it
(the DFlash target of the embedded default is trained this way). Not a dLLM strategy: not registered."""

from __future__ import annotations

import torch
from torch import nn

from strategies.base import CorruptedBatch, DLLMStrategy, Microbatch, StepContext
from strategies.losses import DLLMLossOutput, causal_nll_rows


class CausalLMObjective(DLLMStrategy):
    """Loss = Σ next-token NLL over supervised, non-padding positions ÷ their global count."""

    name = "causal"

    def create_loss_fn(self, dllm_cfg=None) -> nn.Module:
        return nn.Identity()  # the objective computes its loss in `forward_backward`

    @staticmethod
    def scored(loss_mask, attention_mask):
        return (loss_mask.bool() & attention_mask.bool())[:, 1:]

    def pre_step(self, ctx: StepContext, microbatches: list[Microbatch]) -> tuple[list[CorruptedBatch], int, int]:
        """No corruption: the clean rows, and the count of scored next-token positions."""
        batches, count = [], 0
        for mb in microbatches:
            none = torch.zeros_like(mb.loss_mask, dtype=torch.bool)
            batches.append(
                CorruptedBatch(mb.input_ids, mb.input_ids, none, mb.loss_mask, mb.loss_mask, mb.attention_mask)
            )
            count += int(self.scored(mb.loss_mask, mb.attention_mask).sum())
        return batches, count, count

    def forward_backward(
        self, ctx: StepContext, batch: CorruptedBatch, *, num_diffusion_tokens: int, num_ar_tokens: int, is_train: bool
    ) -> DLLMLossOutput:
        logits = ctx.model(input_ids=batch.clean_ids, attention_mask=batch.attention_mask).logits
        total, _ = causal_nll_rows(logits, batch.clean_ids, batch.loss_mask, batch.attention_mask)
        loss = total.sum() / torch.tensor(num_ar_tokens).clamp_min(1)  # int64 count, as a tensor
        if is_train:
            (loss * ctx.loss_scale).backward()
        return DLLMLossOutput(loss, loss)
