"""The seed strategy API: `DLLMStrategy` and the small, typed values its hooks exchange.

A strategy owns one dLLM family's variation points (docs/strategies.md §1): its loss (`create_loss_fn`), its
forward kernel (`apply_corruption`), the model-input rewrite (`prepare_batch`), the once-per-step
corruption of every micro-batch (`pre_step`), the micro-batch forward/backward
(`forward_backward`) and setup-time validation (`setup_extra`). Hooks receive a `StepContext`
(what a step needs, nothing more) and return values; nothing is stashed in shared buffers.

What only evaluation runs (samplers, likelihood rows, the samplers' denoiser, extra evaluation metrics) is the
strategy's evaluator (`strategies/base_evaluation.py`, `strategies/<name>/evaluation.py`), loaded on the first
call of one of those hooks; this module imports none of it, so training's stage key holds no sampler.

A strategy is built from its typed, frozen options (`Options`, declared in its package's `options.py`) and
declares what the pipeline's tasks need from it: what it trains (`trains`), how it is evaluated
(`evaluation`, `likelihoods`), its samplers, whether it uses a [MASK] token, its upstream stages and
capabilities.

To add a strategy: a package `strategies/<name>/` with its options, samplers and registration
(`options.py`) and its class (a subclass overriding what differs), listed in `strategies.registry.REGISTRY`
(docs/architecture.md, "How a strategy plugs in").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dllm_common.config import ConfigError
from strategies.corruption import mask_at_level
from strategies.models import model_logits
from strategies.registration import ABSORBING, StrategyOptions
from strategies.registry import evaluator_class
from strategies.seeding import corruption_sample_seed, seeded_generator


@dataclass(frozen=True)
class Microbatch:
    """Collated rows: ids, supervision and padding masks, all `[b, L]`."""

    input_ids: Tensor
    loss_mask: Tensor
    attention_mask: Tensor
    row_ids: Tensor | None = None  # the rows' indices in their split (cached per-row features, e.g. DFlash)
    split: str = "train"  # which prepared split the rows come from
    document_ids: Tensor | None = None  # packed rows: `[b, L]` per-token document number within its row

    def to(self, device: torch.device | str) -> Microbatch:
        docs = None if self.document_ids is None else self.document_ids.to(device)
        return Microbatch(
            self.input_ids.to(device),
            self.loss_mask.to(device),
            self.attention_mask.to(device),
            self.row_ids,
            self.split,
            docs,
        )


@dataclass(frozen=True)
class CorruptedBatch:
    """A micro-batch after the forward kernel: what `forward_backward` consumes."""

    clean_ids: Tensor
    noisy_ids: Tensor
    noise_mask: Tensor
    p_mask: Tensor
    loss_mask: Tensor
    attention_mask: Tensor
    extras: Any = None  # a strategy's typed sidecar (DFlash anchor blocks, the block-diffusion canvas window)


class DLLMLossOutput(NamedTuple):
    """What a loss returns and `forward_backward` hands back: `total_loss` is backpropagated, `dllm_loss` is the
    detached diffusion part, logged; DFlash adds its per-position draft accuracy counts."""

    total_loss: Tensor
    dllm_loss: Tensor
    draft_correct_per_pos: Tensor | None = None
    draft_count_per_pos: Tensor | None = None


@dataclass(frozen=True)
class TokenCounts:
    """The step's loss denominators: global token counts, summed over every micro-batch of the optimizer step and
    every data-parallel rank (`DLLMStrategy.loss_denominators`, docs/strategies.md §7.2).

    - `diffusion`: the diffusion term's denominator. None: the loss's local fallback (the local count of the
      positions it scores; MDLM and the hybrid leave the sum undivided).
    - `ar`: the autoregressive term's denominator (hybrid; block diffusion's encoder term is the strategy's own).
      None: the AR sum is left undivided (and a strategy without an AR term passes none).
    """

    diffusion: int | Tensor | None = None
    ar: int | Tensor | None = None


class DiffusionLoss(Protocol):
    """The loss call contract: what `DLLMStrategy.forward_backward` passes to the loss module `create_loss_fn`
    built (`ctx.loss_fn`), and the one place it is written down (docs/architecture.md, "How a strategy plugs in",
    points here; `tests/unit/test_loss_contract.py` holds every registered strategy's loss and
    `LOSS_ARGUMENTS` / `LOSS_KEYWORDS` to it).

    A loss takes the logits, the `CorruptedBatch` and the token counts, plus the causal logits where the strategy
    has them (`B` rows, `L` positions the loss scores, `V` the vocabulary):

    - `logits` `[B, L, V]`, floating (any precision: the cross-entropy upcasts to fp32), or a deferred
      `strategies.head.HeadProjection` that `nll_at` projects only at the positions it scores. Row p
      predicts `batch.clean_ids[:, p]`; a loss that shifts (I-DLM) says so.
    - `batch` a `CorruptedBatch` whose `[B, L]` fields the loss reads (`LOSS_BATCH_FIELDS`; block diffusion
      passes its canvas window's batch, `ResponseWindow.scored_batch`):
        - `clean_ids` integer: the target, the clean ids x.
        - `noisy_ids` integer: z, the ids the model saw (a loss that scores visible tokens or the canvas token's
          own evidence reads it: SCDD, block diffusion's analytic canvas loss).
        - `noise_mask` bool: the positions the forward kernel actually corrupted (n).
        - `p_mask` float32: the corruption level of each position (MDLM: p; SCDD: the time t; block diffusion:
          t, or ones for the flat loss), constant per row or per block.
        - `loss_mask` float 0/1 or bool: the supervised positions (ℓ); nothing else is scored. The hybrid's AR
          term supervises the same positions (next-token, where `causal_logits` is given): one mask for both
          terms, as the hybrid's step has always used.
      No loss reads `attention_mask` or `extras`.
    - `counts` a `TokenCounts`: the step's global denominators, `diffusion` and `ar` (None: the loss's local
      fallback, each loss's docstring says which).
    - `causal_logits` keyword-only `[B, L, V]`: the causal branch's logits (hybrid); None when the model has
      none, and then there is no AR term.

    Returns `DLLMLossOutput(total_loss, dllm_loss, …)`: `total_loss` is what `forward_backward`
    backpropagates (× `ctx.loss_scale`), `dllm_loss` the detached diffusion part, logged. A loss declares exactly
    this signature and reads the fields it needs; the base `forward_backward` passes the logits, the batch and
    `TokenCounts(diffusion=…)`; the hybrid's adds `counts.ar` and `causal_logits`. A strategy that calls its loss
    another way (I-DLM's two-half loss, DFlash's block loss, docs/strategies.md §5.6, §5.7) overrides
    `forward_backward` and documents that call on its loss.
    """

    def __call__(
        self, logits: Tensor, batch: CorruptedBatch, counts: TokenCounts, *, causal_logits: Tensor | None = None
    ) -> DLLMLossOutput: ...


# the contract's argument names, in its order (`DiffusionLoss`), and the batch fields a loss reads
LOSS_ARGUMENTS = ("logits", "batch", "counts")
LOSS_KEYWORDS = ("causal_logits",)
LOSS_BATCH_FIELDS = ("clean_ids", "noisy_ids", "noise_mask", "p_mask", "loss_mask")


@dataclass(frozen=True)
class StepContext:
    """What one optimizer step needs. `loss_scale` multiplies backward (= data-parallel size,
    docs/strategies.md §7.2). `mask_token_id` is the resolved [MASK] id; it is None only for a strategy whose
    `uses_mask_token` is False (uniform noise: block_diffusion) when no id was configured or found in the
    tokenizer, so a strategy that uses a [MASK] token always gets an int."""

    model: nn.Module
    loss_fn: nn.Module  # what `create_loss_fn` built, called as `DiffusionLoss` documents
    mask_token_id: int | None  # None: a strategy that uses no [MASK] token was given none
    step: int
    base_seed: int
    eps: float = 1e-3
    block_size: int | None = None
    half_life_ratio: float | None = 0.25
    dp_rank: int = 0
    dp_size: int = 1
    grad_acc_steps: int = 1
    loss_scale: float = 1.0
    training: bool = True  # False: validation's fixed-noise pass (no training-time curriculum applies)
    total_steps: int | None = None  # the run's train.steps, for a curriculum over its length (None: unknown)


@dataclass(frozen=True)
class SetupContext:
    """What `setup_extra` validates: the model/tokenizer pair and the candidate mask id (the configured one,
    else the tokenizer's). `mask_token_id` is None when neither gives one: `setup_extra` may then return one it
    resolves, and a strategy that uses no [MASK] token (`uses_mask_token` False) keeps None."""

    model: nn.Module
    tokenizer: Any
    mask_token_id: int | None
    extras: dict = field(default_factory=dict)


def model_vocab_size(model: nn.Module | None) -> int | None:
    """Rows of the model's token embedding (`config.vocab_size`; wrappers share their backbone's config),
    None when the model does not say."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(vocab) if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def check_mask_token_id(mask_token_id: int | None, model: nn.Module | None, key: str = "dllm.mask_token_id") -> None:
    """The [MASK] id must be a row of the model's embedding: refuse it, naming `key`, the value and the valid
    range, before any step indexes the embedding with it. Unknown vocabulary or mask id: nothing to check."""
    vocab = model_vocab_size(model)
    if mask_token_id is None or vocab is None:
        return
    if not 0 <= int(mask_token_id) < vocab:
        raise ConfigError(
            f"{key} ({mask_token_id}) is outside the model's vocabulary of {vocab} tokens; valid ids are "
            f"0..{vocab - 1}. Set {key} to an unused token id below {vocab}, or leave it unset to use the "
            "tokenizer's [MASK] token"
        )


def global_sum(value: int | float) -> int | float:
    """Sum a scalar over the data-parallel group (identity outside torch.distributed). Integers (token
    counts) are reduced exactly as int64, floats (losses) as float64; the type comes back unchanged."""

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    kind = int if isinstance(value, int) else float
    t = torch.tensor([value], dtype=torch.long if kind is int else torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return kind(t.item())


class DLLMStrategy:
    """Base strategy = MDLM-shaped defaults; subclasses override the hooks that differ."""

    name: str = "base"
    Options: type[StrategyOptions] = StrategyOptions
    logit_shift: int = 0  # sampler reads row p of the logits from the model's row p − shift
    model_architecture: str | None = None  # model shape the strategy trains (None: the causal LM as is)
    sampler_name: str = "absorbing"  # what `sample` runs (recorded on every evaluation's reproducibility card)
    # ---- what tasks read instead of asking for a strategy by name
    trains: str = "denoiser"  # "denoiser": the (wrapped) backbone; "draft": a draft against a frozen target
    evaluation: str = "diffusion"  # "diffusion": likelihoods + samples; "speculative": acceptance and speedup
    likelihoods: tuple[str, ...] = ()  # "nelbo" (has `nelbo_rows`), "ar_nll" (has `ar_nll_rows`)
    # what `dllm-flow generate --sampler` accepts: the names of the registration's samplers, in its order (the
    # first is what `sample` runs); a registered class sets `samplers = tuple(<its package's sampler table>)`
    samplers: tuple[str, ...] = (ABSORBING,)
    # the strategy's kernel or sampler writes a [MASK] token: its id must be resolved (config, tokenizer or
    # `setup_extra`) and be a row of the model's embedding; False (uniform noise): nothing needs one, and the
    # `mask_token_id` its hooks get (StepContext, SetupContext, apply_corruption, sample, nelbo_rows) may be None
    uses_mask_token: bool = True
    supports_activation_checkpointing: bool = True
    supports_peft: bool = True

    def __init__(self, options: StrategyOptions | dict | None = None) -> None:
        self.options = self.coerce_options(options)

    @classmethod
    def coerce_options(cls, options: StrategyOptions | dict | None) -> StrategyOptions:
        """Typed options from a mapping (unknown keys refused), the typed model itself, or None (defaults)."""
        if isinstance(options, cls.Options):
            return options
        if isinstance(options, StrategyOptions):  # another strategy's model: re-validate its values
            options = options.model_dump()
        return cls.Options.model_validate(dict(options or {}))

    @classmethod
    def complete_options(cls, options: StrategyOptions, model: nn.Module) -> StrategyOptions:
        """Fill what the model decides (an unset `vocab_size` is the model's); every value is fixed after.
        A configured `mask_token_id` outside the model's vocabulary is refused here."""
        check_mask_token_id(options.mask_token_id, model)
        if "vocab_size" in cls.Options.model_fields and getattr(options, "vocab_size", None) is None:
            vocab = getattr(getattr(model, "config", None), "vocab_size", None)
            return options.model_copy(update={"vocab_size": vocab})
        return options

    @classmethod
    def upstream_stages(cls, spec) -> tuple[str, ...]:
        """Stages besides prepare_data whose results training reads: "target" (a frozen causal LM),
        "features" (its hidden states cached over the data)."""
        return ()

    @classmethod
    def training_data(cls, spec) -> str:
        """ "prepared" (the prepare_data rows) or "regenerated" (the target's continuations of them)."""
        return "prepared"

    @classmethod
    def train_settings(cls, spec) -> dict:
        """Config outside the options that shapes training (part of the train stage's key)."""
        return {}

    @classmethod
    def eval_settings(cls, spec) -> dict:
        """Config outside `eval:` that shapes evaluation (part of the evaluate stage's key)."""
        return {}

    def corruption_values(self) -> dict:
        """`eps`, `block_size`, `half_life_ratio` for the forward kernel (what `StepContext` carries)."""
        return {
            "eps": self.options.eps,
            "block_size": getattr(self.options, "block_size", None),
            "half_life_ratio": getattr(self.options, "half_life_ratio", 0.25),
        }

    @property
    def normalization_mode(self) -> str:
        """Which global count divides the diffusion loss: 'supervised' or 'noise'."""
        return "supervised"

    def create_loss_fn(self, dllm_cfg: StrategyOptions | dict | None = None) -> nn.Module:
        """A new loss module built from the options (these, or the strategy's own when None); called by
        `forward_backward` as `DiffusionLoss` says."""
        raise NotImplementedError

    def setup_extra(self, setup: SetupContext) -> int | None:
        """Validate the model/tokenizer pairing; return a resolved mask id (or None to keep it). A strategy
        that uses no [MASK] token (`uses_mask_token` False) has nothing to resolve and returns None."""
        return None

    def check_mask_token(self, mask_token_id: int, model: nn.Module) -> None:
        """Refuse a resolved [MASK] id that is not a row of `model`'s embedding (`check_mask_token_id`). A
        strategy whose trained model writes through another model's embedding checks it there instead.
        Called only where `uses_mask_token` is True, with the resolved id: never None."""
        check_mask_token_id(mask_token_id, model)

    def apply_corruption(
        self,
        input_ids: Tensor,
        loss_mask: Tensor,
        mask_token_id: int | None,
        *,
        eps: float,
        block_size: int | None,
        half_life_ratio: float | None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The forward kernel on rows `[b, L]` → (noisy ids, noise mask, p_mask), drawing only from `generator`.
        `mask_token_id` is `StepContext.mask_token_id`: None only where `uses_mask_token` is False."""
        raise NotImplementedError

    def corrupt_at_level(
        self,
        clean_ids: Tensor,
        loss_mask: Tensor,
        mask_token_id: int | None,
        t: Tensor,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The strategy's own corruption of clean rows `[B, L]` at the given noise level t `[B]` (one per row, in
        [0, 1]) → (noisy ids, noise mask `[B, L]` bool): only supervised positions (`loss_mask`) are corrupted,
        each draw from `generator` (the same generator state gives the same rows). What the likelihood
        estimators, calibration and post-training stages corrupt with, where `apply_corruption` draws its own
        level. Default: the absorbing [MASK] kernel (`strategies.corruption.mask_at_level`), each supervised
        position masked with probability t. `mask_token_id`: None only where `uses_mask_token` is False. A
        strategy whose kernel has no such level raises NotImplementedError saying why."""
        return mask_at_level(clean_ids, loss_mask, mask_token_id, t, generator)

    @staticmethod
    def without_attention_mask(batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The batch minus `attention_mask` / `use_cache`: what every dLLM `prepare_batch` starts from."""
        return {k: v for k, v in batch.items() if k not in ("attention_mask", "use_cache")}

    def prepare_batch(
        self, batch: dict[str, Tensor], noisy: Tensor, noise_mask: Tensor, clean: Tensor
    ) -> dict[str, Tensor]:
        """Noisy ids in, attention mask out: the denoiser sees every position (padding included)."""
        return {**self.without_attention_mask(batch), "input_ids": noisy}

    # ------------------------------------------------------------------ step hooks

    @staticmethod
    def row_seeds(ctx: StepContext, mb: Microbatch, microbatch_idx: int) -> list[int]:
        """Per-row noise seeds: a pure function of (base seed, step, global sample index), docs/strategies.md §3."""
        local_bs = mb.input_ids.shape[0]
        return [
            corruption_sample_seed(
                ctx.base_seed, ctx.step, ctx.dp_rank, ctx.dp_size, local_bs, ctx.grad_acc_steps, microbatch_idx, offset
            )
            for offset in range(local_bs)
        ]

    def corruption_kwargs(self, ctx: StepContext) -> dict:
        """The forward kernel's keyword arguments at this step (`apply_corruption`)."""
        return {"eps": ctx.eps, "block_size": ctx.block_size, "half_life_ratio": ctx.half_life_ratio}

    def corrupt_microbatch(self, ctx: StepContext, mb: Microbatch, microbatch_idx: int) -> CorruptedBatch:
        """Corrupt row by row, each with its own generator seeded from (seed, step, global index)."""
        rows, kwargs = [], self.corruption_kwargs(ctx)
        for offset, seed in enumerate(self.row_seeds(ctx, mb, microbatch_idx)):
            gen = seeded_generator(seed, mb.input_ids.device)
            rows.append(
                self.apply_corruption(
                    mb.input_ids[offset : offset + 1],
                    mb.loss_mask[offset : offset + 1],
                    ctx.mask_token_id,
                    **kwargs,
                    generator=gen,
                )
            )
        noisy, noise, p = (torch.cat(parts) for parts in zip(*rows))
        return CorruptedBatch(mb.input_ids, noisy, noise, p, mb.loss_mask, mb.attention_mask)

    def pre_step(self, ctx: StepContext, microbatches: list[Microbatch]) -> tuple[list[CorruptedBatch], int, int]:
        """Corrupt every micro-batch of the step; return them with raw (noise, supervised) counts."""
        corrupted = [self.corrupt_microbatch(ctx, mb, i) for i, mb in enumerate(microbatches)]
        num_noise = sum(int((c.noise_mask & c.loss_mask.bool()).sum()) for c in corrupted)
        num_sup = sum(int(c.loss_mask.bool().sum()) for c in corrupted)
        return corrupted, num_noise, num_sup

    def loss_denominators(
        self, corrupted: list[CorruptedBatch], num_noise: int, num_supervised: int
    ) -> tuple[int, int]:
        """(num_diffusion_tokens, num_ar_tokens) from the step's global counts (docs/strategies.md §7.2)."""
        diffusion = num_noise if self.normalization_mode == "noise" else num_supervised
        return diffusion, num_supervised

    def validate_data(self, loss_mask: Tensor, attention_mask: Tensor) -> None:
        """Reject a dataset the strategy cannot train on (before any step runs). Default: anything goes."""

    def probe_due(self, step: int, last: bool) -> bool:
        """Whether the train stage calls `training_probe` after `step` (0-based; `last`: the last step). Default: no."""
        return False

    def training_probe(self, model: nn.Module, val_ids: Tensor, val_attention: Tensor) -> dict:
        """Metrics the train stage logs beside the loss where `probe_due`, measured on the validation rows with the
        model as it stands, in eval mode (every rank calls it, so a sharded model can run). DFlash decodes a few
        held-out prompts speculatively (`dflash.eval_every`)."""
        return {}

    # ------------------------------------------------------------------ evaluation hooks (the evaluator's)

    @property
    def evaluator(self):
        """This strategy's evaluation hooks (`strategies.base_evaluation.DLLMEvaluator`, or the subclass its
        registration names), imported and built on first use; never touched while training."""
        built = self.__dict__.get("_evaluator")
        if built is None:
            built = self.__dict__["_evaluator"] = evaluator_class(type(self))(self)
        return built

    def sample(self, model: nn.Module, request):
        """Generate continuations of `request.prompts` (a `strategies.base_evaluation.SampleRequest`) with the
        sampler `request.config.sampler` names: "auto" (or the first of `samplers`) runs the strategy's own, the
        absorbing sampler (`ABSORBING`) runs over the strategy's denoiser where `samplers` offers it. The request's
        `mask_token_id` is the checkpoint's resolved id: None only where `uses_mask_token` is False."""
        wanted = request.config.sampler
        if wanted == ABSORBING and ABSORBING in self.samplers and self.samplers[0] != ABSORBING:
            return self.evaluator.absorbing_sample(model, request)
        return self.evaluator.sample(model, request)

    def nelbo_rows(
        self,
        model: nn.Module,
        clean_ids: Tensor,
        loss_mask: Tensor,
        mask_token_id: int | None,
        t: Tensor,
        generator: torch.Generator,
        **options,
    ) -> Tensor:
        """One-sample NELBO estimate per row at masking level t [B] (read where `likelihoods` has "nelbo"), by
        the evaluator (default: the absorbing bound over `denoiser`). `mask_token_id`: None only where
        `uses_mask_token` is False."""
        return self.evaluator.nelbo_rows(model, clean_ids, loss_mask, mask_token_id, t, generator, **options)

    def ar_nll_rows(
        self, model: nn.Module, clean_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Exact left-to-right NLL per row, (Σ nll, count), where `likelihoods` has "ar_nll" (the evaluator's)."""
        return self.evaluator.ar_nll_rows(model, clean_ids, loss_mask, attention_mask)

    def denoiser(self, model: nn.Module):
        """`(x [B,T], attention_mask [B,T]) → logits [B,T,V]` for the samplers (the evaluator's)."""
        return self.evaluator.denoiser(model)

    def eval_metrics(self, model: nn.Module, rows: tuple[Tensor, Tensor, Tensor], batch_size: int) -> dict:
        """Strategy-specific evaluation metrics over the validation rows (ids, loss_mask, attention_mask), the
        evaluator's; the evaluate stage adds them to the common ones."""
        return self.evaluator.eval_metrics(model, rows, batch_size)

    def forward_backward(
        self, ctx: StepContext, batch: CorruptedBatch, *, num_diffusion_tokens: int, num_ar_tokens: int, is_train: bool
    ) -> DLLMLossOutput:
        """Default micro-batch step: prepare inputs, forward, loss, backward × loss_scale. The loss is called
        as `DiffusionLoss` documents: the logits, the batch and `TokenCounts(diffusion=num_diffusion_tokens)`."""
        inputs = self.prepare_batch(
            {"attention_mask": batch.attention_mask}, batch.noisy_ids, batch.noise_mask, batch.clean_ids
        )
        logits = model_logits(ctx.model, inputs)
        out = ctx.loss_fn(logits, batch, TokenCounts(diffusion=num_diffusion_tokens))
        if is_train:
            (out.total_loss * ctx.loss_scale).backward()
        return out
