"""`scdd`'s evaluation hooks (docs/strategies.md §8.2, §11.5): the discrete-time bound at the training grid, the
ancestral sampler with the training schedule, and a denoiser that reads t where the backbone is time-conditioned.
Loaded only when evaluation calls a hook (`strategies/base_evaluation.py`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from strategies.base import CorruptedBatch, TokenCounts
from strategies.base_evaluation import DLLMEvaluator, SampleRequest
from strategies.models import model_logits, time_embedding
from strategies.sampling import SampleResult
from strategies.scdd.sampling import SCDDProcess, scdd_ancestral_sample


class SCDDEvaluator(DLLMEvaluator):
    def nelbo_rows(
        self,
        model: nn.Module,
        clean_ids: Tensor,
        loss_mask: Tensor,
        mask_token_id: int,
        t: Tensor,
        generator: torch.Generator,
    ) -> Tensor:
        """Per-row discrete-time NELBO term at t snapped to the training grid {1/T, …, (T−1)/T}, the rows
        corrupted by the strategy's kernel at that time (`SCDDStrategy.corrupt_at_level`)."""
        strategy = self.strategy
        steps = strategy.loss_fn.num_timesteps
        t = (torch.ceil(t * steps) / steps).clamp(1 / steps, 1 - 1 / steps)
        noisy, noise = strategy.corrupt_at_level(clean_ids, loss_mask, mask_token_id, t, generator)
        logits = model_logits(model, {"input_ids": noisy}, time=t)
        p = t[:, None].expand_as(clean_ids)
        bound = strategy.loss_fn.bound()  # the bound's weights whatever the training weighting
        # one row at a time, as `DiffusionLoss` reads it; the model saw every position (no attention mask above)
        fields = (clean_ids, noisy, noise, p, loss_mask, torch.ones_like(loss_mask))
        one = TokenCounts(diffusion=1)
        return torch.stack(
            [
                bound(logits[i : i + 1].float(), CorruptedBatch(*(f[i : i + 1] for f in fields)), one).total_loss
                for i in range(len(clean_ids))
            ]
        )

    def sample(self, model: nn.Module, request: SampleRequest) -> SampleResult:
        """Ancestral posterior sampling with the training schedule, then the noise-removal pass (§11.5)."""
        strategy = self.strategy
        if strategy.loss_fn is None:
            raise ValueError("SCDDStrategy needs dllm.vocab_size before sampling (the sampler uses its schedule)")
        timed = time_embedding(model) is not None
        denoise = (lambda x, attn, t: model_logits(model, {"input_ids": x}, time=t)) if timed else self.denoiser(model)
        process = SCDDProcess(
            vocab_size=strategy.vocab_size,
            schedule=strategy.schedule_at,
            eps=strategy.options.eps,
            time_input=timed,
            noise_removal=strategy.options.noise_removal,
            tempering=strategy.options.tempering,
        )
        return scdd_ancestral_sample(denoise, request, process)

    def denoiser(self, model: nn.Module):
        """The bidirectional denoiser (the absorbing sampler's, `--sampler llada`). A time-conditioned backbone
        reads each row's share of [MASK] among its attended positions as t (absorbed(t) ≈ t for the default
        schedule), and decodes uncached: the K/V caches run the backbone without the time input."""
        if time_embedding(model) is None:
            return super().denoiser(model)
        mask_token_id = self.strategy.options.mask_token_id

        def denoise(x: Tensor, attn: Tensor | None) -> Tensor:
            seen = torch.ones_like(x, dtype=torch.bool) if attn is None else attn.bool()
            masked = ((x == mask_token_id) & seen).sum(1)
            t = (masked.float() / seen.sum(1).clamp_min(1).float()).clamp(0, 1)
            return model_logits(model, {"input_ids": x}, time=t)

        return denoise
