"""The declarative pipeline config: YAML → typed, frozen models with every default in one place.

Unknown keys are rejected; every error names the dotted key path, the bad value and what is
allowed (see `ConfigError`). A pipeline file is read by `strategies.options.load_config`, which adds
the strategies' checks.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A config problem a person can fix; the message lists every offending key."""


class TrainingDiverged(ConfigError):
    """A NaN or infinite loss, gradient norm or weight: the training stopped at that step and nothing was
    published. A user error: a setting (most often the learning rate) is what to change (docs/operations.md)."""


def _numeric(annotation) -> bool:
    """A field that takes a number (int or float, optionally None) and never a boolean."""
    args = [a for a in (get_args(annotation) or (annotation,)) if a is not type(None)]
    if get_origin(annotation) is Annotated:
        args = [get_args(annotation)[0]]
    return bool(args) and all(a in (int, float) for a in args)


def refuse_boolean_number(model: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """YAML reads true/false/yes/no as booleans and pydantic would take them as 1/0: refuse that for every
    numeric field (a `field_validator("*", mode="before")` of each config model)."""
    field = model.model_fields.get(info.field_name or "")
    if isinstance(value, bool) and field is not None and _numeric(field.annotation):
        raise ValueError("expected a number, not a boolean (YAML reads true/false/yes/no as booleans)")
    return value


class _Section(BaseModel):
    # no config value is infinite or NaN: `train.lr: .inf` would train on NaN weights from the second step
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_boolean_number(cls, value, info)


# pipeline.name names the MLflow experiment (by default), runs, datasets and registered models (NAME-STRATEGY, which
# MLflow refuses with '/' or ':', and `models:/NAME@ALIAS` URIs would misread with '@'): checked at load, not after
# the training that registers the model
PIPELINE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class PipelineConfig(_Section):
    name: str = "dllm"
    strategies: tuple[str, ...] = ("mdlm",)
    # "<flow>/<deployment>" that trains one strategy (e.g. "dllm-train/train-gpu" on the gpu work pool);
    # None trains in the pipeline's own process. The workdir must be on storage both can see.
    train_deployment: str | None = None
    # strategies trained at once (each training, then its evaluation, as soon as its inputs are ready): locally
    # in separate processes, with train_deployment as concurrent deployment runs (one GPU worker each)
    max_parallel: int = Field(1, ge=1)

    @field_validator("name")
    @classmethod
    def _name_fits_everything_named_after_it(cls, name: str) -> str:
        if not PIPELINE_NAME.fullmatch(name):
            fixed = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")[:100] or "dllm"
            raise ValueError(
                f"pipeline.name {name!r} must be 1 to 100 letters, digits, '.', '_' or '-', starting with a letter or "
                f"digit: it names the MLflow experiment, runs and registered models (NAME-STRATEGY); e.g. {fixed!r}"
            )
        return name

    @model_validator(mode="after")
    def _strategies(self) -> PipelineConfig:
        # which names exist is the strategy registry's to say (strategies/options.py checks them)
        if not self.strategies:
            raise ValueError("pipeline.strategies is empty; list at least one strategy")
        if len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies must be unique, got {list(self.strategies)}")
        return self


# the longest training row dllm-flow accepts (2^20 positions): a tiny model is built with data.seq_len positions, so
# without a bound `data.seq_len: 10000000` would validate and only fail once a stage allocates its rows
MAX_SEQ_LEN = 1 << 20
# a generous bound on a prompt's characters per token, whatever the tokenizer (English text averages about 4): a
# prompt with more characters than its model's positions × this cannot fit, and is refused before it is tokenized
MAX_CHARS_PER_TOKEN = 32


class DataConfig(_Section):
    """Where text comes from and how it becomes fixed-length training rows."""

    source: Literal["shakespeare", "jsonl", "parquet", "hf"] = "shakespeare"
    path: str | None = None  # local file/dir for jsonl/parquet; dataset name or path for hf
    hf_config: str | None = None
    hf_split: str = "train"
    shape: Literal["pretrain", "dialogue"] = "pretrain"
    text_field: str = "text"
    messages_field: str = "messages"
    document_field: str | None = None  # groups rows into documents for the train/val split
    seq_len: int = Field(128, ge=8)
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    max_documents: int | None = Field(None, ge=2)
    max_train_rows: int | None = Field(None, ge=1)
    max_val_rows: int | None = Field(256, ge=1)
    seed: int = 0
    num_proc: int | None = Field(None, ge=1)  # tokenizing processes (None: every core, at most 8); not in the key

    @field_validator("seq_len")
    @classmethod
    def _seq_len_bounded(cls, seq_len: int) -> int:
        if seq_len > MAX_SEQ_LEN:
            raise ValueError(
                f"data.seq_len ({seq_len}) is more than {MAX_SEQ_LEN} positions, the longest training row dllm-flow "
                f"accepts; lower data.seq_len"
            )
        return seq_len

    @model_validator(mode="after")
    def _path_needed(self) -> DataConfig:
        if self.source != "shakespeare" and not self.path:
            raise ValueError(f"data.path is required when data.source is {self.source!r}")
        return self


class TokenizerConfig(_Section):
    kind: Literal["train_bpe", "pretrained"] = "train_bpe"
    vocab_size: int = Field(2048, ge=300)
    min_frequency: int = Field(2, ge=1)
    path: str | None = None  # local dir or hub id for kind=pretrained
    gguf_file: str | None = None  # a GGUF file inside `path` (transformers reads its tokenizer)
    trust_remote_code: bool = False
    allow_mask_alias: bool = False  # true: a [MASK] id that is also the EOS or PAD id is trained with (mask_alias.py)

    @model_validator(mode="after")
    def _path_needed(self) -> TokenizerConfig:
        if self.kind == "pretrained" and not self.path:
            raise ValueError("tokenizer.path is required when tokenizer.kind is 'pretrained'")
        return self


class ModelConfig(_Section):
    kind: Literal["tiny", "pretrained"] = "tiny"
    family: Literal["llama", "qwen3"] = "llama"
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int | None = Field(None, ge=1)  # None: num_heads (no grouped-query attention)
    intermediate_size: int | None = Field(None, ge=1)  # None: 3 × hidden_size
    tie_embeddings: bool = True
    path: str | None = None  # local dir or hub id for kind=pretrained
    gguf_file: str | None = None
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2"] = "sdpa"

    @model_validator(mode="after")
    def _shape(self) -> ModelConfig:
        if self.kind == "pretrained" and not self.path:
            raise ValueError("model.path is required when model.kind is 'pretrained'")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})"
            )
        if (self.hidden_size // self.num_heads) % 2:  # both families use rotary position embeddings
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) ÷ model.num_heads ({self.num_heads}) = "
                f"{self.hidden_size // self.num_heads} dimensions per head, which must be even (rotary position "
                "embeddings rotate pairs of dimensions); change model.hidden_size or model.num_heads"
            )
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            fits = [k for k in range(1, self.num_heads + 1) if self.num_heads % k == 0]
            raise ValueError(
                f"model.num_kv_heads ({self.num_kv_heads}) must divide model.num_heads ({self.num_heads}): each "
                f"key/value head serves the same number of query heads; use one of {fits}"
            )
        return self


class PeftConfig(_Section):
    """Parameter-efficient fine-tuning of the backbone (peft). Strategy-owned modules stay trainable."""

    method: Literal["lora"] = "lora"
    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    merge: bool = False  # publish merged weights (a plain checkpoint) instead of base + adapter


class TrainConfig(_Section):
    # 0: nothing is trained; the train stage publishes model.path's model as it is (model.kind: pretrained), e.g.
    # an imported DFlash draft, to evaluate (docs/strategies.md §10.10)
    steps: int = Field(200, ge=0)
    global_batch_size: int = Field(32, ge=1)  # sequences per optimizer step, over all ranks and micro-batches
    micro_batch_size: int = Field(32, ge=1)  # sequences per forward on one rank
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(20, ge=0)  # at most `steps` (equal: train.lr is reached at the last step, no decay)
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW's moment decay rates, each in [0, 1)
    grad_clip: float = Field(1.0, gt=0)
    # a step whose loss or gradient norm is NaN or infinite stops the training (nothing is published); up to this
    # many such steps are skipped instead (no update; counted in train/skipped_steps). Not part of the stage key:
    # it only decides whether a training that meets such a step fails or goes on (docs/operations.md)
    skip_nonfinite_steps: int = Field(0, ge=0)
    seed: int = 0  # model init, data order and corruption noise
    log_every: int = Field(10, ge=1)
    val_every: int = Field(50, ge=1)
    val_rows: int = Field(64, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    checkpoint_async: bool = False  # write checkpoints in the background while training goes on
    device: Literal["auto", "cpu", "cuda"] = "auto"
    nproc_per_node: int = Field(1, ge=1)
    # multi-node (docs/architecture.md, "Scale-out"): this train stage is one node of `nnodes`; node 0 hosts the
    # rendezvous at `rdzv_endpoint` (else $MASTER_ADDR:$MASTER_PORT) and publishes the result; the node's rank is
    # `node_rank`, else $NODE_RANK, $JOB_COMPLETION_INDEX (a Kubernetes Indexed Job) or $SLURM_NODEID
    nnodes: int = Field(1, ge=1)
    rdzv_endpoint: str | None = None
    node_rank: int | None = Field(None, ge=0)
    parallel: Literal["ddp", "fsdp2"] = "ddp"  # with nproc_per_node > 1: replicate (DDP) or shard (FSDP2) the model
    threads: int | None = Field(None, ge=1)
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast the forward (weights and optimizer stay fp32)
    activation_checkpointing: bool = False  # recompute each layer's activations in backward
    # the LM head runs inside the loss, only at the positions it scores, chunk by chunk (docs/strategies.md §5.9)
    fused_head: bool = True
    head_chunk_rows: int | None = Field(None, ge=1)  # rows per head chunk (None: 64 MiB of fp32 logits)
    compile: bool = False  # torch.compile each decoder layer (regional compilation; docs/strategies.md §5.9)
    peft: PeftConfig | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):  # NaN fails too
            raise ValueError(
                f"train.betas must be two numbers in [0, 1) (AdamW's decay rates of its gradient moments, e.g. "
                f"[0.9, 0.98]), got {list(betas)}"
            )
        return betas

    @model_validator(mode="after")
    def _warmup_within_steps(self) -> TrainConfig:
        if self.steps:  # no schedule runs when nothing is trained
            refuse_long_warmup("train", self.warmup_steps, self.steps)
        return self

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainConfig:
        per_rank = self.global_batch_size // self.world_size
        if self.global_batch_size % self.world_size or per_rank % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of train.nnodes × "
                f"train.nproc_per_node × train.micro_batch_size ({self.nnodes} × {self.nproc_per_node} × "
                f"{self.micro_batch_size}): the global batch stays the global batch on any number of processes"
            )
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ValueError(f"train.node_rank ({self.node_rank}) must be below train.nnodes ({self.nnodes})")
        if self.rdzv_endpoint is not None and not re.fullmatch(r"[\w.\-\[\]:]+:\d+", self.rdzv_endpoint):
            raise ValueError(
                f"train.rdzv_endpoint ({self.rdzv_endpoint!r}) must be HOST:PORT, e.g. trainer-0.trainer:29500"
            )
        return self


def refuse_long_warmup(section: str, warmup_steps: int, steps: int) -> None:
    """The LR schedule ramps up over `warmup_steps`: longer than the training, it never reaches the learning rate.
    Equal is allowed: the last step trains at the full rate (and nothing is left to decay)."""
    if warmup_steps > steps:
        raise ValueError(
            f"{section}.warmup_steps ({warmup_steps}) is larger than {section}.steps ({steps}): the learning rate "
            f"would still be ramping up when training ends and never reach {section}.lr; set {section}.warmup_steps "
            f"to at most {steps}"
        )


class ScorerConfig(_Section):
    """Frozen causal LM that scores samples (generative perplexity); samples are retokenized for it."""

    path: str  # local dir, hub id (when the user has hub access) or `package:NAME`
    gguf_file: str | None = None  # converted once and kept in the stage store
    trust_remote_code: bool = False


class LMEvalConfig(_Section):
    """lm-evaluation-harness tasks run by the evaluate stage on the trained model (docs/evaluation.md §4.10);
    needs the `lmeval` extra. Hub tasks need hub access; `include_path` adds a folder of local task YAMLs."""

    tasks: tuple[str, ...] = Field(min_length=1)  # task or group names, as `lm_eval --tasks` takes them
    include_path: str | None = None
    mc_samples: int = Field(32, ge=1)  # Monte-Carlo ELBO samples per request (diffusion strategies)
    limit: int | None = Field(None, ge=1)  # documents per task (None: all)
    batch_size: int = Field(8, ge=1)  # rows per forward
    num_fewshot: int | None = Field(None, ge=0)  # None: each task's own


# Open-ended sampling defaults (docs/strategies.md §11.7), chosen by measurement against the data row.
OPEN_ENDED_TEMPERATURE = 1.0
OPEN_ENDED_TOP_P = 0.95


class SamplerSettings(_Section):
    """One strategy's own sampling settings for the report's samples (`eval.overrides.<strategy>`): the keys
    set here replace `eval:`'s for that strategy alone; the rest are `eval:`'s."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    remasking: Literal["low_confidence", "random"] | None = None
    threshold: float | None = Field(None, gt=0, le=1)

    @model_validator(mode="after")
    def _null_only_turns_threshold_off(self) -> SamplerSettings:
        nulls = sorted(k for k in self.model_fields_set if k != "threshold" and getattr(self, k) is None)
        if nulls:
            raise ValueError(
                f"{', '.join(nulls)}: null is not a setting (only threshold: null, which turns the shared one off); "
                f"remove the key to keep eval.{nulls[0]}"
            )
        return self

    def values(self) -> dict[str, Any]:
        """The keys this entry sets (unset ones stay `eval:`'s, also after a save and reload)."""
        return self.model_dump(mode="json", include=self.model_fields_set)


class EvalConfig(_Section):
    val_rows: int = Field(128, ge=1)  # validation rows scored by the NELBO
    t_samples: int = Field(8, ge=1)  # stratified diffusion times per row
    batch_size: int = Field(32, ge=1)
    seed: int = 1234
    num_samples: int = Field(4, ge=0)
    sample_length: int = Field(48, ge=1)
    data_rows: int = Field(32, ge=1)  # held-out rows of the data row (docs/evaluation.md §4.4)
    sample_steps: int = Field(48, ge=1)
    sample_block_size: int = Field(16, ge=1)
    # how the report's samples are drawn (docs/strategies.md §11.7): the settings a user would pick for open-ended
    # text; `generate` defaults to the same. `greedy`: also decode at temperature 0 (the report's second table)
    temperature: float = Field(OPEN_ENDED_TEMPERATURE, ge=0)
    top_p: float = Field(OPEN_ENDED_TOP_P, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    greedy: bool = True
    threshold: float | None = Field(None, gt=0, le=1)  # confidence-threshold parallel decoding (absorbing samplers)
    prompts: tuple[str, ...] = ("To be, or not to be", "My lord,", "What say you", "O")
    # step budgets of the quality-vs-NFE curve; empty → sample_steps, ½ and ¼ of it
    nfe_budgets: tuple[Annotated[int, Field(ge=1)], ...] = ()
    scorer: ScorerConfig | None = None  # None → no eval/gen_ppl (eval/entropy is always reported)
    lm_eval: LMEvalConfig | None = None  # None → no lm-evaluation-harness tasks
    # per-strategy sampling settings, e.g. `{scdd: {temperature: 1.3}}` (docs/strategies.md §11.7): a sampler
    # whose open-ended settings differ from the shared ones; the report names every strategy's settings
    overrides: dict[str, SamplerSettings] = Field(default_factory=dict)

    @field_serializer("overrides")
    def _only_what_each_entry_sets(self, overrides: dict[str, SamplerSettings]) -> dict[str, dict[str, Any]]:
        # a saved config (run record, MLflow params, stage keys) reloads to the same entries, not to explicit nulls
        return {name: own.values() for name, own in overrides.items()}

    def for_strategy(self, name: str) -> EvalConfig:
        """These settings as `name` is evaluated: its `overrides` entry applied (and kept, alone, as the record of
        what it set), the other strategies' entries dropped. Validated again as a whole."""
        own = self.overrides.get(name)
        merged = {**self.model_dump(exclude={"overrides"}), **(own.values() if own is not None else {})}
        return EvalConfig.model_validate({**merged, "overrides": {name: own.values()} if own is not None else {}})

    def budgets(self) -> list[int]:
        raw = self.nfe_budgets or (self.sample_steps, self.sample_steps // 2, self.sample_steps // 4)
        out: list[int] = []
        for b in raw:
            if b >= 1 and b not in out:
                out.append(int(b))
        return out


class TrackingConfig(_Section):
    uri: str | None = None  # None → sqlite database inside the workdir
    experiment: str | None = None  # None → pipeline.name
    register_model: bool = True
    log_checkpoints: bool = True


class DLLMSection(_Section):
    """Strategy options shared by the pipeline's strategies, plus per-strategy `overrides`, e.g.
    `{block_diffusion: {block_size: 16}}`. Each strategy declares its own typed options
    (strategies/options.py), which validate these values; `shared()` is what was set here."""

    model_config = ConfigDict(extra="allow", frozen=True)

    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def shared(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class PretrainTargetConfig(_Section):
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


class RegenerateConfig(_Section):
    """Train the draft on the target's own text (DFlash paper §5.1): each training row keeps its first
    `prompt_len` tokens and the target samples the rest at `temperature`; only the continuation is
    supervised. Validation rows stay real text."""

    prompt_len: int = Field(16, ge=1)
    temperature: float = Field(0.8, ge=0)
    max_rows: int | None = Field(None, ge=1)  # None → every training row
    batch_size: int = Field(64, ge=1)
    seed: int = 0


class DFlashConfig(_Section):
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
    target_layer_ids: tuple[int, ...] | None = None  # None → _build_target_layer_ids(target, draft layers)
    # cached: the cache_target stage; online: a target forward per step
    target_features: Literal["cached", "online"] = "cached"
    cache_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    # speculative decoding at evaluation: held-out prompts = the first `eval_prompt_len` tokens of val rows
    eval_prompts: int = Field(16, ge=1)
    eval_prompt_len: int = Field(16, ge=1)
    eval_max_new_tokens: int = Field(48, ge=1)
    # speculative decoding: when the last n…4 tokens recur in the prompt or output, the tokens that followed
    # them there are proposed before the draft's (0: the draft alone); docs/strategies.md §10.8
    lookup_ngram: int = Field(0, ge=0, le=4)  # ≤ strategies.dflash_draft.LOOKUP_MAX_NGRAM

    @model_validator(mode="after")
    def _target(self) -> DFlashConfig:
        if self.target_gguf_file and not self.target_model_id:
            raise ValueError("dflash.target_gguf_file needs dflash.target_model_id (the directory that holds it)")
        return self


class PipelineSpec(_Section):
    """A whole pipeline: what `dllm-flow run CONFIG` executes."""

    pipeline: PipelineConfig = PipelineConfig()
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    dllm: DLLMSection = DLLMSection()
    dflash: DFlashConfig = DFlashConfig()

    @model_validator(mode="after")
    def _samples_fit_the_context(self) -> PipelineSpec:
        # a tiny model's context (max_position_embeddings) is data.seq_len, and so is the embedded DFlash target's;
        # a pretrained model's is checked once its config is read, before training (tasks/evaluate.py)
        if self.model.kind == "tiny" and self.dflash.target_model_id is None:
            problem = context_overflow(
                1,
                self.eval.sample_length,
                self.data.seq_len,
                prompt="the shortest eval.prompts entry",
                new="eval.sample_length",
                context_of="the model's context (data.seq_len, a tiny model's max_position_embeddings)",
            )
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _rows_fit_a_pretrained_model(self) -> PipelineSpec:
        # a tiny model is built with data.seq_len positions; a pretrained one holds what its config says
        if self.model.kind == "pretrained" and self.model.gguf_file is None:
            context = local_max_positions(self.model.path)
            if context is not None and self.data.seq_len > context:
                raise ValueError(
                    f"data.seq_len ({self.data.seq_len}) is more than model.path {self.model.path!r} holds (its "
                    f"max_position_embeddings is {context}); lower data.seq_len to at most {context}"
                )
        return self

    @model_validator(mode="after")
    def _prompts_can_fit(self) -> PipelineSpec:
        # by characters, before any tokenizer sees them: the tokenized prompts are checked before training
        # (tasks/evaluate.py), but a prompt of megabytes would exhaust the memory on its way there
        context, what = self._sampling_context()
        limit = context * MAX_CHARS_PER_TOKEN
        for i, prompt in enumerate(self.eval.prompts):
            if len(prompt) > limit:
                raise ValueError(
                    f"eval.prompts[{i}] is {len(prompt)} characters, more than {limit} ({what} of {context} positions "
                    f"× {MAX_CHARS_PER_TOKEN} characters, more than any token holds): it cannot fit; shorten it"
                )
        return self

    def _sampling_context(self) -> tuple[int, str]:
        """(positions, what they are) of the longest context a sample's prompt may fill, read without loading
        anything: data.seq_len for a tiny model, a local pretrained model's max_position_embeddings, else
        MAX_SEQ_LEN."""
        pretrained = [self.model.path] if self.model.kind == "pretrained" else []
        pretrained += [self.dflash.target_model_id] if self.dflash.target_model_id is not None else []
        if not pretrained:
            return self.data.seq_len, "the model's context (data.seq_len)"
        contexts = [local_max_positions(path) for path in pretrained]
        if None in contexts:
            return MAX_SEQ_LEN, "the longest context dllm-flow accepts"
        return max(contexts), "the model's context (max_position_embeddings)"

    @model_validator(mode="after")
    def _nothing_to_train_needs_a_model(self) -> PipelineSpec:
        if self.train.steps == 0 and self.model.kind != "pretrained":
            raise ValueError(
                "train.steps is 0: nothing is trained, and the train stage publishes model.path's model as it is (e.g. "
                "an imported DFlash draft to evaluate); that needs model.kind: pretrained and model.path, or set "
                "train.steps to at least 1"
            )
        return self

    @model_validator(mode="after")
    def _mask_is_not_eos_or_pad(self) -> PipelineSpec:
        from dllm_common.mask_alias import config_mask_alias_problem

        d = self.dllm
        problem = config_mask_alias_problem(self.tokenizer, d.shared(), d.overrides, self.pipeline.strategies)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _one_rendezvous_per_node(self) -> PipelineSpec:
        if self.train.nnodes > 1 and self.pipeline.max_parallel > 1:
            raise ValueError(
                "train.nnodes > 1 with pipeline.max_parallel > 1: concurrent multi-node trainings would share node "
                "0's rendezvous port; train the strategies one after another (pipeline.max_parallel: 1)"
            )
        return self


def local_max_positions(path: str | None) -> int | None:
    """`max_position_embeddings` from a local model folder's config.json (`package:NAME` is an installed package's
    folder), read as JSON without importing anything; None for a hub id, a GGUF file or a config that has none."""
    if not path:
        return None
    folder = Path(path).expanduser()
    if path.startswith("package:"):
        import importlib.util

        try:
            found = importlib.util.find_spec(path.split(":", 1)[1])
        except (ImportError, ValueError):
            return None
        if found is None or found.origin is None:
            return None
        folder = Path(found.origin).parent
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") if isinstance(config, dict) else None):
        positions = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0:
            return positions
    return None


def context_overflow(
    prompt_tokens: int,
    new_tokens: int,
    context: int,
    *,
    prompt: str = "--prompt",
    new: str = "--max-new-tokens",
    context_of: str = "the model's context",
    spans: str = "",
) -> str | None:
    """What is wrong when a prompt of `prompt_tokens` and `new_tokens` generated after it do not fit a model's
    `context` of positions (None: they fit), naming the settings to change: `dllm-flow generate`'s flags, or
    `eval.prompts` and `eval.sample_length` for the evaluation's samples (one rule, one wording for both)."""
    if prompt_tokens > context:
        return f"{prompt} is {prompt_tokens} tokens{spans}, longer than {context_of} of {context} positions; shorten it"
    if prompt_tokens + new_tokens <= context:
        return None
    room = context - prompt_tokens
    fix = f"lower {new} to at most {room}" if room >= 1 else f"shorten {prompt} to leave room"
    tokens = f"{prompt_tokens} token{'s' if prompt_tokens != 1 else ''}"
    return (
        f"{prompt} ({tokens}) + {new} ({new_tokens}) = {prompt_tokens + new_tokens} positions, more than {context_of} "
        f"of {context}; {fix}"
    )


# ---------------------------------------------------------------- loading and errors


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<top level>"
        value = e.get("input")
        if e["type"] == "extra_forbidden":
            parent = _section_for(e["loc"][:-1])
            allowed = sorted(parent.model_fields) if parent else []
            lines.append(f"  {path}: unknown key (value {value!r}); allowed keys here: {allowed}")
        elif not e["loc"] or (e["type"] == "value_error" and f"{path}" in e["msg"]):
            # a rule that names its keys itself (across sections, or across one section's keys): its message alone,
            # not the whole section or config it was given
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {path}: {e['msg']} (got {value!r})")
    return "\n".join(lines)


def _section_for(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = PipelineSpec
    parts = iter(loc)
    for part in parts:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if get_origin(annotation) is dict:  # `dict[str, Section]` (eval.overrides): skip the key, enter the section
            annotation = get_args(annotation)[1]
            if next(parts, None) is None:
                return None
        if not isinstance(annotation, type) or not issubclass(annotation, BaseModel):
            return None
        model = annotation
    return model


class DuplicateKeyError(ValueError):
    """A key written twice in one YAML mapping: YAML itself would keep the last and drop the first, silently."""

    def __init__(self, key: str, first: int, second: int):
        self.key, self.first, self.second = key, first, second
        lines = f"on line {first}" if first == second else f"on line {first} and on line {second}"
        super().__init__(
            f"{key} appears twice ({lines}); YAML would silently keep only the second, so merge the two or delete one"
        )


# how much a document's aliases (*name) may add to what is written, in values and characters: a config repeats a
# block or two, while nested anchors (a "billion laughs" document) expand 1 KB into gigabytes once copied
ALIAS_EXPANSION_LIMIT = 1_000_000


class AliasExpansionError(ValueError):
    """A YAML document whose aliases would expand it past `ALIAS_EXPANSION_LIMIT` (or forever): refused before
    anything is built or copied from it."""


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader, refusing a mapping that holds a key twice (`DuplicateKeyError` names its dotted path and
    both lines) and aliases that expand too far (`AliasExpansionError`) before anything is built from the
    document."""

    def compose_document(self):  # yaml's own, keeping the anchors' names for the error message
        self.get_event()
        node = self.compose_node(None, None)
        self.get_event()
        self.anchor_names = {id(n): name for name, n in self.anchors.items()}
        self.anchors = {}
        return node

    def construct_document(self, node):
        _refuse_duplicate_keys(node)
        _refuse_alias_expansion(node, getattr(self, "anchor_names", {}))
        return super().construct_document(node)


def _refuse_alias_expansion(root: yaml.Node, anchor_names: dict[int, str]) -> None:
    """Size the document as it would be once every alias is copied out (values + scalar characters), counting
    each node once (memoized), so a bomb is sized in microseconds and never expanded."""
    size: dict[int, int] = {}  # expanded size of each node
    nodes: dict[int, yaml.Node] = {}
    busy: set[int] = set()

    def children(node: yaml.Node) -> list[yaml.Node]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        return []

    def expanded(node: yaml.Node) -> int:
        key = id(node)
        if key in size:
            return size[key]
        if key in busy:
            name = anchor_names.get(key, "?")
            raise AliasExpansionError(
                f"the anchor &{name} (line {node.start_mark.line + 1}) holds an alias of itself (*{name}), which "
                "would expand forever; write the value out"
            )
        busy.add(key)
        own = 1 + (len(node.value) if isinstance(node, yaml.ScalarNode) else 0)
        size[key] = own + sum(expanded(child) for child in children(node))
        busy.discard(key)
        nodes[key] = node
        return size[key]

    total = expanded(root)
    written = sum(1 + (len(n.value) if isinstance(n, yaml.ScalarNode) else 0) for n in nodes.values())
    if total - written <= ALIAS_EXPANSION_LIMIT:
        return
    uses: collections.Counter[int] = collections.Counter(id(c) for n in nodes.values() for c in children(n))
    worst = max((k for k in anchor_names if uses[k] > 1), key=lambda k: size[k] * (uses[k] - 1), default=None)
    which = (
        f" (&{anchor_names[worst]} on line {nodes[worst].start_mark.line + 1}, {size[worst]} of them, is repeated by "
        f"{uses[worst] - 1} aliases)"
        if worst is not None
        else ""
    )
    raise AliasExpansionError(
        f"its YAML aliases would expand it to {total} values and characters, more than {ALIAS_EXPANSION_LIMIT} "
        f"beyond what is written{which}; write the repeated parts out instead of nesting aliases"
    )


def _refuse_duplicate_keys(root: yaml.Node) -> None:
    queue, seen = collections.deque([(root, "")]), set()
    while queue:  # breadth first: the outermost duplicate is the one named
        node, path = queue.popleft()
        if id(node) in seen:  # an anchor used again (or a recursive structure): checked once
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            lines: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: overriding is what it is for
                    continue
                name = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.start_mark)
                where = f"{path}.{name}" if path else name
                line = key_node.start_mark.line + 1
                if (key_node.tag, name) in lines:
                    raise DuplicateKeyError(where, lines[(key_node.tag, name)], line)
                lines[(key_node.tag, name)] = line
                queue.append((value_node, where))
        elif isinstance(node, yaml.SequenceNode):
            queue.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))


def load_yaml(text: str) -> Any:
    """YAML text as Python data, refusing a key written twice (`UniqueKeyLoader`)."""
    return yaml.load(text, Loader=UniqueKeyLoader)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (['a','b','c'], value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like dotted.key=value")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {item!r} has an empty key")
    if raw == "":
        return key.strip().split("."), ""
    try:
        return key.strip().split("."), load_yaml(raw)
    except (DuplicateKeyError, AliasExpansionError) as exc:
        raise ConfigError(f"override {item!r}: {exc}") from None
    except yaml.YAMLError as exc:
        where = f" ({exc.problem})" if getattr(exc, "problem", None) else ""
        raise ConfigError(
            f"override {item!r}: the value {raw!r} is not valid YAML{where}; quote it as a string or fix the brackets"
        ) from None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    data = json.loads(json.dumps(raw))  # deep copy of plain data
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {k!r} is not a section")
            node = child
        node[keys[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {p} is a directory; pass the path of a YAML file, e.g. configs/quickstart.yaml")
    if not p.is_file():
        raise ConfigError(f"config file not found: {p} (pass the path of a YAML file, e.g. configs/quickstart.yaml)")
    try:
        raw = load_yaml(p.read_text(encoding="utf-8"))
    except (DuplicateKeyError, AliasExpansionError) as exc:
        raise ConfigError(f"config file {p}: {exc}") from None
    except RecursionError:  # yaml's parser recurses once per level of nesting
        raise ConfigError(
            f"config file {p} nests its lists or mappings too deeply to read; a pipeline config is a few levels deep"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {p} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "is it the YAML file you meant?"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
    if raw is None:
        raise ConfigError(
            f"config file {p} is empty; a pipeline needs at least its sections (start from configs/quickstart.yaml)"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def validate_schema(raw: dict, source: str = "<dict>") -> PipelineSpec:
    """`raw` checked against the schema alone; `strategies.options.validate_config` also checks every strategy's
    options, and `strategies.options.load_config` reads a pipeline file."""
    try:
        return PipelineSpec.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def canonical_json(obj: Any) -> str:
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_sha256(spec: PipelineSpec) -> str:
    return hashlib.sha256(canonical_json(spec).encode()).hexdigest()


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested config → {'train.lr': 0.003, ...} for MLflow params."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    out[prefix[:-1]] = obj
    return out
