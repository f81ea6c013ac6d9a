"""`hybrid` strategy (docs/strategies.md §8.3): diffusion + autoregressive training of one backbone
(Nemotron-Labs-Diffusion style).

The model gets the *clean* ids and the positions to corrupt (`masked_indices`); it substitutes
[MASK] itself and returns two logit streams: the diffusion branch (bidirectional over the masked
sequence) and the causal branch (left-to-right over the clean sequence). The loss is
α·L_diff + L_AR with the diffusion term normalized by the global *noise* count. The causal branch
gives an exact left-to-right NLL (`eval/ar_nll`); the diffusion branch an MDLM bound (`eval/nelbo`).
"""

from __future__ import annotations

from torch import Tensor, nn

from strategies.base import CorruptedBatch, DLLMStrategy, SetupContext, StepContext, TokenCounts
from strategies.corruption import corrupt_blockwise, corrupt_uniform
from strategies.hybrid.loss import HybridDiffusionLLMLoss
from strategies.hybrid.options import HYBRID, SAMPLERS, HybridOptions
from strategies.losses import DLLMLossOutput
from strategies.registration import StrategyOptions


class HybridStrategy(DLLMStrategy):
    name = "hybrid"
    Options = HybridOptions
    model_architecture = HYBRID
    sampler_name = "hybrid_ar_seeded_blocks"
    samplers = tuple(SAMPLERS)
    likelihoods = ("nelbo", "ar_nll")

    @property
    def normalization_mode(self) -> str:
        return "noise"

    def create_loss_fn(self, dllm_cfg: StrategyOptions | dict | None = None) -> nn.Module:
        options = self.options if dllm_cfg is None else self.coerce_options(dllm_cfg)
        return HybridDiffusionLLMLoss(alpha=options.ar_loss_alpha)

    def setup_extra(self, setup: SetupContext) -> int | None:
        """The model masks internally with the id it was built with (`wrap_for_architecture(...,
        mask_token_id=)`, kept in its config and checkpoint): it must be the one the strategy resolves."""
        if setup.mask_token_id is None:
            return None  # the trainer raises its "dllm.mask_token_id must be set" error
        built = getattr(getattr(setup.model, "config", None), "dllm_mask_token_id", None)
        if built is not None and int(built) != int(setup.mask_token_id):
            raise ValueError(
                f"the hybrid model masks with token id {built} but dllm.mask_token_id resolves to "
                f"{setup.mask_token_id}; rebuild the model with the same mask id"
            )
        return int(setup.mask_token_id)

    def apply_corruption(
        self, input_ids, loss_mask, mask_token_id, *, eps, block_size, half_life_ratio, generator=None
    ):
        if block_size is None:
            return corrupt_uniform(input_ids, loss_mask, mask_token_id, eps=eps, generator=generator)
        return corrupt_blockwise(
            input_ids,
            loss_mask,
            mask_token_id,
            block_size=block_size,
            eps=eps,
            half_life_ratio=half_life_ratio if half_life_ratio is not None else 0.25,
            generator=generator,
        )

    def prepare_batch(
        self, batch: dict[str, Tensor], noisy: Tensor, noise_mask: Tensor, clean: Tensor
    ) -> dict[str, Tensor]:
        out = self.without_attention_mask(batch)
        out.update(input_ids=clean, masked_indices=noise_mask, labels=clean, skip_loss=True)
        return out

    def forward_backward(
        self, ctx: StepContext, batch: CorruptedBatch, *, num_diffusion_tokens: int, num_ar_tokens: int, is_train: bool
    ) -> DLLMLossOutput:
        inputs = self.prepare_batch(
            {"attention_mask": batch.attention_mask}, batch.noisy_ids, batch.noise_mask, batch.clean_ids
        )
        out = ctx.model(**inputs)
        causal = getattr(out, "causal_logits", None)
        counts = TokenCounts(num_diffusion_tokens, num_ar_tokens if causal is not None else None)
        loss = ctx.loss_fn(out.logits, batch, counts, causal_logits=causal)  # the AR term supervises batch.loss_mask
        if is_train:
            (loss.total_loss * ctx.loss_scale).backward()
        return loss
