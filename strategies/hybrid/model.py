"""The hybrid's model shape (docs/strategies.md §8.3): one backbone, a diffusion branch and a causal branch."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from strategies.hybrid.options import HYBRID
from strategies.models import DLLMOutput, model_logits


class HybridLM(nn.Module):
    """Nemotron-Labs-Diffusion-shaped model on one backbone (docs/strategies.md §8.3).

    Takes the *clean* ids and the positions to corrupt (`masked_indices`); substitutes [MASK]
    internally, runs the backbone bidirectionally on the masked sequence (diffusion logits) and
    causally on the clean sequence (causal logits). The checkpoint is the backbone's own state dict
    plus `config.dllm_architecture = "hybrid"` and the mask id, so any HF causal LM can be the backbone.
    """

    def __init__(self, lm: nn.Module, mask_token_id: int | None = None):
        super().__init__()
        self.lm = lm
        self.config = lm.config
        self.config.dllm_architecture = HYBRID
        if mask_token_id is not None:
            self.config.dllm_mask_token_id = int(mask_token_id)

    @property
    def mask_token_id(self) -> int:
        mask_id = getattr(self.config, "dllm_mask_token_id", None)
        if mask_id is None:
            raise ValueError("HybridLM needs a mask token id: build it with wrap_for_architecture(..., mask_token_id=)")
        return int(mask_id)

    def diffusion_logits(self, noisy_ids: Tensor) -> Tensor:
        return model_logits(self.lm, {"input_ids": noisy_ids})

    def causal_logits(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def forward(
        self,
        input_ids: Tensor,
        masked_indices: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        skip_loss: bool = True,
        **_,
    ) -> DLLMOutput:
        if masked_indices is None:  # inference contract: ids already carry [MASK]
            return DLLMOutput(logits=self.diffusion_logits(input_ids))
        noisy = torch.where(masked_indices.bool(), torch.full_like(input_ids, self.mask_token_id), input_ids)
        return DLLMOutput(
            logits=self.diffusion_logits(noisy), causal_logits=self.causal_logits(input_ids, attention_mask)
        )
