"""`block_diffusion` strategy (docs/strategies.md §8.6, §9): DiffusionGemma-style encoder + noised canvas.

The clean sequence is encoded causally; the response (everything from the first supervised token)
is copied into a canvas, corrupted with uniform random tokens (no [MASK]) and denoised block by
block: canvas block q attends to the clean prompt, the clean response blocks before q (as encoder
K/V) and its own noisy block. One block per example is scored each step; the encoder's next-token
head adds an AR loss. `eval/nelbo` is the blockwise bound of the uniform-noise process (see
`uniform_diffusion_nelbo_terms`).

Own-token evidence (`own_token_evidence`, docs/strategies.md §5.4). A canvas token z_i is the clean token
with probability α_t + (1 − α_t)/V and any other given token with (1 − α_t)/V, so the posterior over the
clean token is π(x) ∝ x̂(x)·q(z_i | x), where x̂ is the prediction from everything *but* z_i. With
"analytic" (the default of architecture "stack") the model's logits are log x̂ and the known log q(z_i | x)
is added to them wherever the posterior is needed (canvas loss at the training level t, sampler at its own
level); the bound and the reverse step take x̂ as it is. With "learned" (the reference, DiffusionGemma, and
the default of architecture "diffusion_gemma", whose canvas barely learns its context under "analytic":
docs/strategies.md §5.4) the logits are log π: the model must learn how far to trust z_i without being told
t, and the bound and the sampler divide q(z_i | x) out again (`own_token_removed`).

Randomness: corruption, block choice and the self-conditioning coin are drawn per sample from
the sample's own seed (docs/strategies.md §3), so they are identical across resume and any data-parallel layout.
(The reference seeds block choice per (step, micro-batch); per-sample is strictly stronger.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from strategies.base import CorruptedBatch, DLLMStrategy, Microbatch, StepContext, TokenCounts, global_sum
from strategies.block_diffusion.loss import OwnTokenCanvasLoss
from strategies.block_diffusion.options import ARCHITECTURES, BLOCK_DIFFUSION, SAMPLERS, BlockDiffusionOptions
from strategies.corruption import check_rows, corrupt_uniform_random, replace_at_level
from strategies.losses import DLLMLossOutput, FlatCrossEntropyLoss, encoder_ar_loss
from strategies.masks import build_block_diffusion_training_mask
from strategies.registration import StrategyOptions
from strategies.seeding import seeded_generator

_AUX_SEED_XOR = 0x5DEECE66D  # separates the block-choice / self-conditioning stream from the corruption stream


@dataclass(frozen=True)
class ResponseWindow:
    """The canvas view of a micro-batch (docs/strategies.md §9.2), all `[B, R]` unless noted."""

    canvas_ids: Tensor
    target_ids: Tensor
    noise_mask: Tensor
    loss_mask: Tensor
    p_mask: Tensor
    block_ids: Tensor
    decoder_attention_mask: dict  # {"full_attention", "sliding_attention"}: bool keep masks [B, 1, R, S + R]
    encoder_position_ids: Tensor  # [B, S]
    encoder_padding_mask: Tensor | None  # [B, S], True = padding
    decoder_position_ids: Tensor
    decoder_padding_mask: Tensor
    prefix_lengths: Tensor  # [B]
    response_lengths: Tensor  # [B]

    def scored_batch(self) -> CorruptedBatch:
        """The window as the `CorruptedBatch` its canvas loss scores (`strategies.base.DiffusionLoss`), `[B, R]`:
        the clean ids x are `target_ids`, the ids the model saw are the canvas z; the attention mask is the
        window's valid positions."""
        return CorruptedBatch(
            self.target_ids, self.canvas_ids, self.noise_mask, self.p_mask, self.loss_mask, ~self.decoder_padding_mask
        )


@dataclass(frozen=True)
class CanvasExtras:
    """`CorruptedBatch.extras` of block diffusion: the canvas window and each row's self-conditioning coin."""

    window: ResponseWindow
    self_condition: Tensor  # [B] bool


def sliding_window(model: nn.Module) -> int | None:
    """The window the canvas mask of the model's sliding-attention layers applies (None: it has none); a
    data-parallel wrapper is looked through."""
    return getattr(getattr(model, "module", model), "canvas_sliding_window", None)


def supervised_runs(loss_mask: Tensor) -> Tensor:
    """Number of maximal runs of supervised positions per row [B]."""
    lm = loss_mask.bool().long()
    starts = lm[:, :1] + (lm[:, 1:] - lm[:, :-1]).clamp_min(0).sum(dim=1, keepdim=True)
    return starts[:, 0]


def batched_block_mask(
    prefix: Tensor,
    response_lengths: Tensor,
    width: int,
    enc_len: int,
    block_size: int,
    sliding_window: int | None = None,
) -> dict[str, Tensor]:
    """Per-example block-causal masks (each with its own response length) pasted into `[B, 1, R, S + R]`.

    Encoder columns map directly, example b's canvas columns go to `[S, S + R_b)`; the canvas diagonal
    is kept for every row so padding rows are never fully masked (docs/strategies.md §6.3, last paragraph).
    """
    batch = prefix.shape[0]
    device = prefix.device
    full = torch.zeros(batch, 1, width, enc_len + width, dtype=torch.bool, device=device)
    sliding = full.clone()
    for b in range(batch):
        r_b = int(response_lengths[b])
        if r_b > 0:
            f, s = build_block_diffusion_training_mask(
                prefix[b : b + 1], r_b, enc_len, block_size, sliding_window=sliding_window, device=device
            )
            for dst, src in ((full, f), (sliding, s)):
                dst[b, :, :r_b, :enc_len] = src[0, :, :, :enc_len]
                dst[b, :, :r_b, enc_len : enc_len + r_b] = src[0, :, :, enc_len:]
    diag = torch.arange(width, device=device)
    full[:, 0, diag, enc_len + diag] = True
    sliding[:, 0, diag, enc_len + diag] = True
    return {"full_attention": full, "sliding_attention": sliding}


def build_response_window(
    clean: Tensor,
    noisy: Tensor,
    noise_mask: Tensor,
    loss_mask: Tensor,
    p_mask: Tensor,
    attention_mask: Tensor | None,
    block_size: int,
    block_u: Tensor | None,
    sliding_window: int | None = None,
) -> ResponseWindow:
    """Spec §9.2: gather the response into a canvas and (if `block_u` is given) keep one scored block.

    `block_u [B]` in [0, 1) picks block ⌊u·n_blocks⌋ per example; None scores every block (evaluation).
    """
    batch, length = clean.shape
    device = clean.device
    prefix, _ = BlockDiffusionStrategy.split_prompt_response(clean, loss_mask)
    ends = attention_mask.long().sum(dim=1) if attention_mask is not None else torch.full_like(prefix, length)
    resp = (ends - prefix).clamp_min(0)
    width = max(int(resp.max()), 1)
    j = torch.arange(width, device=device)[None, :]
    absolute = prefix[:, None] + j
    valid = (absolute < ends[:, None]) & (j < resp[:, None])
    index = absolute.clamp_max(length - 1)
    gather = lambda t: torch.gather(t, 1, index)  # noqa: E731
    loss = gather(loss_mask.bool()) & valid
    block_ids = j.expand(batch, -1) // block_size
    if block_u is not None:
        n_blocks = ((resp - 1).div(block_size, rounding_mode="floor") + 1).clamp_min(1)
        chosen = (block_u.to(device) * n_blocks).floor().long().clamp_max(n_blocks - 1)
        loss = loss & (block_ids == chosen[:, None])
    masks = batched_block_mask(prefix, resp, width, length, block_size, sliding_window)
    return ResponseWindow(
        canvas_ids=gather(noisy),
        target_ids=gather(clean),
        noise_mask=gather(noise_mask.bool()) & valid,
        loss_mask=loss,
        p_mask=gather(p_mask),
        block_ids=block_ids,
        decoder_attention_mask=masks,
        encoder_position_ids=torch.arange(length, device=device)[None].expand(batch, -1),
        encoder_padding_mask=None if attention_mask is None else ~attention_mask.bool(),
        decoder_position_ids=index,
        decoder_padding_mask=~valid,
        prefix_lengths=prefix,
        response_lengths=resp,
    )


class BlockDiffusionStrategy(DLLMStrategy):
    name = "block_diffusion"
    Options = BlockDiffusionOptions
    model_architecture = BLOCK_DIFFUSION
    sampler_name = "block_canvas"
    samplers = tuple(SAMPLERS)
    likelihoods = ("nelbo",)
    uses_mask_token = False  # the canvas is noised with uniform random tokens (docs/strategies.md §9.1)
    # the canvas pass reads every encoder layer's K/V cache, which recomputed layers do not keep
    supports_activation_checkpointing = False

    @classmethod
    def model_architecture_for(cls, options: BlockDiffusionOptions) -> str:
        """The model shape `options.architecture` trains: "diffusion_gemma" (transformers' DiffusionGemma) or
        "block_diffusion" (`BlockDiffusionLM` over a causal LM, `architecture: stack`)."""
        return ARCHITECTURES[cls.coerce_options(options).architecture]

    @classmethod
    def complete_options(cls, options: StrategyOptions, model: nn.Module) -> StrategyOptions:
        """An unset `vocab_size` is the model's (a DiffusionGemma keeps it in its text config)."""
        options = super().complete_options(options, model)
        config = getattr(model, "config", None)
        if options.vocab_size is None and hasattr(config, "get_text_config"):
            options = options.model_copy(update={"vocab_size": config.get_text_config().vocab_size})
        return options

    def __init__(self, options: BlockDiffusionOptions | dict | None = None) -> None:
        super().__init__(options)
        self.vocab_size: int | None = self.options.vocab_size
        self.block_size = self.options.block_size
        self.self_conditioning_p = self.options.self_conditioning_p
        self.encoder_loss_weight = self.options.encoder_loss_weight
        self.own_token_evidence = self.options.own_token_evidence

    def create_loss_fn(self, dllm_cfg: StrategyOptions | dict | None = None) -> nn.Module:
        """The canvas loss of `own_token_evidence` (of `dllm_cfg` when given, else the strategy's own):
        `OwnTokenCanvasLoss` for "analytic", the reference's flat cross-entropy (`FlatCrossEntropyLoss`) for
        "learned"."""
        mode = self.own_token_evidence if dllm_cfg is None else self.coerce_options(dllm_cfg).own_token_evidence
        return OwnTokenCanvasLoss() if mode == "analytic" else FlatCrossEntropyLoss()

    def apply_corruption(
        self, input_ids, loss_mask, mask_token_id, *, eps, block_size, half_life_ratio, generator=None
    ):
        if self.vocab_size is None:
            raise ValueError(
                "BlockDiffusionStrategy requires dllm.vocab_size (replacement tokens are drawn "
                "uniformly from it); set dllm.vocab_size or assemble the strategy for a model"
            )
        noisy, noise, p_mask, level = corrupt_uniform_random(
            input_ids, loss_mask, self.vocab_size, block_size=None, eps=eps, generator=generator, return_level=True
        )
        if self.own_token_evidence == "analytic":  # the loss needs each row's level t, the one the kernel drew
            p_mask = level[:, None].expand_as(p_mask).to(p_mask.dtype).contiguous()
        return noisy, noise, p_mask

    def corrupt_at_level(self, clean_ids, loss_mask, mask_token_id, t, generator=None):
        """Uniform replacement at level t [B] (`replace_at_level`): each supervised token replaced by a uniform
        draw from the vocabulary with probability t; no [MASK] (`mask_token_id` is not read)."""
        if self.vocab_size is None:
            raise ValueError(
                "BlockDiffusionStrategy requires dllm.vocab_size (replacement tokens are drawn "
                "uniformly from it); set dllm.vocab_size or assemble the strategy for a model"
            )
        return replace_at_level(clean_ids, loss_mask, self.vocab_size, t, generator)

    @staticmethod
    def split_prompt_response(input_ids: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
        """prefix_b = index of the first supervised token (L if none); response = positions ≥ prefix_b."""
        check_rows(input_ids, loss_mask, caller="split_prompt_response")
        length = input_ids.shape[1]
        sup = loss_mask.bool()
        first = torch.where(
            sup.any(dim=1), sup.long().argmax(dim=1), torch.full_like(sup[:, 0], length, dtype=torch.long)
        )
        response = torch.arange(length, device=input_ids.device)[None, :] >= first[:, None]
        return first, response

    def validate_data(self, loss_mask: Tensor, attention_mask: Tensor) -> None:
        runs = supervised_runs(loss_mask)
        bad = (runs > 1).nonzero().flatten()
        if len(bad):
            raise ValueError(
                f"block_diffusion is single-turn: {len(bad)} row(s) have more than one supervised "
                f"run (multi-turn), e.g. row {int(bad[0])} has {int(runs[bad[0]])}; use "
                "data.shape: pretrain or single-turn prompt/response data"
            )

    def prepare_batch(
        self, batch: dict[str, Tensor], noisy: Tensor, noise_mask: Tensor, clean: Tensor
    ) -> dict[str, Tensor]:
        out = self.without_attention_mask(batch)
        out.update(input_ids=clean, canvas_ids=noisy)
        return out

    def corrupt_microbatch(self, ctx: StepContext, mb: Microbatch, microbatch_idx: int) -> CorruptedBatch:
        self.validate_data(mb.loss_mask, mb.attention_mask)
        base = super().corrupt_microbatch(ctx, mb, microbatch_idx)
        draws = torch.stack(
            [
                torch.rand(2, generator=seeded_generator(seed ^ _AUX_SEED_XOR))
                for seed in self.row_seeds(ctx, mb, microbatch_idx)
            ]
        )
        coins = (draws[:, 1] < self.self_conditioning_p).to(base.clean_ids.device)
        window = build_response_window(
            base.clean_ids,
            base.noisy_ids,
            base.noise_mask,
            base.loss_mask,
            base.p_mask,
            base.attention_mask,
            self.block_size,
            draws[:, 0],
            sliding_window(ctx.model),
        )
        return CorruptedBatch(
            base.clean_ids,
            base.noisy_ids,
            base.noise_mask,
            base.p_mask,
            base.loss_mask,
            base.attention_mask,
            CanvasExtras(window, coins),
        )

    def loss_denominators(
        self, corrupted: list[CorruptedBatch], num_noise: int, num_supervised: int
    ) -> tuple[int, int]:
        """Spec §9.3: N_diff = scored tokens of the selected blocks; N_AR = clean next-token pairs; both
        summed over the data-parallel group and clamped to ≥ 1."""
        n_diff = sum(int(c.extras.window.loss_mask.sum()) for c in corrupted)
        n_ar = sum(int((c.attention_mask[:, :-1].bool() & c.attention_mask[:, 1:].bool()).sum()) for c in corrupted)
        return max(global_sum(n_diff), 1), max(global_sum(n_ar), 1)

    def model_inputs(self, batch: CorruptedBatch, window: ResponseWindow) -> dict:
        inputs = self.prepare_batch(
            {"attention_mask": batch.attention_mask}, window.canvas_ids, window.noise_mask, batch.clean_ids
        )
        inputs.update(
            decoder_attention_mask=window.decoder_attention_mask,
            encoder_position_ids=window.encoder_position_ids,
            encoder_padding_mask=window.encoder_padding_mask,
            decoder_position_ids=window.decoder_position_ids,
            decoder_padding_mask=window.decoder_padding_mask,
        )
        return inputs

    def forward_backward(
        self, ctx: StepContext, batch: CorruptedBatch, *, num_diffusion_tokens: int, num_ar_tokens: int, is_train: bool
    ) -> DLLMLossOutput:
        window = batch.extras.window
        out = ctx.model(**self.model_inputs(batch, window), do_self_conditioning=batch.extras.self_condition)
        loss = ctx.loss_fn(out.logits, window.scored_batch(), TokenCounts(diffusion=num_diffusion_tokens))
        encoder_logits = getattr(out, "encoder_logits", None)
        if is_train and encoder_logits is not None and self.encoder_loss_weight > 0:
            ar = encoder_ar_loss(encoder_logits, batch.clean_ids, batch.attention_mask, num_tokens=num_ar_tokens)
            loss = DLLMLossOutput(loss.total_loss + self.encoder_loss_weight * ar, loss.dllm_loss)
        if is_train:
            (loss.total_loss * ctx.loss_scale).backward()
        return loss
