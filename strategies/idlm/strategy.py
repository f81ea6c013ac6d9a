"""`idlm` strategy (docs/strategies.md §8.4): introspective diffusion, converting a causal LM into a dLLM.

Every supervised token of the noisy copy becomes [MASK]; the model runs once over `[x_t ‖ x_0]`
(length 2L, position ids repeated) under the I-DLM block mask, and `IDLMLoss` trains both halves
with the next-token shift. The clean half is an ordinary causal LM, so its NLL is exact
(`eval/ar_nll`). Generation uses plain causal attention: the absorbing sampler with logit shift 1 ("idlm", the
default), or introspective strided decoding ("isd", `strategies/idlm/sampling.py`), where each forward verifies
the previous proposals with the causal half and proposes `block_length` new ones with the noisy half.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from strategies.base import CorruptedBatch, DLLMStrategy, SetupContext, StepContext
from strategies.corruption import corrupt_all_masked
from strategies.decoding_cache import causal_denoiser
from strategies.idlm.loss import IDLMLoss
from strategies.idlm.options import SAMPLERS, IDLMOptions
from strategies.idlm.sampling import isd_sample
from strategies.losses import DLLMLossOutput, causal_nll_rows
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

    def sample(
        self,
        model: nn.Module,
        prompts: list[list[int]],
        *,
        mask_token_id: int,
        pad_token_id: int,
        config,
        generator: torch.Generator | None,
        device: str,
        on_block=None,
    ):
        """The absorbing sampler with logit shift 1, or ISD when `config.sampler` is "isd": `block_length`
        proposals per forward (a noisy block of that length is what training showed the model)."""
        if getattr(config, "sampler", "auto") != "isd":
            return super().sample(
                model,
                prompts,
                mask_token_id=mask_token_id,
                pad_token_id=pad_token_id,
                config=config,
                generator=generator,
                device=device,
                on_block=on_block,
            )
        return isd_sample(
            model,
            prompts,
            mask_token_id=mask_token_id,
            pad_token_id=pad_token_id,
            config=config,
            proposals=self.block_length,
            generator=generator,
            device=device,
            on_block=on_block,
        )

    def denoiser(self, model: nn.Module):
        """Decoding uses plain causal attention; the sampler applies `logit_shift`."""
        return causal_denoiser(model)  # the clean prefix's K/V are reused exactly (docs/decoding.md)

    def introspective_acceptance_rows(
        self, model: nn.Module, clean_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Expected introspective acceptance per row (docs/evaluation.md §4.8): at each supervised token i ≥ 1,
        q = the decode distribution (noisy half, token i behind [MASK]), p = the causal verify distribution
        (clean half); a token proposed from q passes `min(1, p/q)` with probability Σ_v min(p_v, q_v).
        Returns (Σ over the row's scored tokens, count)."""
        valid = attention_mask.bool()
        noisy, _, _ = corrupt_all_masked(clean_ids, loss_mask, self.options.mask_token_id)
        logits = self.joint_logits(model, noisy, clean_ids, valid).float()
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
