"""`block_diffusion`'s evaluation hooks (docs/strategies.md §9, docs/evaluation.md §4.2): the blockwise bound of
the uniform-noise process and the canvas sampler. Loaded only when evaluation calls a hook
(`strategies/base_evaluation.py`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from strategies.base import CorruptedBatch
from strategies.base_evaluation import DLLMEvaluator, SampleRequest
from strategies.block_diffusion.loss import MIN_LEVEL
from strategies.block_diffusion.sampling import block_canvas_sample
from strategies.block_diffusion.strategy import build_response_window, sliding_window
from strategies.losses import uniform_diffusion_nelbo_terms
from strategies.posteriors import own_token_removed
from strategies.sampling import SampleResult


class BlockDiffusionEvaluator(DLLMEvaluator):
    def nelbo_rows(
        self,
        model: nn.Module,
        clean_ids: Tensor,
        loss_mask: Tensor,
        mask_token_id: int | None,
        t: Tensor,
        generator: torch.Generator,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Blockwise bound per row at noise level t [B]: every response block scored given the clean
        blocks before it (docs/evaluation.md §4.2), each token by the continuous-time uniform-noise term, the rows
        corrupted by the strategy's kernel at t (`BlockDiffusionStrategy.corrupt_at_level`). `mask_token_id` is
        not read (None: no [MASK] token).

        The term's x̂ is the clean-token distribution that has not seen the token's own noisy value: the
        model's output under "analytic" own-token evidence; under "learned" the model predicts the
        posterior, whose own-token evidence is divided out first (`own_token_removed`)."""
        s = self.strategy
        vocab = s.vocab_size or model.config.vocab_size
        batch, length = clean_ids.shape
        t = t.clamp(MIN_LEVEL, 1 - MIN_LEVEL)
        noisy, noise = s.corrupt_at_level(clean_ids, loss_mask, mask_token_id, t, generator)
        ones = torch.ones(batch, length, device=clean_ids.device)
        window = build_response_window(
            clean_ids, noisy, noise, loss_mask, ones, attention_mask, s.block_size, None, sliding_window(model)
        )
        attention = attention_mask if attention_mask is not None else torch.ones_like(loss_mask)
        batch_view = CorruptedBatch(clean_ids, noisy, noise, ones, loss_mask, attention)
        logits = model(**s.model_inputs(batch_view, window)).logits
        x_hat = logits
        if s.own_token_evidence == "learned":
            x_hat = own_token_removed(logits, window.canvas_ids, (1 - t)[:, None], vocab)
        terms = uniform_diffusion_nelbo_terms(x_hat, window.target_ids, window.canvas_ids, 1 - t, vocab)
        return (terms * window.loss_mask).sum(dim=1)

    def sample(self, model: nn.Module, request: SampleRequest) -> SampleResult:
        """The canvas sampler (docs/strategies.md §11.6): blocks of at most the trained block size, uniform noise
        removed by the reverse step; `request.mask_token_id` is not read."""
        s, config = self.strategy, request.config
        return block_canvas_sample(
            model,
            request.prompts,
            vocab_size=s.vocab_size or model.config.vocab_size,
            block_size=min(s.block_size, config.block_size),
            pad_token_id=request.pad_token_id,
            config=config,
            generator=request.generator,
            device=request.device,
            on_block=request.on_block,
            own_token_evidence=s.own_token_evidence,
        )
