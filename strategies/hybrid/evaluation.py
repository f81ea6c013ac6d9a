"""`hybrid`'s evaluation hooks (docs/strategies.md §8.3): the diffusion branch as the samplers' denoiser, blocks
seeded by the causal branch and completed by the diffusion branch (Nemotron decoding), and the causal branch's
exact left-to-right NLL (`eval/ar_nll`); its bound is the base evaluator's absorbing one (`eval/nelbo`). Loaded
only when evaluation calls a hook (`strategies/base_evaluation.py`)."""

from __future__ import annotations

from torch import Tensor, nn

from strategies.base_evaluation import DLLMEvaluator, SampleRequest
from strategies.decoding_cache import bidirectional_denoiser
from strategies.hybrid.sampling import hybrid_sample
from strategies.losses import causal_nll_rows
from strategies.sampling import SampleResult


class HybridEvaluator(DLLMEvaluator):
    def denoiser(self, model: nn.Module):
        """The diffusion branch on ids that already carry [MASK] (the sampler's contract)."""
        return bidirectional_denoiser(model, getattr(model, "lm", None), call=lambda x, attn: model(input_ids=x).logits)

    def sample(self, model: nn.Module, request: SampleRequest) -> SampleResult:
        """Blocks seeded by the causal branch, completed by the diffusion branch (Nemotron decoding)."""
        return hybrid_sample(model, request.prompts, **request.keywords())

    def ar_nll_rows(
        self, model: nn.Module, clean_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Exact left-to-right NLL of the supervised tokens under the causal branch: (Σ nll, count) per row."""
        return causal_nll_rows(model.causal_logits(clean_ids, attention_mask), clean_ids, loss_mask, attention_mask)

    def causal_logits(self, model: nn.Module):
        """The causal branch: row i − 1 predicts token i (GRPO's `exact_ar`)."""
        return lambda x, attn: model.causal_logits(x, attn)
