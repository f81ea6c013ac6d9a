"""The tiny chat SFT → GRPO pipeline the GRPO tests share (the stage's own tests and the team-server deployment
test): a 1-layer model trained 30 steps on the arithmetic task, then four GRPO steps on a 4-token canvas."""

TINY_GRPO = {
    "pipeline": {"name": "grpo-tiny", "strategies": ["mdlm"]},
    "data": {
        "source": "task",
        "shape": "dialogue",
        "task": {"family": "arithmetic", "problems": 200, "max_operand": 20},
        "seq_len": 20,
        "max_val_rows": 32,
    },
    "tokenizer": {"vocab_size": 300, "min_frequency": 1000000},
    "model": {"family": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2},
    "train": {
        "steps": 30,
        "global_batch_size": 16,
        "micro_batch_size": 16,
        "lr": 3.0e-3,
        "warmup_steps": 2,
        "val_every": 30,
        "val_rows": 16,
        "log_every": 10,
        "checkpoint_every": 30,
    },
    "eval": {
        "val_rows": 16,
        "t_samples": 1,
        "num_samples": 1,
        "prompts": ["3+4="],
        "sample_length": 4,
        "sample_steps": 4,
        "sample_block_size": 4,
        "task_problems": 16,
    },
    "grpo": {
        "steps": 4,
        "prompts_per_step": 2,
        "group_size": 4,
        "completion_length": 4,
        "sample_steps": 4,
        "inner_updates": 2,
        "lr": 1.0e-3,
        # a tiny model answers almost nothing right: a reward that tells completions apart keeps the groups informative
        "rewards": ["task_answer", "task_format", "tests.pipeline.grpo_rewards:shorter"],
        "reward_weights": [1.0, 0.5, 0.1],
        "checkpoint_every": 2,
    },
}
