"""`dflash` strategy (docs/strategies.md §8.5, §10): train a block-diffusion draft against a frozen causal target.

The trained model is the `DFlashDraftModel`; the target (frozen: eval, no grad) lends its input
embedding and LM head and its hidden states at `target_layer_ids` as the draft's context. Features
come from a `FeatureSource`: `OnlineFeatures` runs the target each step (as the reference does),
`CachedFeatures` reads the rows' features from the memory-mapped shards the `cache_target` stage
wrote. Both give the same loss on the same batch (tested).

Anchors are drawn per row from generators seeded by (base seed, step, global sample index), like
every other strategy's noise (fix docs/reference-differences.md G5), and the DFlash mask is always
applied (fix docs/reference-differences.md G1). Under `loss_type: variable_prefix` each block's shown prefix
length is drawn the same way, from a stream of the row's seed (`strategies.dflash.prefix`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dllm_common.config import DFlashConfig
from strategies.base import CorruptedBatch, DLLMStrategy, Microbatch, SetupContext, StepContext, global_sum
from strategies.corruption import corrupt_uniform
from strategies.dflash.blocks import CopyHints, copy_hints, sample_anchor_blocks
from strategies.dflash.dflash2 import (
    block_predecessors,
    per_offset_correct,
    selector_loss,
    selector_scores,
)
from strategies.dflash.dflash2_config import DFLASH, DFLASH2, DOMINO, DSPARK
from strategies.dflash.domino import correction, lambda_base, prefix_states
from strategies.dflash.draft import draft_block_hidden, embed_and_head
from strategies.dflash.dspark import block_predecessors_all, dspark_terms, teacher_forced
from strategies.dflash.loss import (
    DPACE_ALPHA,
    DFlashDecayLoss,
    DFlashDPACELoss,
    DFlashForwardKLLoss,
    SoftLabels,
    block_soft_labels,
    default_gamma,
    scored_blocks,
)
from strategies.dflash.options import (
    FORWARD_KL,
    SAMPLERS,
    VARIABLE_PREFIX,
    DFlashOptions,
    variable_prefix_block_problem,
)
from strategies.dflash.prefix import draw_prefix_lengths, prefix_generator, reveal_prefix
from strategies.dflash.window_config import options_mismatch
from strategies.losses import DLLMLossOutput
from strategies.registration import StrategyOptions, load_object
from strategies.seeding import seeded_generator

# the `dflash` keys only the evaluation reads (every `eval_*` one): out of the training's key, in the evaluation's
EVAL_ONLY = {name for name in DFlashConfig.model_fields if name.startswith("eval_")}
# the decoder the τ probe runs, spelled "module:function" so the train stage's key does not hold it
# (docs/architecture.md, "Stage keys"): the probe only logs a metric, the weights never depend on it, so editing the
# decoder re-evaluates and never retrains (tests/pipeline/test_eval_lineage.py)
PROBE = "strategies.dflash.decoding:probe_tau"


@dataclass(frozen=True)
class DFlashBlocks:
    """`CorruptedBatch.extras` of DFlash: anchor blocks (`sample_anchor_blocks`) and the rows' target features."""

    anchors: Tensor  # [B, N] anchor positions
    keep: Tensor  # [B, N] which anchors are real
    block_ids: Tensor  # [B, N·bs] the draft's input: anchor token (and a shown prefix), then [MASK]s
    targets: Tensor  # [B, N·(bs−1)] the tokens each block predicts
    block_mask: Tensor  # [B, N·(bs−1)] which predictions count
    features: Tensor  # [B, L, n·H] the target's hidden states at the draft's layers
    documents: Tensor | None = None  # [B, L] per-token document ids (packed rows, `dflash.document_mask`)
    soft: SoftLabels | None = None  # [B, N·(bs−1), k] the target's distribution per prediction (`distill_top_k`)
    hints: CopyHints | None = None  # [B, N·bs] the context lookup's proposals, for a `copy_hint` draft
    prefix: Tensor | None = None  # [B, N] tokens shown after each anchor (`loss_type: variable_prefix`)


class DFlashStrategy(DLLMStrategy):
    """Holds the frozen `target` and the `features` source besides its options (both runtime resources)."""

    name = "dflash"
    Options = DFlashOptions
    sampler_name = "dflash_speculative"
    samplers = tuple(SAMPLERS)
    trains = "draft"
    evaluation = "speculative"
    likelihoods = ("ar_nll",)  # the target's exact NLL
    supports_activation_checkpointing = False
    supports_peft = False

    def __init__(self, options: DFlashOptions | dict | None = None, target: nn.Module | None = None, features=None):
        super().__init__(options)
        self.target = target
        self.features = features
        self.block_size: int | None = self.options.block_size or None
        self.num_blocks, self.overlap = self.options.num_blocks_per_sample, self.options.overlap_anchors
        self.backend = self.options.attention_backend

    @classmethod
    def upstream_stages(cls, spec) -> tuple[str, ...]:
        """The frozen target always; the feature cache when `dflash.target_features` is 'cached' and something
        trains (`train.steps: 0` publishes an imported draft as it is)."""
        cached = spec.dflash.target_features == "cached" and spec.train.steps > 0
        return ("target", "features") if cached else ("target",)

    @classmethod
    def training_data(cls, spec) -> str:
        """The target's own continuations when `dflash.regenerate` is set (DFlash paper §5.1) and something
        trains."""
        return "regenerated" if spec.dflash.regenerate is not None and spec.train.steps > 0 else "prepared"

    @classmethod
    def train_settings(cls, spec) -> dict:
        """Where the target and its features come from (evaluation-only keys left out)."""
        return spec.dflash.model_dump(mode="json", exclude=EVAL_ONLY)

    @classmethod
    def eval_settings(cls, spec) -> dict:
        return spec.dflash.model_dump(mode="json", include=EVAL_ONLY | {"target_torch_dtype", "lookup_ngram"})

    @classmethod
    def complete_options(cls, options: StrategyOptions, model: nn.Module) -> StrategyOptions:
        """An unset block size (0) is the draft checkpoint's."""
        if options.block_size:
            return options
        draft_bs = getattr(getattr(model, "config", None), "block_size", None)
        if draft_bs is None:
            raise ValueError("Cannot infer block_size from draft config. Set dflash.block_size in the YAML.")
        if draft_bs < 2:
            raise ValueError("dflash.block_size must be at least 2.")
        return options.model_copy(update={"block_size": int(draft_bs)})

    def create_loss_fn(self, dllm_cfg: StrategyOptions | dict | None = None) -> nn.Module:
        """The block loss (docs/strategies.md §5.7, §8.5): `loss_type` "decay" weights offset k by exp(−(k−1)/γ)
        (γ ≤ 0: the paper's value for the block size); "dpace" by D-PACE's confidence-derived weights;
        "variable_prefix" is the decay loss, given each block's shown prefix by `forward_backward`; "forward_kl"
        JetSpec's distillation, the target's top-k distribution (`distill_top_k`) at `kd_temperature`."""
        options = self.options if dllm_cfg is None else self.coerce_options(dllm_cfg)
        if not options.block_size:
            raise ValueError("Cannot infer block_size from draft config. Set dflash.block_size in the YAML.")
        if options.loss_type == VARIABLE_PREFIX and options.block_size < 3:  # a block size read from the draft
            raise ValueError(variable_prefix_block_problem(options.block_size))
        if options.loss_type == "dpace":
            alpha = getattr(options, "dpace_alpha", DPACE_ALPHA)  # an options key once DFlashOptions declares it
            return DFlashDPACELoss(
                alpha, use_fused_linear_ce=options.use_fused_linear_ce, chunk_size=options.ce_chunk_size
            )
        if options.loss_type == FORWARD_KL:
            return DFlashForwardKLLoss(
                options.kd_temperature,
                use_fused_linear_ce=options.use_fused_linear_ce,
                chunk_size=options.ce_chunk_size,
            )
        gamma = options.loss_decay_gamma if options.loss_decay_gamma > 0 else default_gamma(options.block_size)
        return DFlashDecayLoss(
            float(gamma), use_fused_linear_ce=options.use_fused_linear_ce, chunk_size=options.ce_chunk_size
        )

    def loss_denominators(
        self, corrupted: list[CorruptedBatch], num_noise: int, num_supervised: int
    ) -> tuple[int, int]:
        """Decay: the global Σ block mask (docs/strategies.md §7.2). D-PACE: the global number of scored blocks
        (a block with at least one supervised prediction), all-reduced over the data-parallel group here, so
        the loss is the weighted CE per block whatever the split into ranks and micro-batches."""
        if self.options.loss_type != "dpace":
            return super().loss_denominators(corrupted, num_noise, num_supervised)
        local = sum(scored_blocks(c.extras.block_mask, self.block_size) for c in corrupted)
        return int(global_sum(local)), num_supervised

    def setup_extra(self, setup: SetupContext) -> int | None:
        """The target must lend embeddings and an LM head; the features must be the draft's layers."""
        if self.target is None:
            raise ValueError("dflash.target_model_id must be set in config.")
        embed_and_head(self.target)  # raises when the target lacks embeddings or an LM head
        if self.target.training or any(p.requires_grad for p in self.target.parameters()):
            raise ValueError(
                "the DFlash target must be frozen (eval mode, requires_grad False): load it with "
                "tasks.speculative.setup.load_target, or call .eval().requires_grad_(False) on it"
            )
        variant = getattr(setup.model.config, "variant", DFLASH)
        if variant != self.options.draft_variant:
            raise ValueError(
                f"dflash.draft_variant is {self.options.draft_variant} but the draft is a {variant} draft: set "
                f"dflash.draft_variant: {variant} to train it"
            )
        mismatch = options_mismatch(self.options, setup.model.config)  # docs/strategies.md §10.12
        if mismatch:
            raise ValueError(mismatch)
        layer_ids = list(setup.model.config.target_layer_ids)
        if self.features is not None and list(self.features.layer_ids) != layer_ids:
            raise ValueError(
                f"the target-feature cache holds layers {list(self.features.layer_ids)} but the draft reads "
                f"{layer_ids}; rebuild the cache (cache_target) for this draft or use dflash.target_features: online"
            )
        k, held = self.options.distill_top_k, getattr(self.features, "top_k", 0)
        if k and held < k:
            raise ValueError(
                f"dflash.distill_top_k is {k} but the target-feature source holds the target's top {held} tokens; "
                "rebuild the cache (cache_target) with this dflash.distill_top_k, or set it to 0 (hard labels)"
            )
        return setup.mask_token_id

    def check_mask_token(self, mask_token_id: int, model: nn.Module) -> None:
        """The draft has no embedding of its own: its [MASK] row is the target's, checked against the target
        when it is loaded (`tasks/speculative/setup.py`)."""

    def probe_due(self, step: int, last: bool) -> bool:
        """Every `dflash.eval_every` steps and at the last (0: never)."""
        every = self.options.eval_every
        return bool(every) and ((step + 1) % every == 0 or last)

    def training_probe(self, model: nn.Module, val_ids: Tensor, val_attention: Tensor) -> dict:
        """`dflash/train_tau`: τ of greedy speculative decoding of `eval_every_prompts` held-out prompts (the first
        `eval_every_prompt_len` tokens of validation rows spread over the split, `eval_every_max_new_tokens` new tokens
        each) with the draft as it stands, so a curve beside the loss shows when the draft stops improving."""
        o = self.options
        draft = getattr(model, "module", model)
        shape = (o.eval_every_prompts, o.eval_every_prompt_len, o.eval_every_max_new_tokens)
        return {"dflash/train_tau": load_object(PROBE)(self.target, draft, val_ids, val_attention, *shape)}

    # ------------------------------------------------------------------ interface-only hooks (docs/strategies.md §8.5)

    def apply_corruption(
        self, input_ids, loss_mask, mask_token_id, *, eps, block_size, half_life_ratio, generator=None
    ):
        return corrupt_uniform(input_ids, loss_mask, mask_token_id, eps=eps, generator=generator)

    def corrupt_at_level(self, clean_ids, loss_mask, mask_token_id, t, generator=None):
        raise NotImplementedError(
            "dflash's corruption has no noise level: a draft is trained on anchor blocks (an anchor token, then "
            "[MASK]s the target's context must fill, docs/strategies.md §10), not on rows corrupted at a level t"
        )

    def prepare_batch(self, batch, noisy, noise_mask, clean):
        return batch

    # ------------------------------------------------------------------ the step

    def _anchor_blocks(self, ctx: StepContext, mb: Microbatch, i: int, docs):
        """Micro-batch `i`'s anchor blocks, each row from its own seed, and (variable prefix, in a step with a loss)
        each block's shown prefix, drawn from the same seeds' prefix generators."""
        seeds = self.row_seeds(ctx, mb, i)
        gens = [seeded_generator(seed, "cpu") for seed in seeds]
        blocks = sample_anchor_blocks(
            mb.input_ids,
            mb.attention_mask,
            mb.loss_mask,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            mask_token_id=ctx.mask_token_id,
            overlap=self.overlap,
            generators=gens,
            document_ids=docs,
        )
        prefix = None
        if self.options.loss_type == VARIABLE_PREFIX and ctx.loss_fn is not None:
            prefix_gens = [prefix_generator(seed) for seed in seeds]
            base = self.options.prefix_weight_base
            prefix = draw_prefix_lengths(prefix_gens, self.num_blocks, self.block_size, base)
            prefix = prefix.to(mb.input_ids.device)
            blocks = reveal_prefix(blocks, prefix, mb.attention_mask, self.block_size, docs)
        return blocks, prefix

    def pre_step(self, ctx: StepContext, microbatches: list[Microbatch]) -> tuple[list[CorruptedBatch], int, int]:
        """Anchors (per-row seeded) and target features for every micro-batch; counts = Σ block_mask.

        `loss_type: variable_prefix` also draws each block's shown prefix (per-row seeded) in a step that has a
        loss (`ctx.loss_fn`: training and its validation loss); without one (the evaluate stage's teacher-forced
        acceptance) the blocks are anchor-only, as speculative decoding drafts them (docs/strategies.md §10.3)."""
        out, total = [], 0
        for i, mb in enumerate(microbatches):
            docs = mb.document_ids if self.options.document_mask else None
            blocks, prefix = self._anchor_blocks(ctx, mb, i, docs)
            k = self.options.distill_top_k
            target = self.features(mb, labels=k > 0)
            soft = block_soft_labels(target.top, blocks.anchors, self.block_size, k) if k else None
            hints = None
            draft_config = getattr(getattr(ctx.model, "module", ctx.model), "config", None)  # DDP holds `.module`
            if getattr(draft_config, "copy_hint", self.options.copy_hint):
                hints = copy_hints(mb.input_ids, blocks.anchors, self.block_size, ctx.mask_token_id, docs)
            extras = DFlashBlocks(
                blocks.anchors,
                blocks.keep,
                blocks.block_ids,
                blocks.targets,
                blocks.block_mask,
                target.features,
                docs,
                soft,
                hints,
                prefix,
            )
            out.append(
                CorruptedBatch(
                    mb.input_ids,
                    mb.input_ids,
                    torch.zeros_like(mb.loss_mask, dtype=torch.bool),
                    torch.ones_like(mb.loss_mask, dtype=torch.float32),
                    mb.loss_mask,
                    mb.attention_mask,
                    extras,
                )
            )
            total += int(blocks.block_mask.sum())
        return out, total, total

    def forward_backward(
        self, ctx: StepContext, batch: CorruptedBatch, *, num_diffusion_tokens: int, num_ar_tokens: int, is_train: bool
    ) -> DLLMLossOutput:
        e, bs = batch.extras, self.block_size
        emb, head = embed_and_head(self.target)
        feats = e.features.to(next(ctx.model.parameters()).dtype)  # a bf16/fp16 cache feeds an fp32 draft
        h = draft_block_hidden(
            ctx.model, bs, emb, feats, e.anchors, e.keep, e.block_ids, e.documents, self.backend, e.hints
        )
        b, n = e.anchors.shape
        pred = h.view(b, n, bs, -1)[:, :, 1:].reshape(b, n * (bs - 1), -1)
        if self.options.draft_variant == DOMINO:  # final and backbone logits both (docs/strategies.md §10.15)
            out = self._domino(ctx, e, pred, head, emb, num_diffusion_tokens)
        elif self.options.draft_variant == DSPARK:  # the Markov-biased logits, TV and confidence (§10.17)
            out = self._dspark(ctx, e, h.view(b, n, bs, -1), pred, head, num_diffusion_tokens)
        elif self.options.use_fused_linear_ce:
            out = ctx.loss_fn.forward_fused(
                pred,
                head.weight,
                e.targets,
                e.block_mask,
                num_tokens=num_diffusion_tokens,
                block_size=bs,
                lm_head_bias=getattr(head, "bias", None),
                soft=e.soft,
                prefix=e.prefix,
            )
        else:
            out = ctx.loss_fn(
                head(pred),
                e.targets,
                e.block_mask,
                num_tokens=num_diffusion_tokens,
                block_size=bs,
                soft=e.soft,
                prefix=e.prefix,
            )
        if self.options.draft_variant == DFLASH2:
            out = self._with_selector(ctx, e, pred, head, out, num_diffusion_tokens)
        if is_train:
            (out.total_loss * ctx.loss_scale).backward()
        return out

    def _domino(self, ctx: StepContext, e: DFlashBlocks, pred, head, embed, num_tokens) -> DLLMLossOutput:
        """Domino's objective (docs/strategies.md §10.15): `(1 − λ)·L(final) + λ·L(backbone)`, both the block loss,
        the final logits teacher-forced through the GRU over each prediction's true predecessors; λ by the
        base-anchor curriculum over `ctx.total_steps` (0 in validation). With `use_fused_linear_ce` both losses go
        through the head (and the correction) in checkpointed chunks, no `[B·T, V]` logits kept. The per-offset
        accuracies are the final logits'."""
        draft, bs, o = getattr(ctx.model, "module", ctx.model), self.block_size, self.options
        states = prefix_states(draft, block_predecessors(e.block_ids, e.targets, bs), embed, pred.dtype)
        weight = lambda_base(ctx.step, ctx.total_steps, o.domino_lambda_start, o.domino_decay_ratio)
        weight = weight if ctx.training else 0.0
        kw = {"num_tokens": num_tokens, "block_size": bs, "soft": e.soft, "prefix": e.prefix}
        bias = getattr(head, "bias", None)
        if o.use_fused_linear_ce:

            def final_and_base(h, g):  # the head's matmul once per chunk for both losses
                base = F.linear(h, head.weight, bias)
                final = base + correction(draft, h, g)
                return (final, base) if weight else (final,)

            out, *rest = ctx.loss_fn.forward_chunked(final_and_base, (pred, states), e.targets, e.block_mask, **kw)
            base = rest[0] if rest else None
        else:
            logits = head(pred)
            out = ctx.loss_fn(logits + correction(draft, pred, states), e.targets, e.block_mask, **kw)
            base = ctx.loss_fn(logits, e.targets, e.block_mask, **kw) if weight else None
        if base is None:
            return out
        total = (1.0 - weight) * out.total_loss + weight * base.total_loss
        return DLLMLossOutput(total, total.detach(), out.draft_correct_per_pos, out.draft_count_per_pos)

    def _dspark(self, ctx: StepContext, e: DFlashBlocks, hidden, pred, head, num_tokens) -> DLLMLossOutput:
        """DSpark's objective (docs/strategies.md §10.17): `w_ce`·(the block loss of the Markov-biased logits, each
        bias after the true predecessor) + `w_tv`·TV + `w_conf`·BCE(confidence, acceptance), the last two weighed per
        position like the block loss and divided by its denominator. The logits are materialized once (`[B, N·(bs −
        1), V]`; `use_fused_linear_ce` does not chunk them here). Per-offset accuracies are the biased logits'."""
        bs, o = self.block_size, self.options
        draft = getattr(ctx.model, "module", ctx.model)  # DDP holds `.module`
        heads = teacher_forced(draft, hidden, block_predecessors_all(e.block_ids, e.targets, bs))
        b, n = e.anchors.shape
        logits = head(pred)
        if heads.bias is not None:
            logits = logits + heads.bias[:, :, 1:].reshape(b, n * (bs - 1), -1).to(logits.dtype)
        kw = {"num_tokens": num_tokens, "block_size": bs, "soft": e.soft, "prefix": e.prefix}
        out = ctx.loss_fn(logits, e.targets, e.block_mask, **kw)
        confidence = None if heads.confidence is None else heads.confidence[:, :, 1:].reshape(b, -1)
        weights = ctx.loss_fn.position_weights(e.block_mask, e.block_mask, bs, e.prefix) * e.block_mask
        tv, bce = dspark_terms(logits, e.targets, e.soft, confidence, weights, num_tokens, o.dspark_confidence_target)
        total = o.dspark_ce_weight * out.total_loss + o.dspark_tv_weight * tv + o.dspark_confidence_weight * bce
        return DLLMLossOutput(total, total.detach(), out.draft_correct_per_pos, out.draft_count_per_pos)

    def _with_selector(self, ctx: StepContext, e: DFlashBlocks, pred, head, out, num_tokens) -> DLLMLossOutput:
        """DFlash 2's objective (docs/strategies.md §10.11): the block loss + `selector_loss_weight` × the CE of the
        selector over each prediction's top-k candidates scored after its true predecessor, positions weighed as
        in the block loss; the per-offset accuracies become the selector's (teacher-forced) picks'."""
        bs, draft = self.block_size, getattr(ctx.model, "module", ctx.model)  # DDP holds `.module`
        sel = selector_scores(
            draft.candidate_selector,
            pred,
            head,
            block_predecessors(e.block_ids, e.targets, bs),
            e.targets,
            self.options.ce_chunk_size,
        )
        weights = ctx.loss_fn.position_weights(e.block_mask, e.block_mask, bs, e.prefix) * e.block_mask
        total = out.total_loss + self.options.selector_loss_weight * selector_loss(sel, weights, num_tokens)
        correct, count = per_offset_correct(sel.picks() == e.targets, e.block_mask, bs)
        return DLLMLossOutput(total, total.detach(), correct, count)
