"""A strategy's evaluation side: `DLLMEvaluator` (the hooks only evaluation, generation and post-training code
call) and the value its sampler takes (`SampleRequest`).

A strategy's training side is its class (`strategies/base.py`, `strategies/<name>/strategy.py`); what only
evaluation runs — its samplers, its likelihood rows, the denoiser the samplers decode with, its extra
evaluation metrics — is its evaluator (`strategies/<name>/evaluation.py`), named in its registration as
"module:Class" (`Registration.evaluator`; none named: this base class). The strategy instance still offers every
hook (`strategy.sample(model, request)`, `strategy.nelbo_rows(...)`, …) and hands each to its evaluator, which is
imported on the first call. So the training stages' keys never hold a sampler: editing one, or adding an
evaluation hook, re-runs evaluation and never training (docs/architecture.md, "Stage keys").

The base evaluator is MDLM's: the absorbing [MASK] sampler over the bidirectional denoiser, and the absorbing
bound over the strategy's own corruption at a level (`DLLMStrategy.corrupt_at_level`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from strategies.absorbing import absorbing_sample
from strategies.decoding_cache import bidirectional_denoiser
from strategies.losses import absorbing_nelbo_rows
from strategies.sampling import Progress, SamplerConfig, SampleResult

if TYPE_CHECKING:
    from strategies.base import DLLMStrategy


@dataclass(frozen=True)
class SampleRequest:
    """What one call of a sampler decodes: the prompts (token ids, one list per row), the [MASK] and padding ids,
    the sampler settings, the generator every draw comes from, the device, and `on_block(canvas)`, called after
    each finished block (streaming; None: not called). `mask_token_id` is the checkpoint's resolved id: None only
    for a strategy whose `uses_mask_token` is False, given none. The same request with a generator in the same
    state gives the same tokens."""

    prompts: list[list[int]]
    mask_token_id: int | None
    pad_token_id: int
    config: SamplerConfig
    generator: torch.Generator | None = None
    device: torch.device | str = "cpu"
    on_block: Progress | None = None

    def keywords(self) -> dict:
        """The request as the keyword arguments of a sampler function (`absorbing_sample(denoise, prompts, **…)`)."""
        return {
            "mask_token_id": self.mask_token_id,
            "pad_token_id": self.pad_token_id,
            "config": self.config,
            "generator": self.generator,
            "device": self.device,
            "on_block": self.on_block,
        }


class DLLMEvaluator:
    """The evaluation hooks of `strategy` (base = MDLM's); subclasses override the hooks that differ. Holds the
    strategy, whose options and training-side maths (its kernel at a level, its loss, its schedule) the hooks
    read."""

    def __init__(self, strategy: DLLMStrategy) -> None:
        self.strategy = strategy

    def sample(self, model: nn.Module, request: SampleRequest) -> SampleResult:
        """Continuations of `request.prompts` with the strategy's own sampler (here: the absorbing sampler over
        `denoiser`). `request.mask_token_id` is None only where `uses_mask_token` is False."""
        return absorbing_sample(self.denoiser(model), request.prompts, **request.keywords())

    def absorbing_sample(self, model: nn.Module, request: SampleRequest) -> SampleResult:
        """The absorbing [MASK] sampler over this strategy's denoiser (`--sampler llada`, the registration's
        `ABSORBING`), whatever its own sampler is."""
        return absorbing_sample(self.denoiser(model), request.prompts, **request.keywords())

    def nelbo_rows(
        self,
        model: nn.Module,
        clean_ids: Tensor,
        loss_mask: Tensor,
        mask_token_id: int | None,
        t: Tensor,
        generator: torch.Generator,
    ) -> Tensor:
        """One-sample NELBO estimate per row at masking level t [B] (read where `likelihoods` has "nelbo"): the
        absorbing bound (`strategies.losses.absorbing_nelbo_rows`) over `denoiser`, the rows corrupted by the
        strategy's own kernel at t (`corrupt_at_level`). `mask_token_id` is None only where `uses_mask_token`
        is False."""
        corrupt = self.strategy.corrupt_at_level
        return absorbing_nelbo_rows(self.denoiser(model), clean_ids, loss_mask, mask_token_id, t, generator, corrupt)

    def ar_nll_rows(
        self, model: nn.Module, clean_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Exact left-to-right NLL of the supervised tokens per row, (Σ nll, count), where `likelihoods` has
        "ar_nll"; a strategy without a causal path has none."""
        raise NotImplementedError(
            f"the {self.strategy.name} strategy has no exact causal likelihood ('ar_nll' is not among its "
            f"likelihoods {tuple(self.strategy.likelihoods)})"
        )

    def denoiser(self, model: nn.Module):
        """`(x [B,T], attention_mask [B,T]) → logits [B,T,V]` for the samplers (bidirectional by default)."""
        return bidirectional_denoiser(model)  # `model_logits`; cacheable (docs/decoding.md)

    def eval_metrics(self, model: nn.Module, rows: tuple[Tensor, Tensor, Tensor], batch_size: int) -> dict:
        """Strategy-specific evaluation metrics over the validation rows (ids, loss_mask, attention_mask);
        the evaluate stage adds them to the common ones. Default: none."""
        return {}

    def causal_logits(self, model: nn.Module):
        """`(x [B,T], attention_mask [B,T]) → logits [B,T,V]` whose row i − 1 predicts token i, for a strategy with
        an exact causal path (GRPO's `exact_ar` estimate); a strategy without one has none."""
        raise NotImplementedError(f"the {self.strategy.name} strategy has no exact causal path")
