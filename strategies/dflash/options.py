"""DFlash's options, samplers and registration (torch-free: config validation reads them without the class)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from dllm_common.config import ConfigError, PipelineSpec
from strategies.dflash.dflash2_config import DFLASH, DFLASH2, DOMINO, DOMINO_DEFAULTS, JETSPEC, SHAPE_DEFAULTS
from strategies.dflash.window_config import attention_shape_problem
from strategies.registration import Registration, SamplerInfo, StrategyOptions

SPECULATIVE = "speculative"  # the draft proposes a block, the frozen target verifies it
VARIABLE_PREFIX = "variable_prefix"
FORWARD_KL = "forward_kl"
PREFIX_WEIGHT_BASE = 0.9  # D2SD / NeMo Automodel's default base of the prefix-length prior


class DFlashOptions(StrategyOptions):
    """DFlash draft training (docs/strategies.md §8.5, §12.2); usually set in the `dflash:` section.
    `block_size` 0: the draft checkpoint's; `loss_decay_gamma` ≤ 0: the paper's γ for the block size."""

    block_size: int = Field(0, ge=0)
    loss_decay_gamma: float = 0.0
    # position weights: fixed exp decay, D-PACE, or the decay behind a shown prefix of random length (§5.7); or
    # JetSpec's forward KL to the target's top-`distill_top_k` distribution at `kd_temperature`, every position
    # weighing 1 (§10.14; the default of draft_variant jetspec)
    loss_type: Literal["decay", "dpace", "variable_prefix", "forward_kl"] = "decay"
    kd_temperature: float = Field(1.0, gt=0)
    dpace_alpha: float = Field(0.5, ge=0, le=1)  # D-PACE's confidence floor α (§5.7)
    # variable_prefix: Pr(p tokens shown after the anchor) ∝ base^p, p = 1 … bs − 2 (< 1 favours short prefixes)
    prefix_weight_base: float = Field(PREFIX_WEIGHT_BASE, gt=0)
    # 0: each prediction's label is the row's token; k > 0: the target's top-k next-token distribution there
    # (renormalized), EAGLE's distillation target; the cache_target stage stores it (docs/strategies.md §10.7)
    distill_top_k: int = Field(0, ge=0)
    # a new draft also reads, per block position, the token the context lookup proposes there and the matched
    # suffix's length, and learns when to copy it (docs/strategies.md §10.9); false: the draft of the paper
    copy_hint: bool = False
    num_blocks_per_sample: int = Field(1, ge=1)
    attention_backend: Literal["sdpa", "flex_attention"] = "sdpa"
    overlap_anchors: bool = True
    # packed pretraining rows: a block sees only its anchor's document and predicts only its tokens
    # (docs/strategies.md); false: context crosses document boundaries, as the reference's dLLM recipe does
    document_mask: bool = True
    use_fused_linear_ce: bool = True
    ce_chunk_size: int = Field(1024, ge=1)
    # DFlash 2 (docs/strategies.md §10.11): a new draft gets in-block convolutions and a path selector over each
    # position's top `selector_top_k` candidates, trained by `selector_loss_weight` × the selector's CE.
    # JetSpec (§10.14): the DFlash draft with causal attention inside the block (`is_causal: true` in its config.json)
    # Domino (§10.15): a GRU correction head of these sizes, the backbone's own loss weighing `domino_lambda_start`
    # at first and 0 after the first `domino_decay_ratio` of train.steps
    draft_variant: Literal["dflash", "dflash2", "jetspec", "domino"] = DFLASH
    conv_kernel_size: int = Field(SHAPE_DEFAULTS["conv_kernel_size"], ge=1)
    conv_group_size: int = Field(SHAPE_DEFAULTS["conv_group_size"], ge=1)
    selector_rank: int = Field(SHAPE_DEFAULTS["selector_rank"], ge=1)
    selector_top_k: int = Field(SHAPE_DEFAULTS["selector_top_k"], ge=1)
    selector_loss_weight: float = Field(1.0, ge=0)
    domino_gru_hidden_dim: int = Field(DOMINO_DEFAULTS["gru_hidden_dim"], ge=1)
    domino_emb_dim: int = Field(DOMINO_DEFAULTS["emb_dim"], ge=1)
    domino_lambda_start: float = Field(1.0, ge=0, le=1)
    domino_decay_ratio: float = Field(0.5, ge=0, le=1)
    # a new draft's attention (docs/strategies.md §10.12): every layer a sliding window of this many positions over
    # the context (None: full attention), and its heads, key/value heads and head width, independent of the target's
    # (None: model.num_heads, model.num_kv_heads, hidden ÷ heads); an imported draft must already be so
    draft_sliding_window: int | None = Field(None, ge=1)
    draft_num_attention_heads: int | None = Field(None, ge=1)
    draft_num_key_value_heads: int | None = Field(None, ge=1)
    draft_head_dim: int | None = Field(None, ge=2)

    @field_validator("block_size")
    @classmethod
    def _block(cls, value: int) -> int:
        if value == 1:
            raise ValueError("dflash.block_size must be at least 2 (or 0 to read it from the draft checkpoint)")
        return value

    @field_validator("loss_type")
    @classmethod
    def _prefix_room(cls, value: str, info: ValidationInfo) -> str:
        if value == VARIABLE_PREFIX and info.data.get("block_size") == 2:
            raise ValueError(variable_prefix_block_problem(2))
        return value

    @field_validator("prefix_weight_base")
    @classmethod
    def _base_for_variable_prefix(cls, value: float, info: ValidationInfo) -> float:
        """A base other than the default with another loss type (the default is in every dump of the options,
        so a checkpoint's recorded options load back; a key written in the config is refused by
        `check_against`)."""
        loss_type = info.data.get("loss_type", VARIABLE_PREFIX)  # absent: loss_type itself was refused
        if loss_type != VARIABLE_PREFIX and value != PREFIX_WEIGHT_BASE:
            raise ValueError(
                f"dflash.prefix_weight_base ({value}) is the prefix prior of loss_type variable_prefix and does "
                f"nothing with loss_type {loss_type}: drop it, or set dflash.loss_type: variable_prefix"
            )
        return value

    @field_validator("draft_variant")
    @classmethod
    def _dflash2_combinations(cls, value: str, info: ValidationInfo) -> str:
        why = {
            DFLASH2: "the selector's term weighs positions like the block loss",
            DOMINO: "its curriculum mixes two decay-weighted losses",
        }
        if value in why and info.data.get("loss_type") in ("dpace", FORWARD_KL):
            raise ValueError(
                f"dflash.draft_variant {value} trains with loss_type decay or variable_prefix, not "
                f"{info.data['loss_type']} ({why[value]})"
            )
        if value in (DFLASH2, DOMINO) and info.data.get("copy_hint"):
            raise ValueError(f"dflash.draft_variant {value} has no copy hint: set dflash.copy_hint: false")
        return value

    @model_validator(mode="before")
    @classmethod
    def _jetspec_objective(cls, data):
        """A JetSpec draft trains with JetSpec's own objective unless another loss_type is asked."""
        if isinstance(data, dict) and data.get("draft_variant") == JETSPEC and "loss_type" not in data:
            data = {**data, "loss_type": FORWARD_KL}
        return data

    @model_validator(mode="after")
    def _forward_kl_distills(self):
        """The forward KL needs the target's distribution."""
        if self.loss_type == FORWARD_KL and not self.distill_top_k:
            raise ValueError(
                "dflash.loss_type forward_kl (JetSpec's objective, the default of draft_variant jetspec) distills the "
                "target's next-token distribution: set dflash.distill_top_k to how many of its most probable tokens "
                "to keep as the teacher (e.g. 32), or set dflash.loss_type: decay"
            )
        return self

    @field_validator("draft_sliding_window")
    @classmethod
    def _window_holds_the_block(cls, value: int | None, info: ValidationInfo) -> int | None:
        size = info.data.get("block_size") or 0
        if value is not None and value < size:
            raise ValueError(
                f"dflash.draft_sliding_window ({value}) is smaller than dflash.block_size ({size}): the engines apply "
                "the window inside the block too, so a block's later positions would not see its anchor; use a window "
                f"of at least {size}"
            )
        return value

    @field_validator("draft_head_dim")
    @classmethod
    def _even_head(cls, value: int | None) -> int | None:
        if value is not None and value % 2:
            raise ValueError(f"dflash.draft_head_dim ({value}) must be even (RoPE rotates pairs of dimensions)")
        return value

    def check_against(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        super().check_against(spec, where)
        shape = attention_shape_problem(self, spec.model)
        if shape is not None and spec.model.kind != "pretrained":  # an imported draft: checked against it at setup
            raise ConfigError(f"{where(shape[0])} {shape[1]}")
        only2 = sorted({*SHAPE_DEFAULTS, "selector_loss_weight"} & self.model_fields_set)
        if self.draft_variant != DFLASH2 and only2:
            raise ConfigError(
                f"{where(only2[0])} shapes or trains a DFlash 2 draft and does nothing with draft_variant "
                f"{self.draft_variant}: drop it, or set draft_variant: dflash2"
            )
        only_domino = sorted(k for k in self.model_fields_set if k.startswith("domino_"))
        if self.draft_variant != DOMINO and only_domino:
            raise ConfigError(
                f"{where(only_domino[0])} shapes or trains a Domino draft and does nothing with draft_variant "
                f"{self.draft_variant}: drop it, or set draft_variant: domino"
            )
        if self.loss_type != FORWARD_KL and "kd_temperature" in self.model_fields_set:
            raise ConfigError(
                f"{where('kd_temperature')} is the temperature of loss_type forward_kl and does nothing with loss_type "
                f"{self.loss_type}: drop it, or set loss_type: forward_kl"
            )
        if self.loss_type != VARIABLE_PREFIX and "prefix_weight_base" in self.model_fields_set:
            raise ConfigError(
                f"{where('prefix_weight_base')} is the prefix prior of loss_type variable_prefix and does nothing "
                f"with loss_type {self.loss_type}: drop it, or set loss_type: variable_prefix"
            )
        d = spec.dflash
        if d.target_model_id is None and d.target_layer_ids is None and spec.model.kind == "tiny":
            # the embedded target and a new draft: both depths are in the config, so a draft too deep for its
            # target is refused here, not after the target has been pretrained
            problem = layer_count_problem(d.pretrain.num_layers, spec.model.num_layers)
            if problem:
                raise ConfigError(
                    f"model.num_layers ({spec.model.num_layers}) vs dflash.pretrain.num_layers: {problem}"
                )
        if not self.block_size:  # 0: the draft checkpoint's, known at run time
            return
        # an anchor block is kept only in a row with ≥ 2 × block_size supervised tokens
        # (strategies.dflash.blocks.sample_anchor_blocks): with a larger block, no block ever trains
        key, size, seq_len, regen = where("block_size"), self.block_size, spec.data.seq_len, spec.dflash.regenerate
        supervised, why = seq_len, f"data.seq_len ({seq_len}) tokens"
        if regen is not None and regen.prompt_len < seq_len:
            supervised = seq_len - regen.prompt_len
            why = f"data.seq_len ({seq_len}) − dflash.regenerate.prompt_len ({regen.prompt_len}) = {supervised}"
        if 2 * size > supervised:
            what = (
                f"is larger than data.seq_len ({seq_len})" if size > seq_len else "is too large for the training rows"
            )
            raise ConfigError(
                f"{key} ({size}) {what}: DFlash keeps an anchor block only in a row with at least 2 × {size} = "
                f"{2 * size} supervised tokens, and a row has {why}, so no block would ever train. Set {key} to "
                f"at most {supervised // 2}, or use longer rows"
            )

    def config_vocab_known(self, spec: PipelineSpec) -> bool:
        """The draft writes through the target's head: the target is built from the config's tokenizer only
        when the `pretrain_target` stage trains it (no `dflash.target_model_id`)."""
        return super().config_vocab_known(spec) and spec.dflash.target_model_id is None


def variable_prefix_block_problem(block_size: int) -> str:
    return (
        f"dflash.loss_type variable_prefix needs dflash.block_size ≥ 3 (got {block_size}): a block of 2 predicts only "
        "the token after its anchor, so no prefix can be shown before it; use a larger block or loss_type decay"
    )


def layer_count_problem(num_target_layers: int, num_draft_layers: int) -> str | None:
    """What is wrong with a draft of `num_draft_layers` reading a target of `num_target_layers` by the default
    layer choice (`strategies.dflash.blocks._build_target_layer_ids`: distinct layers among 1 … T − 3), or None."""
    if num_draft_layers == 1 or (num_target_layers >= 4 and num_draft_layers <= num_target_layers - 3):
        return None
    return (
        f"a {num_draft_layers}-layer draft reads {num_draft_layers} distinct target layers among 1 … T − 3, so it "
        f"needs a target with at least {max(4, num_draft_layers + 3)} layers (got {num_target_layers}); use fewer "
        "draft layers, a deeper target, or dflash.target_layer_ids"
    )


SAMPLERS = {
    # greedy by default: the target's own greedy text, token for token (T > 0 samples the target's distribution)
    SPECULATIVE: SamplerInfo(
        "DFlash: the draft proposes, the target verifies; the target's own text",
        default_temperature=0.0,
        settings=("temperature", "lookup_ngram"),
        decoding=(),  # the draft's own block size, the target's forwards: no step budget, no sampler cache
    ),
}

REGISTRATION = Registration(
    DFlashOptions,
    "strategies.dflash.strategy:DFlashStrategy",
    SAMPLERS,
    section="dflash",
    samples=False,
    models={"dflash_draft": "strategies.dflash.draft:DFlashDraftModel"},
)
