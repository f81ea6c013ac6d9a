"""DFlash's options, samplers and registration (torch-free: config validation reads them without the class)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from dllm_common.config import ConfigError, DFlashConfig, PipelineSpec, context_overflow, local_max_positions
from dllm_common.config.dflash import tree_branches_problem
from strategies.dflash.config import is_draft_dir, read_draft_config
from strategies.dflash.dflash2_config import (
    DFLASH,
    DFLASH2,
    DOMINO,
    DOMINO_DEFAULTS,
    DSPARK,
    DSPARK_DEFAULTS,
    JETSPEC,
    KERNEL_WHY,
    SHAPE_DEFAULTS,
)
from strategies.dflash.window_config import attention_shape_problem, vocabulary_problem
from strategies.model_files import resolve_model_path
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
    # DSpark (§10.17): a Markov logit-bias head (rank `dspark_markov_rank`, 0: none; vanilla, gated or rnn) and a
    # confidence head, trained by `dspark_ce_weight`·CE + `dspark_tv_weight`·TV + `dspark_confidence_weight`·BCE of
    # the confidence against the acceptance the proposal gets (`dspark_confidence_target`: overlap Σ min(p, q), what
    # speculative sampling accepts, or greedy 1[argmax = label], what greedy verification accepts)
    draft_variant: Literal["dflash", "dflash2", "jetspec", "domino", "dspark"] = DFLASH
    conv_kernel_size: int = Field(SHAPE_DEFAULTS["conv_kernel_size"], ge=1)
    conv_group_size: int = Field(SHAPE_DEFAULTS["conv_group_size"], ge=1)
    selector_rank: int = Field(SHAPE_DEFAULTS["selector_rank"], ge=1)
    selector_top_k: int = Field(SHAPE_DEFAULTS["selector_top_k"], ge=1)
    selector_loss_weight: float = Field(1.0, ge=0)
    domino_gru_hidden_dim: int = Field(DOMINO_DEFAULTS["gru_hidden_dim"], ge=1)
    domino_emb_dim: int = Field(DOMINO_DEFAULTS["emb_dim"], ge=1)
    domino_lambda_start: float = Field(1.0, ge=0, le=1)
    domino_decay_ratio: float = Field(0.5, ge=0, le=1)
    dspark_markov_rank: int = Field(DSPARK_DEFAULTS["markov_rank"], ge=0)
    dspark_markov_head_type: Literal["vanilla", "gated", "rnn"] = DSPARK_DEFAULTS["markov_head_type"]
    dspark_enable_confidence_head: bool = DSPARK_DEFAULTS["enable_confidence_head"]
    dspark_confidence_head_with_markov: bool = DSPARK_DEFAULTS["confidence_head_with_markov"]
    dspark_ce_weight: float = Field(1.0, ge=0)
    dspark_tv_weight: float = Field(1.0, ge=0)
    dspark_confidence_weight: float = Field(1.0, ge=0)
    dspark_confidence_target: Literal["overlap", "greedy"] = "overlap"
    # > 0: the train stage decodes `eval_every_prompts` held-out prompts speculatively every this many steps and logs
    # τ (`dflash/train_tau`) beside the loss (docs/evaluation.md §4.7.3); 0: only the evaluate stage measures τ
    eval_every: int = Field(0, ge=0)
    eval_every_prompts: int = Field(8, ge=1)
    eval_every_prompt_len: int = Field(16, ge=1)
    eval_every_max_new_tokens: int = Field(32, ge=1)
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
            DSPARK: "its TV and confidence terms weigh positions like the block loss",
        }
        if value in why and info.data.get("loss_type") in ("dpace", FORWARD_KL):
            raise ValueError(
                f"dflash.draft_variant {value} trains with loss_type decay or variable_prefix, not "
                f"{info.data['loss_type']} ({why[value]})"
            )
        if value in (DFLASH2, DOMINO, DSPARK) and info.data.get("copy_hint"):
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

    @model_validator(mode="after")
    def _dspark_heads(self):
        """The confidence head reading the Markov embedding needs a Markov head."""
        if (
            self.draft_variant == DSPARK
            and self.dspark_enable_confidence_head
            and self.dspark_confidence_head_with_markov
            and not self.dspark_markov_rank
        ):
            raise ValueError(
                "dflash.dspark_markov_rank is 0 (no Markov head) but dflash.dspark_confidence_head_with_markov reads "
                "the Markov head's embedding of the previous token: set dspark_confidence_head_with_markov: false, or "
                "a rank > 0"
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
        self._check_variant_keys(spec, where)
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
        problem = target_layers_problem(spec) or eval_keys_problem(spec)
        if problem:
            raise ConfigError(problem)
        self._check_target_vocabulary(spec, where)
        hidden, group = spec.model.hidden_size, self.conv_group_size
        if self.draft_variant == DFLASH2 and spec.model.kind == "tiny" and hidden % group:  # a new draft, that wide
            key, fits = where("conv_group_size"), max(g for g in range(1, group + 1) if hidden % g == 0)
            raise ConfigError(
                f"{key} ({group}) does not divide model.hidden_size ({hidden}), the DFlash 2 draft's width: each group "
                f"of {group} channels shares one tap correction; set {key} to a divisor of {hidden} (e.g. {fits})"
            )
        if self.block_size:
            self._check_block_size(spec, where)
        self._check_tree_branches(spec, where)

    def _check_variant_keys(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        """A key that shapes or trains another variant (DFlash 2, Domino, DSpark) than `draft_variant`, and the τ
        probe's keys without `eval_every`, each refused in one line naming it."""
        given = self.model_fields_set
        owned = {  # the keys that shape or train one variant's draft
            DFLASH2: ("DFlash 2", sorted({*SHAPE_DEFAULTS, "selector_loss_weight"} & given)),
            DOMINO: ("Domino", sorted(k for k in given if k.startswith("domino_"))),
            DSPARK: ("DSpark", sorted(k for k in given if k.startswith("dspark_"))),
        }
        for variant, (name, keys) in owned.items():
            if self.draft_variant != variant and keys:
                raise ConfigError(
                    f"{where(keys[0])} shapes or trains a {name} draft and does nothing with draft_variant "
                    f"{self.draft_variant}: drop it, or set draft_variant: {variant}"
                )
        probe = sorted(k for k in self.model_fields_set if k.startswith("eval_every_"))
        if probe and not self.eval_every:
            raise ConfigError(
                f"{where(probe[0])} shapes the train stage's τ probe, which runs only with {where('eval_every')} > 0: "
                "drop it, or set eval_every"
            )
        if self.eval_every and self.eval_every_prompt_len >= spec.data.seq_len:
            raise ConfigError(
                f"{where('eval_every_prompt_len')} ({self.eval_every_prompt_len}) leaves nothing to continue in a row "
                f"of data.seq_len ({spec.data.seq_len}) tokens: set it to at most {spec.data.seq_len - 1}"
            )

    def _check_tree_branches(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        """`dflash.eval_tree_branches` against the positions a block proposes, where the block size is known: the
        options', or (0) that of a local draft `model.path` imports."""
        imported = None if self.block_size else imported_block_size(spec)
        size, branches = self.block_size or imported or 0, spec.dflash.eval_tree_branches
        source = where("block_size") if self.block_size else f"the draft's at model.path {spec.model.path}"
        problem = tree_branches_problem(branches, size, "dflash.eval_tree_branches", source)
        if problem:
            raise ConfigError(problem)

    def _check_block_size(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        """What `block_size` bounds: the rows that train it, a DFlash 2 kernel, non-overlapping blocks per row."""
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
        if self.draft_variant == DFLASH2 and self.conv_kernel_size > size:
            kernel = where("conv_kernel_size")
            raise ConfigError(
                f"{kernel} ({self.conv_kernel_size}) is larger than {key} ({size}): {KERNEL_WHY}; set {kernel} to at "
                f"most {size}"
            )
        fits = (seq_len - 1) // size  # blocks side by side after a row's first token (sample_anchor_blocks)
        if not self.overlap_anchors and self.num_blocks_per_sample > fits:
            count = where("num_blocks_per_sample")
            raise ConfigError(
                f"{count} ({self.num_blocks_per_sample}) non-overlapping blocks of {size} ({key}) do not fit in a "
                f"row of data.seq_len ({seq_len}) tokens: with {where('overlap_anchors')} false at most {fits} fit "
                f"after the row's first token and the others never train; set {count} to at most {fits}, or "
                "overlap_anchors: true"
            )

    def _check_target_vocabulary(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        """The top-k options (`vocabulary_problem`) and the [MASK] id against the target's vocabulary, where the config
        tells it: the embedded target's tokenizer, a local target's config.json (else at setup, before any step)."""
        known = target_vocabulary(spec)
        if known is None:
            return
        size, source = known
        problem = vocabulary_problem(self, size, source)
        if problem:
            raise ConfigError(f"{where(problem[0])} {problem[1]}")
        if self.mask_token_id is not None and self.mask_token_id >= size and spec.dflash.target_model_id is not None:
            key = where("mask_token_id")  # (the embedded target's: `StrategyOptions.check_against`)
            raise ConfigError(
                f"{key} ({self.mask_token_id}) is outside the target's vocabulary of {size} tokens ({source}); valid "
                f"ids are 0..{size - 1}. Set {key} to an unused token id below {size}, or leave it unset to use the "
                "tokenizer's [MASK] token"
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
    layer choice (`strategies.dflash.blocks.build_target_layer_ids`: distinct layers among 1 … T − 3), or None."""
    if num_draft_layers == 1 or (num_target_layers >= 4 and num_draft_layers <= num_target_layers - 3):
        return None
    return (
        f"a {num_draft_layers}-layer draft reads {num_draft_layers} distinct target layers among 1 … T − 3, so it "
        f"needs a target with at least {max(4, num_draft_layers + 3)} layers (got {num_target_layers}); use fewer "
        "draft layers, a deeper target, or dflash.target_layer_ids"
    )


def local_target_config(spec: PipelineSpec) -> dict | None:
    """The config.json of a local target (`dflash.target_model_id` a folder or `package:NAME`, no GGUF file) read as
    JSON, its `text_config` over it; None for the embedded target, a hub id, a GGUF file or an unreadable one."""
    d = spec.dflash
    if d.target_model_id is None or d.target_gguf_file:
        return None
    try:
        raw = json.loads((Path(resolve_model_path(d.target_model_id)) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a missing package or folder, a hub id: the target stage reads it
        return None
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def target_vocabulary(spec: PipelineSpec) -> tuple[int, str] | None:
    """(the most tokens the target can have, where that comes from) as the config tells it, or None (then it is
    checked at setup, before any training step: `window_config.options_mismatch`)."""
    d = spec.dflash
    if d.target_model_id is None:
        if spec.tokenizer.kind != "train_bpe":
            return None
        return spec.tokenizer.vocab_size, "tokenizer.vocab_size, the most the embedded target's tokenizer holds"
    size = _count((local_target_config(spec) or {}).get("vocab_size"))
    return (
        None if size is None else (size, f"vocab_size in the config.json of dflash.target_model_id {d.target_model_id}")
    )


def target_layers_problem(spec: PipelineSpec) -> str | None:
    """`dflash.target_layer_ids` outside the target's layers, where the config tells how many it has (the embedded
    target's `dflash.pretrain.num_layers`, a local target's config.json), or None."""
    d = spec.dflash
    if not d.target_layer_ids:
        return None
    if d.target_model_id is None:
        depth, source = d.pretrain.num_layers, "dflash.pretrain.num_layers"
    else:
        depth = _count((local_target_config(spec) or {}).get("num_hidden_layers"))
        source = f"num_hidden_layers in the config.json of dflash.target_model_id {d.target_model_id}"
    bad = [i for i in d.target_layer_ids if i < 0 or (depth is not None and i >= depth)]
    if not bad:
        return None
    valid = f"0 … {depth - 1} (the target has {depth} layers: {source})" if depth else "0 or more"
    return f"dflash.target_layer_ids {list(d.target_layer_ids)}: {bad} are not target layers; give layer ids in {valid}"


def imported_block_size(spec: PipelineSpec) -> int | None:
    """The block size of the draft `model.path` imports, read from a local folder's config.json; None for a new
    draft, a hub id or a folder the train stage refuses with its own message."""
    m = spec.model
    if m.kind != "pretrained" or not m.path:
        return None
    try:
        folder = Path(resolve_model_path(m.path))
        return read_draft_config(folder).config.block_size if is_draft_dir(folder) else None
    except (OSError, ValueError):
        return None


def eval_keys_problem(spec: PipelineSpec) -> str | None:
    """What is wrong with the evaluation's speculative-decoding keys against the rows and the target, or None: a prompt
    (`eval_prompt_len`) as long as a row; and, beyond what the defaults ask (which stay accepted as they are: fewer
    prompts, or decoding past a short target's context, and so does anything less), more prompts than the
    evaluation reads validation rows, or a prompt and its continuation (`eval_max_new_tokens`) longer than the
    target's context."""
    d, seq_len, default = spec.dflash, spec.data.seq_len, {k: f.default for k, f in DFlashConfig.model_fields.items()}
    if d.eval_prompt_len >= seq_len:
        return (
            f"dflash.eval_prompt_len ({d.eval_prompt_len}) leaves nothing to continue in a row of data.seq_len "
            f"({seq_len}) tokens: the evaluation's prompts are the first eval_prompt_len tokens of validation rows "
            f"longer than that; set it to at most {seq_len - 1}"
        )
    rows, rows_key = spec.eval.val_rows, "eval.val_rows"
    if spec.data.max_val_rows is not None and spec.data.max_val_rows < rows:
        rows, rows_key = spec.data.max_val_rows, "data.max_val_rows"
    if d.eval_prompts > max(rows, default["eval_prompts"]):  # fewer than the default never fails where it passes
        return (
            f"dflash.eval_prompts ({d.eval_prompts}) is more than the {rows} validation rows the evaluation reads "
            f"({rows_key}): each prompt is the start of one of them, so at most {rows} would be decoded; set it to at "
            f"most {rows}, or raise {rows_key}"
        )
    keys = ("eval_prompt_len", "eval_max_new_tokens")
    if sum(getattr(d, k) for k in keys) <= sum(default[k] for k in keys):  # no longer than the defaults' decode
        return None
    if d.target_model_id is None:
        context, context_of = seq_len, "the embedded target's context (data.seq_len)"
    else:
        context = None if d.target_gguf_file else local_max_positions(d.target_model_id)
        context_of = f"the context of dflash.target_model_id {d.target_model_id} (max_position_embeddings)"
    if context is None:
        return None
    return context_overflow(
        d.eval_prompt_len,
        d.eval_max_new_tokens,
        context,
        prompt="dflash.eval_prompt_len",
        new="dflash.eval_max_new_tokens",
        context_of=context_of,
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
    estimators=(),  # a draft is judged by its target's acceptance, not post-trained on rewards
)
