"""`scdd` strategy (docs/strategies.md §8.2): self-correcting discrete diffusion on a masked-diffusion backbone.

Corruption mixes the absorbing [MASK] channel with a uniform "different token" channel at a grid
time t (the p_mask slot carries t); the loss is SCDD's discrete-time NELBO. The model sees noisy
ids with no attention mask, exactly like MDLM; with `time_conditioning` the backbone also reads t
(`strategies.models.add_time_conditioning`) in training, in the bound and in the sampler.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from strategies.base import CorruptedBatch, DLLMStrategy, SetupContext, StepContext
from strategies.corruption import corrupt_mix
from strategies.models import add_time_conditioning, time_input
from strategies.registration import StrategyOptions
from strategies.scdd.loss import SCDDLoss
from strategies.scdd.options import SAMPLERS, SCDDOptions
from strategies.scdd.schedule import scdd_grid_times, scdd_schedule


class SCDDStrategy(DLLMStrategy):
    name = "scdd"
    Options = SCDDOptions
    sampler_name = "scdd_ancestral"
    samplers = tuple(SAMPLERS)
    likelihoods = ("nelbo",)

    def __init__(self, options: SCDDOptions | dict | None = None) -> None:
        super().__init__(options)
        self.vocab_size: int | None = self.options.vocab_size
        # the loss also scores evaluation rows (the evaluator's `nelbo_rows`); an unresolved mask id is 0 until
        # assembled
        self.loss_fn: SCDDLoss | None = self.create_loss_fn(self.options) if self.vocab_size is not None else None

    def create_loss_fn(self, dllm_cfg: StrategyOptions | dict | None = None) -> nn.Module:
        options = self.options if dllm_cfg is None else self.coerce_options(dllm_cfg)
        if options.vocab_size is None:
            raise ValueError(
                "SCDDStrategy requires dllm.vocab_size (the model's vocabulary size; the uniform "
                "channel draws replacement tokens from it)"
            )
        mask = options.mask_token_id
        return SCDDLoss(
            0 if mask is None else int(mask),
            num_timesteps=options.num_timesteps,
            max_ratio=options.uniform_ratio,
            gamma_shape=options.schedule_shape,
            t_peak=options.schedule_peak,
            chunk_size=options.chunk_size,
            weighting=options.loss_weighting,
        )

    def setup_extra(self, setup: SetupContext) -> int | None:
        mask = setup.mask_token_id
        if mask is None:
            raise ValueError("SCDD requires dllm.mask_token_id, or a tokenizer that resolves a mask token.")
        vocab = getattr(getattr(setup.model, "config", None), "vocab_size", None)
        if vocab is not None:
            if not 0 <= int(mask) < vocab:
                raise ValueError(f"dllm.mask_token_id={mask} is outside the model vocab (size {vocab}).")
            if self.vocab_size != vocab:
                raise ValueError(f"dllm.vocab_size={self.vocab_size} does not match the model vocab ({vocab}).")
        if self.options.time_conditioning:  # in place, before the optimizer sees the parameters
            add_time_conditioning(setup.model)
        return int(mask)

    def _channel_probs(self, t: Tensor) -> tuple[Tensor, Tensor]:
        sched = self.schedule_at(t)
        k = self.vocab_size - 1
        # a uniform draw lands on the clean token with prob 1/K: only (K−1)/K goes to "a different token"
        return sched.absorbed_mass, sched.uniform_mass * (k - 1) / k

    def uniform_scale(self, ctx: StepContext) -> float:
        """The share of the uniform channel in a training step's input noise: ramps linearly from 0 to 1 over
        `uniform_warmup_steps` (docs/strategies.md §8.2); 1 in validation and once the warm-up is over."""
        warmup = self.options.uniform_warmup_steps
        return 1.0 if not ctx.training or warmup == 0 else min(1.0, ctx.step / warmup)

    def corruption_kwargs(self, ctx: StepContext) -> dict:
        return {**super().corruption_kwargs(ctx), "uniform_scale": self.uniform_scale(ctx)}

    def apply_corruption(
        self,
        input_ids,
        loss_mask,
        mask_token_id,
        *,
        eps,
        block_size,
        half_life_ratio,
        generator=None,
        uniform_scale: float = 1.0,
    ):
        """Grid time t, then `corrupt_mix` with the schedule's channel masses at t; `uniform_scale` < 1 (the
        warm-up) moves that part of the uniform channel's mass to the clean token."""
        if self.loss_fn is None:
            raise ValueError("SCDDStrategy needs dllm.vocab_size before corruption (set it, or assemble the strategy)")
        batch, length = input_ids.shape
        t = scdd_grid_times(batch, self.loss_fn.num_timesteps, eps, generator, input_ids.device)
        mask_prob, uniform_prob = self._channel_probs(t)
        uniform_prob = uniform_prob * uniform_scale
        noisy, noise = corrupt_mix(
            input_ids,
            loss_mask,
            mask_token_id,
            self.vocab_size,
            mask_prob=mask_prob,
            uniform_prob=uniform_prob,
            generator=generator,
        )
        return noisy, noise, t[:, None].expand(batch, length).to(torch.float32).contiguous()

    def forward_backward(
        self, ctx: StepContext, batch: CorruptedBatch, *, num_diffusion_tokens: int, num_ar_tokens: int, is_train: bool
    ):
        """The default step; a time-conditioned backbone reads each row's t (the p_mask slot)."""
        with time_input(ctx.model, batch.p_mask[:, 0]):
            return super().forward_backward(
                ctx, batch, num_diffusion_tokens=num_diffusion_tokens, num_ar_tokens=num_ar_tokens, is_train=is_train
            )

    def corrupt_at_level(self, clean_ids, loss_mask, mask_token_id, t, generator=None):
        """The mixed kernel at time t [B] (`corrupt_mix` with the schedule's channel masses at t, no warm-up):
        what training's kernel does at its grid times; the bound snaps t to the grid first."""
        if self.loss_fn is None:
            raise ValueError("SCDDStrategy needs dllm.vocab_size before corruption (set it, or assemble the strategy)")
        mask_prob, uniform_prob = self._channel_probs(t)
        return corrupt_mix(
            clean_ids,
            loss_mask,
            mask_token_id,
            self.vocab_size,
            mask_prob=mask_prob,
            uniform_prob=uniform_prob,
            generator=generator,
        )

    def schedule_at(self, t: Tensor):
        loss = self.loss_fn
        return scdd_schedule(t, max_ratio=loss.max_ratio, gamma_shape=loss.gamma_shape, t_peak=loss.t_peak)
