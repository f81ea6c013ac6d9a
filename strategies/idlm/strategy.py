"""`idlm` strategy (docs/strategies.md §8.4): introspective diffusion, converting a causal LM into a dLLM.

Every supervised token of the noisy copy becomes [MASK]; the model runs once over `[x_t ‖ x_0]`
(length 2L, position ids repeated) under the I-DLM block mask, and `IDLMLoss` trains both halves
with the next-token shift. The clean half is an ordinary causal LM, so its NLL is exact
(`eval/ar_nll`). Generation uses plain causal attention: the absorbing sampler with logit shift 1 ("idlm", the
default), or introspective strided decoding ("isd", `strategies/idlm/sampling.py`), where each forward verifies
the previous proposals with the causal half and proposes `block_length` new ones with the noisy half; both, the
exact NLL and the introspective acceptance are the evaluator's (`strategies/idlm/evaluation.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from strategies.base import CorruptedBatch, DLLMStrategy, SetupContext, StepContext
from strategies.corruption import corrupt_all_masked
from strategies.idlm.loss import IDLMLoss
from strategies.idlm.options import SAMPLERS, IDLMOptions
from strategies.losses import DLLMLossOutput
from strategies.masks import create_idlm_sdpa_mask
from strategies.registration import StrategyOptions


class IDLMStrategy(DLLMStrategy):
    """`prepare_batch` keeps the base behaviour for the interface only: `forward_backward` builds the
    `[x_t ‖ x_0]` input itself."""

    name = "idlm"
    Options = IDLMOptions
    logit_shift = 1
    sampler_name = "absorbing_shift1"
    samplers = tuple(SAMPLERS)
    likelihoods = ("ar_nll",)

    @property
    def block_length(self) -> int:
        return self.options.block_length

    def create_loss_fn(self, dllm_cfg: StrategyOptions | dict | None = None) -> nn.Module:
        options = self.options if dllm_cfg is None else self.coerce_options(dllm_cfg)
        return IDLMLoss(clean_loss_weight=options.clean_loss_weight, auto_balance=options.auto_balance_clean_loss)

    def setup_extra(self, setup: SetupContext) -> int | None:
        config = getattr(setup.model, "config", None)
        if getattr(config, "_attn_implementation", None) == "flash_attention_2":
            raise ValueError(
                "I-DLM needs the block-diffusion attention mask; set the model's attn_implementation "
                "to 'sdpa' (FlashAttention-2 ignores 4D masks)."
            )
        if setup.mask_token_id is None:
            raise ValueError("I-DLM requires dllm.mask_token_id to be set explicitly.")
        vocab = getattr(config, "vocab_size", None)
        if vocab is not None and not 0 <= int(setup.mask_token_id) < vocab:
            raise ValueError(f"dllm.mask_token_id={setup.mask_token_id} is outside the model vocab (size {vocab}).")
        return int(setup.mask_token_id)

    def apply_corruption(
        self, input_ids, loss_mask, mask_token_id, *, eps, block_size, half_life_ratio, generator=None
    ):
        return corrupt_all_masked(input_ids, loss_mask, mask_token_id)

    def corrupt_at_level(self, clean_ids, loss_mask, mask_token_id, t, generator=None):
        raise NotImplementedError(
            "idlm's kernel has no noise level: it masks every supervised token of the noisy copy (corrupt_all_masked, "
            "docs/strategies.md §8.4), so there is no corruption at a level t below 1"
        )

    def joint_logits(self, model: nn.Module, noisy: Tensor, clean: Tensor, valid: Tensor) -> Tensor:
        """One forward over `[x_t ‖ x_0]` [B, 2L] with position ids `[0..L−1, 0..L−1]` → logits [B, 2L, V]."""
        length = clean.shape[1]
        positions = torch.arange(length, device=clean.device).repeat(2)[None, :].expand(clean.shape[0], -1)
        dtype = next(model.parameters()).dtype
        mask = create_idlm_sdpa_mask(length, self.block_length, valid, device=clean.device, dtype=dtype)
        out = model(
            input_ids=torch.cat([noisy, clean], dim=1), attention_mask=mask, position_ids=positions, use_cache=False
        )
        return out.logits

    def forward_backward(
        self, ctx: StepContext, batch: CorruptedBatch, *, num_diffusion_tokens: int, num_ar_tokens: int, is_train: bool
    ) -> DLLMLossOutput:
        valid = batch.attention_mask.bool()
        logits = self.joint_logits(ctx.model, batch.noisy_ids, batch.clean_ids, valid)
        out = ctx.loss_fn(
            logits,
            batch.clean_ids,
            batch.noise_mask,
            valid,
            seq_len=batch.clean_ids.shape[1],
            num_diffusion_tokens=num_diffusion_tokens,
        )
        if is_train:
            (out.total_loss * ctx.loss_scale).backward()
        return out
