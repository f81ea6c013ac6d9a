"""The `grpo:` section: reinforcement learning with verifiable rewards after training (docs/post-training.md,
"The GRPO stage"). Present, it enables the stage `grpo[strategy]` after `train[strategy]`, and the evaluation of
its checkpoint beside the trained one's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dllm_common.config.sections import ConfigSection, PeftConfig

ESTIMATORS = ("one_step", "coupled", "exact_ar", "elbo_eubo")
BUILTIN_REWARDS = ("task_answer", "task_format", "math_answer")
TASK_REWARDS = ("task_answer", "task_format")  # they read the generated task's `problem` field
ENTRY_POINT = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class GRPOConfig(ConfigSection):
    """GRPO for dLLMs (d1, DiffuCoder): rollouts by the strategy's own sampler, group-relative advantages, μ inner
    updates of the PPO-clipped objective with a k3 KL to the frozen trained checkpoint."""

    steps: int = Field(20, ge=1)  # rollout batches (each followed by `inner_updates` optimizer steps)
    prompts_per_step: int = Field(8, ge=1)  # problems per rollout batch (divided among the ranks)
    # completions per prompt; below 2 an advantage compares nothing (refused with the reason)
    group_size: int = 8
    inner_updates: int = Field(1, ge=1)  # μ: optimizer steps on one batch of rollouts
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0, lt=1)  # PPO's ε
    beta: float = Field(0.04, ge=0)  # weight of the k3 KL to the reference (0: no reference is loaded)
    scale_rewards: bool = False  # divide each advantage by its group's std (GRPO); false: Dr. GRPO's unscaled form
    estimator: Literal["one_step", "coupled", "exact_ar", "elbo_eubo"] = "one_step"
    p_mask_prompt: float = Field(0.15, ge=0, le=1)  # one_step: share of prompt tokens masked (d1)
    # elbo_eubo (SPG): block-wise masked views per estimate, the upper bound's β, and the weight of the upper bound
    # for completions with a non-positive advantage (1: SPG w/ EUBO, 0.5: SPG w/ mixture, 0: the ELBO for both)
    likelihood_draws: int = Field(2, ge=1)
    eubo_beta: float = Field(1.5, gt=0)
    mix_weight: float = Field(0.5, ge=0, le=1)
    # a JSONL file of {"prompt": ..., <fields>} rows to draw prompts from (default: the generated task's training
    # problems); a row's other fields reach the rewards (docs/post-training.md, "Prompts")
    prompts: str | None = None
    # reward functions, summed with `reward_weights`: built-ins (BUILTIN_REWARDS) or "module:function" entry points
    # called as TRL calls a reward: f(prompts=[...], completions=[...], **row fields) -> list of floats
    rewards: tuple[str, ...] = ("task_answer",)
    reward_weights: tuple[float, ...] | None = None
    # rollouts: the strategy's sampler with these settings (steps and block size as `eval.sample_*`)
    completion_length: int = Field(8, ge=1)
    sample_steps: int = Field(8, ge=1)
    sample_block_size: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, gt=0)
    # LoRA: fresh adapters on the trained model are tuned (an SFT adapter is merged first) and the reference is the
    # same model with them switched off, so no second copy of the weights is held; `merge` publishes merged weights
    peft: PeftConfig | None = None
    seed: int = 0  # prompt order, rollouts and corruption draws
    log_every: int = Field(1, ge=1)
    checkpoint_every: int = Field(10, ge=1)

    @field_validator("group_size")
    @classmethod
    def _groups_compare(cls, g: int) -> int:
        if g < 2:
            raise ValueError(
                f"grpo.group_size is {g}: an advantage is a completion's reward minus its group's mean, so a group of "
                "one has advantage 0 and nothing is learnt; use at least 2 (d1 uses 6 to 8)"
            )
        return g

    @field_validator("prompts")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        # absolute from here on: the stage's torchrun processes and a worker start in other folders
        return None if path is None else str(Path(path).expanduser().resolve())

    @field_validator("rewards")
    @classmethod
    def _rewards_named(cls, rewards: tuple[str, ...]) -> tuple[str, ...]:
        if not rewards:
            raise ValueError("grpo.rewards is empty: name at least one reward (e.g. task_answer)")
        for name in rewards:
            if name not in BUILTIN_REWARDS and not ENTRY_POINT.fullmatch(name):
                raise ValueError(
                    f"grpo.rewards entry {name!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor a "
                    "'module:function' entry point"
                )
        return rewards

    @model_validator(mode="after")
    def _task_rewards_need_the_task(self) -> GRPOConfig:
        task_only = [r for r in self.rewards if r in TASK_REWARDS]
        if self.prompts is not None and task_only:
            raise ValueError(
                f"grpo.rewards {task_only[0]} scores the generated task's problems, which rows of grpo.prompts are "
                "not; use math_answer (it compares with a row's \"answer\") or a 'module:function' reward that reads "
                "the rows' fields"
            )
        return self

    @model_validator(mode="after")
    def _sandwich_has_no_kl(self) -> GRPOConfig:
        if self.estimator == "elbo_eubo" and self.beta != 0:
            raise ValueError(
                f"grpo.beta is {self.beta} with grpo.estimator elbo_eubo: SPG's objective is a policy gradient of "
                "likelihood bounds with no KL term and no reference model; set grpo.beta: 0"
            )
        return self

    @model_validator(mode="after")
    def _weights_match(self) -> GRPOConfig:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(
                f"grpo.reward_weights has {len(self.reward_weights)} weights for {len(self.rewards)} rewards; give one "
                "weight per reward or leave it out (every weight 1)"
            )
        return self

    def weights(self) -> tuple[float, ...]:
        return self.reward_weights if self.reward_weights is not None else (1.0,) * len(self.rewards)
