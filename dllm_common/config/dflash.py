"""The dflash section: a DFlash draft's target (given, or pretrained by the `pretrain_target` stage), its
features, the regenerated training rows, and the speculative decoding it is judged by."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_serializer, model_validator

from dllm_common.config.context import MAX_SEQ_LEN
from dllm_common.config.sections import ConfigSection, refuse_long_warmup

# the most tree branches verified beside a block's proposal (`dflash.eval_tree_branches`, `dllm-flow generate
# --tree-branches`; docs/strategies.md §10.16): each is a row of the target's verifying forward
MAX_TREE_BRANCHES = 16


def tree_branches_problem(branches: int, block_size: int | None, key: str, block: str) -> str | None:
    """What is wrong with `branches` tree branches (`key` names the setting: `dflash.eval_tree_branches`,
    `--tree-branches`) beside blocks of `block_size` (`block` says where that size comes from; None: not known
    yet), or None: the one bound every entry point checks. A branch puts the draft's runner-up at one of the
    block_size − 1 positions after its anchor, and each branch is a row of the target's verifying forward."""
    if branches > MAX_TREE_BRANCHES:
        return f"{key} ({branches}) is more than {MAX_TREE_BRANCHES}, the most tree branches verified beside a block"
    if block_size and branches > block_size - 1:
        return (
            f"{key} ({branches}) is more than a block of {block_size} ({block}) has proposed positions: each branch "
            f"puts the draft's runner-up at one of its {block_size - 1} positions after the anchor; set it to at most "
            f"{block_size - 1}, or 0 for no tree"
        )
    return None


# the hottest `dflash.eval_temperature`: τ_sampled is τ as a sampling server sees it (docs/evaluation.md §4.7), and
# servers sample at 0–2 (the OpenAI API's range); hotter, both distributions flatten toward uniform and τ climbs to
# the block size (every uniform proposal accepted against a uniform target), a measure of the flattening, not the draft
MAX_EVAL_TEMPERATURE = 2.0


class PretrainTargetConfig(ConfigSection):
    """The embedded default's DFlash target: a small causal LM trained on the prepared data by the
    `pretrain_target` stage. Its hidden size is the draft's (`model.hidden_size`): the draft reads
    the target's embeddings and writes through its LM head."""

    family: Literal["llama", "qwen3"] = "llama"
    num_layers: int = Field(6, ge=1)
    num_heads: int = Field(4, ge=1)
    intermediate_size: int | None = Field(None, ge=1)  # None: 3 × model.hidden_size
    steps: int = Field(600, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(30, ge=0)
    seed: int = 0
    val_every: int = Field(100, ge=1)
    val_rows: int = Field(128, ge=1)
    log_every: int = Field(10, ge=1)

    @model_validator(mode="after")
    def _warmup_within_steps(self) -> PretrainTargetConfig:
        refuse_long_warmup("dflash.pretrain", self.warmup_steps, self.steps)
        return self


class RegenerateConfig(ConfigSection):
    """Train the draft on the target's own text (DFlash paper §5.1): each training row keeps its first
    `prompt_len` tokens and the target samples the rest at `temperature`; only the continuation is
    supervised. Validation rows stay real text."""

    prompt_len: int = Field(16, ge=1)
    temperature: float = Field(0.8, ge=0)
    max_rows: int | None = Field(None, ge=1)  # None → every training row
    batch_size: int = Field(64, ge=1)
    seed: int = 0
    # true: each prompt goes to the target as one user turn through the tokenizer's chat template (the generation
    # prompt after it; `enable_thinking` for a template with that switch) and the row is the rendered prompt plus the
    # target's reply up to its end of turn: the format a chat-served draft sees (docs/strategies.md §10.13)
    chat: bool = False
    enable_thinking: bool | None = None


# evaluation keys added after configs were digested: dumped only when set otherwise, so a digest stays as it was
UNWRITTEN_DEFAULTS = {
    "eval_served": True,
    "eval_enable_thinking": None,
    "eval_temperature": 0.0,
    "eval_tree_branches": 0,
    "eval_confidence_thresholds": None,
}


class DFlashConfig(ConfigSection):
    """Where a DFlash draft's target and features come from, and how it is judged. The draft's
    training options (`block_size`, `loss_decay_gamma`, …) may be written here too: they belong to
    the strategy (`strategies.options.DFlashOptions`), which validates them."""

    model_config = ConfigDict(extra="allow", frozen=True)

    # local dir, hub id (with hub access) or `package:NAME`; None → the `pretrain_target` stage trains one
    target_model_id: str | None = None
    target_gguf_file: str | None = None  # a GGUF file inside target_model_id, converted once into the store
    target_torch_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    target_trust_remote_code: bool = False
    pretrain: PretrainTargetConfig = PretrainTargetConfig()
    regenerate: RegenerateConfig | None = None  # None → train on the prepared rows as they are
    target_layer_ids: tuple[int, ...] | None = None  # None → build_target_layer_ids(target, draft layers)
    # cached: the cache_target stage; online: a target forward per step
    target_features: Literal["cached", "online"] = "cached"
    cache_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    # speculative decoding at evaluation: held-out prompts = the first `eval_prompt_len` tokens of val rows (refused
    # at load by the dflash options' check, docs/configuration.md: a prompt as long as a row, more prompts written than
    # the rows the evaluation reads, a prompt and its continuation longer than the target's context)
    eval_prompts: int = Field(16, ge=1)
    eval_prompt_len: int = Field(16, ge=1)
    eval_max_new_tokens: int = Field(48, ge=1, le=MAX_SEQ_LEN)  # and prompt + new ≤ the target's context (at load)
    # served τ (docs/evaluation.md §4.7.1): the same prompts through z-lab's `dflash_generate`, rendered with the
    # target's chat template; `eval_enable_thinking` sets the template's thinking switch (None: its default).
    eval_served: bool = True
    eval_enable_thinking: bool | None = None
    # > 0: the same prompts also decoded by speculative sampling at this temperature (τ as a sampling server sees it,
    # where the draft's whole distribution counts, not only its argmax; docs/evaluation.md §4.7). Unwritten at 0
    eval_temperature: float = Field(0.0, ge=0)  # ≤ MAX_EVAL_TEMPERATURE
    # > 0: the same prompts also decoded greedily with this many tree branches beside each block's proposal, the draft's
    # runner-up at its likeliest rejection positions (docs/strategies.md §10.16): what a tree verifier would gain
    # (≤ MAX_TREE_BRANCHES, and at most the block's bs − 1 proposed positions: refused at load where the block is known)
    eval_tree_branches: int = Field(0, ge=0, le=MAX_TREE_BRANCHES)
    # a DSpark draft: the same prompts also decoded with confidence-scheduled verification at each θ (each block cut
    # where its predicted acceptance falls below θ; docs/strategies.md §10.17), against whole blocks (docs/evaluation.md
    # §4.7.4). Unwritten when unset
    eval_confidence_thresholds: tuple[float, ...] | None = None
    # speculative decoding: when the last n…4 tokens recur in the prompt or output, the tokens that followed
    # them there are proposed before the draft's (0: the draft alone); docs/strategies.md §10.8
    lookup_ngram: int = Field(0, ge=0, le=4)  # ≤ strategies.sampling.LOOKUP_MAX_NGRAM

    @model_serializer(mode="wrap")
    def _late_defaults_unwritten(self, handler):
        out = handler(self)
        for key, default in UNWRITTEN_DEFAULTS.items():
            if isinstance(out, dict) and key in out and out[key] == default:
                del out[key]
        return out

    @field_validator("eval_temperature")
    @classmethod
    def _temperature_a_server_samples_at(cls, value: float) -> float:
        if value > MAX_EVAL_TEMPERATURE:
            raise ValueError(
                f"dflash.eval_temperature ({value:g}) is above {MAX_EVAL_TEMPERATURE:g}: τ_sampled measures "
                f"speculative sampling as a server runs it, at 0–{MAX_EVAL_TEMPERATURE:g}; hotter, target and draft "
                "both flatten toward uniform and τ climbs to the block size whatever the draft. Set it to at most "
                f"{MAX_EVAL_TEMPERATURE:g} (0: greedy τ only)"
            )
        return value

    @field_validator("eval_confidence_thresholds")
    @classmethod
    def _thresholds_in_range(cls, value):
        bad = [t for t in value or () if not 0 < t < 1]
        if bad:
            raise ValueError(
                f"dflash.eval_confidence_thresholds {list(value)}: {bad} are not in (0, 1); each θ cuts a block where "
                "the running product of predicted acceptances (probabilities) falls below it (whole blocks are "
                "measured anyway)"
            )
        return value

    @model_validator(mode="after")
    def _target(self) -> DFlashConfig:
        if self.target_gguf_file and not self.target_model_id:
            raise ValueError("dflash.target_gguf_file needs dflash.target_model_id (the directory that holds it)")
        return self
