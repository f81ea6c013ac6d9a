"""`PipelineSpec`, the whole pipeline, and the checks that span its sections (samples and rows that fit the
model's context, a model to publish when nothing is trained, [MASK] not EOS or PAD, one rendezvous per node)."""

from __future__ import annotations

from pydantic import model_validator

from dllm_common.config.context import MAX_CHARS_PER_TOKEN, MAX_SEQ_LEN, context_overflow, local_max_positions
from dllm_common.config.dflash import DFlashConfig
from dllm_common.config.evaluation import EvalConfig
from dllm_common.config.posttrain import GRPOConfig
from dllm_common.config.sections import (
    ConfigSection,
    DataConfig,
    DLLMSection,
    ModelConfig,
    PipelineConfig,
    TokenizerConfig,
    TrackingConfig,
    TrainConfig,
)


class PipelineSpec(ConfigSection):
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
    grpo: GRPOConfig | None = None  # reinforcement learning after training (docs/post-training.md)

    @property
    def chat_rows(self) -> bool:
        """The model trains on chat-rendered rows: dialogue data, or a DFlash draft on chat-regenerated rows."""
        regenerate = self.dflash.regenerate
        return self.data.shape == "dialogue" or bool(regenerate is not None and regenerate.chat)

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
    def _grpo_has_prompts(self) -> PipelineSpec:
        if self.grpo is not None and self.grpo.prompts is None and self.data.source != "task":
            raise ValueError(
                f"grpo: needs prompts with verifiable answers: data.source: task (a generated task family, "
                f"docs/post-training.md) or grpo.prompts (a JSONL file of prompts); data.source is "
                f"{self.data.source!r}"
            )
        if self.grpo is None and self.pipeline.grpo_deployment is not None:
            raise ValueError(
                "pipeline.grpo_deployment is set but there is no grpo section: nothing would run on it; remove the "
                "key or add the section"
            )
        if self.grpo is not None and self.data.shape != "dialogue":
            raise ValueError("grpo: tunes a chat model: set data.shape: dialogue (the SFT before it)")
        return self

    @model_validator(mode="after")
    def _one_rendezvous_per_node(self) -> PipelineSpec:
        if self.train.nnodes > 1 and self.pipeline.max_parallel > 1:
            raise ValueError(
                "train.nnodes > 1 with pipeline.max_parallel > 1: concurrent multi-node trainings would share node "
                "0's rendezvous port; train the strategies one after another (pipeline.max_parallel: 1)"
            )
        return self
