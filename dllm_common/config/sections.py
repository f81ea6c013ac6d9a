"""The config's sections (pipeline, data, tokenizer, model, train with its peft, tracking, dllm) and what every
section shares (`ConfigSection`: unknown keys, infinities and booleans for numbers refused; `refuse_long_warmup`;
`special_file`: a FIFO, device or socket where a file is read).
The eval and dflash sections are `evaluation` and `dflash`; the whole pipeline is `spec.PipelineSpec`."""

from __future__ import annotations

import os
import re
import stat
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from dllm_common.config.context import MAX_SEQ_LEN
from dllm_common.config.errors import shown


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


class ConfigSection(BaseModel):
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


class PipelineConfig(ConfigSection):
    name: str = "dllm"
    strategies: tuple[str, ...] = ("mdlm",)
    # "<flow>/<deployment>" that trains one strategy (e.g. "dllm-train/train-gpu" on the gpu work pool);
    # None trains in the pipeline's own process. The workdir must be on storage both can see.
    train_deployment: str | None = None
    # "<flow>/<deployment>" that runs one strategy's grpo stage (e.g. "dllm-grpo/grpo-gpu" on the gpu work pool);
    # None runs it in the pipeline's own process (docs/post-training.md, "The GRPO stage")
    grpo_deployment: str | None = None
    # strategies trained at once (each training, then its evaluation, as soon as its inputs are ready): locally
    # in separate processes, with train_deployment as concurrent deployment runs (one GPU worker each)
    max_parallel: int = Field(1, ge=1)

    @field_validator("name")
    @classmethod
    def _name_fits_everything_named_after_it(cls, name: str) -> str:
        if not PIPELINE_NAME.fullmatch(name):
            fixed = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")[:100] or "dllm"
            raise ValueError(
                f"pipeline.name {shown(name)} must be 1 to 100 letters, digits, '.', '_' or '-', starting with a "
                "letter or digit: it names the MLflow experiment, runs and registered models (NAME-STRATEGY); e.g. "
                f"{fixed!r}"
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


def special_file(path: str | os.PathLike) -> str | None:
    """What `path` is when it is something no config or data file can be: 'a FIFO (named pipe)', 'a character
    device', 'a block device' or 'a socket' (a symlink is followed); None for a file, a directory or nothing there
    (a missing path is named where it is read). A stat alone: nothing is opened, so a FIFO is never waited on."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing, a symlink loop, a name with a NUL byte
        return None
    kinds = {
        stat.S_ISFIFO: "a FIFO (named pipe)",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((kind for test, kind in kinds.items() if test(mode)), None)


# the longest document (or row) prepare_data tokenizes, in characters: a book is 1-5 million, and tokenizing 10
# million takes about 2 GB with the BPE trained here (a 100 MB line made the tokenizer abort the process);
# refused before any tokenizer sees it (docs/operations.md, "Bad input: refused as early as it can be seen")
MAX_DOCUMENT_CHARS = 10_000_000
# what each source reads from data.path, named when data.path is something else
DATA_PATH_EXPECTED = {
    "jsonl": "a .jsonl file",
    "parquet": "a .parquet file or a directory of them",
    "hf": "a directory written by Dataset.save_to_disk (or a dataset name)",
}


class TaskConfig(ConfigSection):
    """A verifiable task family generated in the project (`data.source: task`, docs/post-training.md): one
    problem per document, its reference answer the assistant turn."""

    family: Literal["arithmetic", "countdown", "sudoku4"] = "arithmetic"
    problems: int = Field(1000, ge=2)
    max_operand: int = Field(50, ge=1)  # arithmetic and countdown: the largest number in a problem
    blanks: int = Field(6, ge=1, le=12)  # sudoku4: blank cells (kept only while the solution stays unique)


class DataConfig(ConfigSection):
    """Where text comes from and how it becomes fixed-length training rows."""

    source: Literal["shakespeare", "jsonl", "parquet", "hf", "task"] = "shakespeare"
    task: TaskConfig | None = None  # data.source task: which problems
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
    # a longer document, or row, is refused naming its file and line (or row) before it is tokenized
    max_document_chars: int = Field(MAX_DOCUMENT_CHARS, ge=1)
    # dialogue rows (docs/post-training.md, "Chat SFT"): true, the row after a conversation's last assistant turn
    # is EOS, noised and supervised (LLaDA's SFT, Automodel's DLLMCollator); false, PAD at loss 0
    supervise_eos_fill: bool = True
    eos_fill_block: int | None = Field(None, ge=1)  # the EOS fill ends with the block it starts in (block samplers)

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
        if self.source == "task":
            if self.task is None:
                raise ValueError("data.source task needs a data.task section, e.g. {family: arithmetic}")
            if self.shape != "dialogue":
                raise ValueError("data.source task gives one dialogue per problem: set data.shape: dialogue")
            return self
        if self.task is not None:
            raise ValueError(f"data.task is read only with data.source task (data.source is {self.source!r})")
        if self.source != "shakespeare" and not self.path:
            raise ValueError(f"data.path is required when data.source is {self.source!r}")
        return self

    @model_validator(mode="after")
    def _path_is_no_pipe_or_device(self) -> DataConfig:
        # a stat at load, so `dllm-flow validate` refuses it: opened, a FIFO waits for a writer and /dev/zero never
        # ends a line; prepare_data reads its input three times, which a stream cannot give back
        kind = special_file(self.path) if self.source != "shakespeare" and self.path else None
        if kind:
            raise ValueError(
                f"data.path {self.path!r} is {kind}, not a file: prepare_data reads its data three times, which a "
                f"pipe, device or socket cannot give back; save the data as {DATA_PATH_EXPECTED[self.source]} and "
                "point data.path there"
            )
        return self


class TokenizerConfig(ConfigSection):
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


class ModelConfig(ConfigSection):
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


class PeftConfig(ConfigSection):
    """Parameter-efficient fine-tuning of the backbone (peft). Strategy-owned modules stay trainable."""

    method: Literal["lora"] = "lora"
    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    merge: bool = False  # publish merged weights (a plain checkpoint) instead of base + adapter


class TrainConfig(ConfigSection):
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


class TrackingConfig(ConfigSection):
    uri: str | None = None  # None → sqlite database inside the workdir
    experiment: str | None = None  # None → pipeline.name
    register_model: bool = True
    log_checkpoints: bool = True


class DLLMSection(ConfigSection):
    """Strategy options shared by the pipeline's strategies, plus per-strategy `overrides`, e.g.
    `{block_diffusion: {block_size: 16}}`. Each strategy declares its own typed options
    (strategies/options.py), which validate these values; `shared()` is what was set here."""

    model_config = ConfigDict(extra="allow", frozen=True)

    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def shared(self) -> dict[str, Any]:
        return dict(self.model_extra or {})
