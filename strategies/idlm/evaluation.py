"""`idlm`'s evaluation hooks (docs/strategies.md §8.4, docs/evaluation.md §4.8): plain causal decoding (the
absorbing sampler with logit shift 1, or introspective strided decoding), the clean half's exact NLL and the
introspective acceptance `idlm/alpha_ia`. Loaded only when evaluation calls a hook
(`strategies/base_evaluation.py`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from strategies.base_evaluation import DLLMEvaluator, SampleRequest
from strategies.corruption import corrupt_all_masked
from strategies.decoding_cache import causal_denoiser
from strategies.idlm.sampling import isd_sample
from strategies.losses import causal_nll_rows
from strategies.sampling import SampleResult


class IDLMEvaluator(DLLMEvaluator):
    def sample(self, model: nn.Module, request: SampleRequest) -> SampleResult:
        """The absorbing sampler with logit shift 1, or ISD when `config.sampler` is "isd": `block_length`
        proposals per forward (a noisy block of that length is what training showed the model)."""
        if getattr(request.config, "sampler", "auto") != "isd":
            return super().sample(model, request)
        return isd_sample(model, request.prompts, **request.keywords(), proposals=self.strategy.block_length)

    def denoiser(self, model: nn.Module):
        """Decoding uses plain causal attention; the sampler applies `logit_shift`."""
        return causal_denoiser(model)  # the clean prefix's K/V are reused exactly (docs/decoding.md)

    def causal_logits(self, model: nn.Module):
        """The clean half is a plain causal LM: row i − 1 predicts token i (GRPO's `exact_ar`)."""
        return causal_denoiser(model)

    def introspective_acceptance_rows(
        self, model: nn.Module, clean_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Expected introspective acceptance per row (docs/evaluation.md §4.8): at each supervised token i ≥ 1,
        q = the decode distribution (noisy half, token i behind [MASK]), p = the causal verify distribution
        (clean half); a token proposed from q passes `min(1, p/q)` with probability Σ_v min(p_v, q_v).
        Returns (Σ over the row's scored tokens, count)."""
        valid = attention_mask.bool()
        noisy, _, _ = corrupt_all_masked(clean_ids, loss_mask, self.strategy.options.mask_token_id)
        logits = self.strategy.joint_logits(model, noisy, clean_ids, valid).float()
        length = clean_ids.shape[1]
        q = torch.softmax(logits[:, : length - 1], dim=-1)  # row i − 1 predicts token i
        p = torch.softmax(logits[:, length : 2 * length - 1], dim=-1)
        accept = torch.minimum(p, q).sum(dim=-1)
        scored = (loss_mask.bool() & valid)[:, 1:]
        return (accept * scored).sum(dim=1), scored.sum(dim=1)

    def eval_metrics(self, model: nn.Module, rows, batch_size: int) -> dict:
        """`idlm/alpha_ia`: the mean introspective acceptance over the validation rows' supervised tokens."""
        ids, loss_mask, attention_mask = rows
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(ids), batch_size):
                sl = slice(start, start + batch_size)
                s, n = self.introspective_acceptance_rows(model, ids[sl], loss_mask[sl], attention_mask[sl])
                total, count = total + float(s.sum()), count + int(n.sum())
        return {"idlm/alpha_ia": total / count if count else float("nan")}

    def ar_nll_rows(
        self, model: nn.Module, clean_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Exact left-to-right NLL of the supervised tokens under the causal path: (Σ nll, count) per row."""
        logits = model(input_ids=clean_ids, attention_mask=attention_mask, use_cache=False).logits
        return causal_nll_rows(logits, clean_ids, loss_mask, attention_mask)
