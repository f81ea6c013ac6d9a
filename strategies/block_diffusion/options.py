"""Block diffusion's options, samplers, model shape and registration (torch-free: config validation reads them
without the class)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field, model_validator

from dllm_common.config import ConfigError, PipelineSpec
from strategies.registration import (
    TEMPERATURE_AND_CUTS,
    Registration,
    SamplerInfo,
    StrategyOptions,
    refuse_longer_than_rows,
)

# the model shapes a checkpoint records (`config.dllm_architecture`): our stack over a causal LM, and
# transformers' DiffusionGemmaForBlockDiffusion (docs/strategies.md §9.5)
BLOCK_DIFFUSION = "block_diffusion"
DIFFUSION_GEMMA = "diffusion_gemma"
ARCHITECTURES = {"diffusion_gemma": DIFFUSION_GEMMA, "stack": BLOCK_DIFFUSION}  # option value → model shape
GEMMA_KEYS = ("num_experts", "top_k_experts", "moe_intermediate_size")  # what sizes a tiny DiffusionGemma


class BlockDiffusionOptions(StrategyOptions):
    """Encoder + noised canvas (docs/strategies.md §8.6, §9). `vocab_size` None: the model's.

    `architecture`: "diffusion_gemma" trains transformers' `DiffusionGemmaForBlockDiffusion` (a tiny one sized
    from `model:` and the expert keys below, or a DiffusionGemma checkpoint as `model.path`); "stack" wraps a
    causal LM (`model.family`, or any pretrained causal LM: AR → block diffusion) in `BlockDiffusionLM`."""

    vocab_size: int | None = Field(None, ge=2)
    block_size: int = Field(256, ge=1)
    self_conditioning_p: float = Field(0.5, ge=0, le=1)
    encoder_loss_weight: float = Field(1.0, ge=0)
    # how a canvas token's own evidence enters the prediction (docs/strategies.md §5.4); "learned": the reference's,
    # the default for diffusion_gemma (whose canvas barely learns its context under "analytic", §9.5); "analytic":
    # the default for stack
    own_token_evidence: Literal["analytic", "learned"] = "learned"
    architecture: Literal["diffusion_gemma", "stack"] = "diffusion_gemma"
    # a tiny DiffusionGemma's mixture of experts (it has no dense option: 1 expert for every token is the smallest)
    num_experts: int = Field(1, ge=1)
    top_k_experts: int = Field(1, ge=1)
    moe_intermediate_size: int | None = Field(None, ge=1)  # None: a third of the dense MLP's width

    @model_validator(mode="before")
    @classmethod
    def _evidence_default(cls, data):
        """An unset `own_token_evidence` is "analytic" for `stack` (docs/strategies.md §5.4)."""
        if isinstance(data, dict) and data.get("architecture") == "stack":
            return {"own_token_evidence": "analytic", **data}
        return data

    @model_validator(mode="after")
    def _experts(self) -> BlockDiffusionOptions:
        if self.top_k_experts > self.num_experts:
            raise ValueError(
                f"top_k_experts ({self.top_k_experts}) is larger than num_experts ({self.num_experts}): each "
                f"token goes to top_k_experts of the experts; set top_k_experts to at most {self.num_experts}"
            )
        given = [k for k in GEMMA_KEYS if k in self.model_fields_set]
        if self.architecture == "stack" and given:
            raise ValueError(
                f"{', '.join(given)} size a DiffusionGemma's experts and do not apply to architecture 'stack' (a "
                "causal LM has none): drop them, or set architecture: diffusion_gemma"
            )
        return self

    def check_against(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        super().check_against(spec, where)
        if self.architecture == "diffusion_gemma":
            self._check_gemma(spec, where)
        # the default (256) may exceed short rows: one canvas block per row, as block_size = seq_len; a value
        # written in the config that is longer than a row is a mistake
        if "block_size" in self.model_fields_set:
            refuse_longer_than_rows(spec, where("block_size"), self.block_size, " (data.seq_len: one block per row)")

    def _check_gemma(self, spec: PipelineSpec, where: Callable[[str], str]) -> None:
        """What a DiffusionGemma cannot be: untied, LoRA-adapted, or a pretrained checkpoint resized by options."""
        arch = where("architecture")
        if spec.model.kind == "tiny" and not spec.model.tie_embeddings:
            raise ConfigError(
                f"model.tie_embeddings is false, but {arch} diffusion_gemma ties its LM head, encoder and decoder "
                "through one switch (tie_word_embeddings: false would give the encoder a copy of every layer): set "
                f"model.tie_embeddings: true, or {arch}: stack"
            )
        if spec.train.peft is not None:
            raise ConfigError(
                f"train.peft with {arch} diffusion_gemma: LoRA would put separate adapters on the encoder's and "
                f"the decoder's copy of each shared layer, untying them; unset train.peft, or set {arch}: stack"
            )
        given = [where(k) for k in GEMMA_KEYS if k in self.model_fields_set]
        if spec.model.kind == "pretrained" and given:
            raise ConfigError(
                f"{', '.join(given)} size a tiny DiffusionGemma, but model.kind is pretrained: the checkpoint at "
                "model.path decides its experts; drop them"
            )


SAMPLERS = {
    "canvas": SamplerInfo(
        "uniform-noise canvas decoding (block_diffusion)", settings=(*TEMPERATURE_AND_CUTS, "remasking")
    ),
}

REGISTRATION = Registration(
    BlockDiffusionOptions,
    "strategies.block_diffusion.strategy:BlockDiffusionStrategy",
    SAMPLERS,
    models={
        BLOCK_DIFFUSION: "strategies.block_diffusion.model:BlockDiffusionLM",
        DIFFUSION_GEMMA: "strategies.block_diffusion.gemma:DiffusionGemmaCanvas",
    },
    evaluator="strategies.block_diffusion.evaluation:BlockDiffusionEvaluator",
    estimators=(),  # its canvas is uniform noise beside a clean encoder: no estimator of ours is built for it
)
