"""GRPO's rewards and its config (docs/post-training.md, "Rewards"): the built-ins against the task's checker and
against math-verify (an implementation that isn't ours), a user's `module:function`, and every bad reward or setting
refused with one line naming it."""

import math

import pytest
import torch
import yaml
from math_verify import parse, verify

from dllm_common.config import ConfigError
from strategies.options import validate_config
from tasks.posttrain.estimators import exact_ar
from tasks.posttrain.families import check, generate
from tasks.posttrain.rewards import RewardError, Rewards, math_answer, resolve, task_answer, task_format

PROBLEMS = generate("arithmetic", 40, seed=1, max_operand=30)


def _completions(problems):
    """Right, wrong, negative, padded, empty and garbage answers."""
    out = []
    for i, p in enumerate(problems):
        value = int(p.answer)
        out.append([str(value), str(value + 1), f" {value}\nmore", "", "4x", str(-value) if value else "0"][i % 6])
    return out


def test_task_answer_is_the_checker_and_math_answer_agrees_with_math_verify():
    completions = _completions(PROBLEMS)
    prompts = [p.prompt for p in PROBLEMS]
    ours = task_answer(prompts, completions, problem=PROBLEMS)
    assert ours == [float(check(p, c)) for p, c in zip(PROBLEMS, completions)]
    assert 0 < sum(ours) < len(ours)  # the set holds right and wrong answers
    maths = math_answer(prompts, completions, answer=[p.answer for p in PROBLEMS])
    oracle = [
        float(bool(c.strip()) and verify(parse(p.answer), parse(c.strip().split("\n")[0])))
        for p, c in zip(PROBLEMS, completions)
    ]
    assert maths == oracle
    assert maths == ours  # on integer answers both judges agree
    # math-verify reads notations the checker does not: 1/2 is 0.5
    assert math_answer(["x"], ["1/2"], answer=["0.5"]) == [1.0]


def test_task_format_needs_an_ending_and_the_familys_shape():
    p = PROBLEMS[0]
    assert task_format([""], ["12"], problem=[p], ended=[True]) == [1.0]
    assert task_format([""], ["12"], problem=[p], ended=[False]) == [0.0]
    assert task_format([""], ["1 2"], problem=[p], ended=[True]) == [0.0]


def constant_half(prompts, completions, **fields):
    return [0.5] * len(completions)


def test_rewards_sum_with_their_weights_and_a_user_entry_point_resolves():
    class G:
        rewards = ("task_answer", "tests.unit.test_grpo_rewards:constant_half")

        def weights(self):
            return (2.0, -1.0)

    rewards = Rewards.of(G())
    p = PROBLEMS[0]
    total, each = rewards.score([p.prompt] * 2, [p.answer, "x"], {"problem": [p, p], "answer": [p.answer] * 2})
    assert total == [2.0 - 0.5, -0.5] and each["task_answer"] == [1.0, 0.0]


def _raises(prompts, completions, **_):
    raise KeyError("answer")


def _nan(prompts, completions, **_):
    return [math.nan] * len(completions)


def _short(prompts, completions, **_):
    return [1.0]


def _text(prompts, completions, **_):
    return "yes"


@pytest.mark.parametrize(
    "fn, said",
    [
        (_raises, "raised KeyError"),
        (_nan, "returned nan for completion 0"),
        (_short, "returned 1 values for 3 completions"),
        (_text, "not a list of numbers"),
    ],
)
def test_a_bad_reward_is_one_line_naming_it(fn, said):
    rewards = Rewards(("mine:fn",), (fn,), (1.0,))
    with pytest.raises(RewardError, match=said) as info:
        rewards.score(["p"] * 3, ["a", "b", "c"], {})
    assert "'mine:fn'" in str(info.value) and "\n" not in str(info.value)


def test_an_entry_point_that_is_not_there_is_named():
    with pytest.raises(RewardError, match="cannot be imported"):
        resolve("no_such_module_here:f")
    with pytest.raises(RewardError, match="has no attribute 'nope'"):
        resolve("tests.unit.test_grpo_rewards:nope")


def _spec(**grpo):
    raw = yaml.safe_load(open("configs/sft-arithmetic.yaml"))
    raw["grpo"] = grpo
    return raw


@pytest.mark.parametrize(
    "grpo, said",
    [
        ({"group_size": 1}, "a group of one has advantage 0"),
        ({"estimator": "exact_ar"}, "mdlm cannot compute the 'exact_ar' estimate; it supports one_step, coupled"),
        ({"rewards": ["not a reward"]}, "neither a built-in reward"),
        ({"rewards": []}, "grpo.rewards is empty"),
        ({"reward_weights": [1.0, 2.0]}, "2 weights for 1 rewards"),
    ],
)
def test_bad_grpo_settings_are_refused_at_load(grpo, said):
    with pytest.raises((ConfigError, ValueError), match=said):
        validate_config(_spec(**grpo))


def test_grpo_needs_a_task_and_refuses_strategies_it_cannot_tune():
    raw = _spec()
    raw["data"] = {"source": "shakespeare", "shape": "dialogue"}
    with pytest.raises((ConfigError, ValueError), match="data.source: task"):
        validate_config(raw)
    raw = _spec()
    raw["pipeline"]["strategies"] = ["block_diffusion"]
    with pytest.raises(ConfigError, match="block_diffusion is not post-trained by grpo"):
        validate_config(raw)


def test_exact_ar_reads_each_completion_token_from_the_row_before_it():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(6, 5, generator=gen)
    shown = []

    def causal(x, attn):  # logits depend on the position and on the token there
        shown.append(x.clone())
        return table[: x.shape[1]].unsqueeze(0) + x.unsqueeze(-1).float()

    prompt, completion = torch.tensor([[1, 2]]), torch.tensor([[3, 0, 4]])
    got = exact_ar(causal, prompt, completion, None, gen)
    row = [1, 2, 3, 0, 4]
    for k in range(3):
        p = 2 + k
        want = torch.log_softmax(table[p - 1] + row[p - 1], -1)[row[p]]
        assert got[0, k].item() == pytest.approx(float(want), abs=1e-6)
    assert torch.equal(shown[0], torch.tensor([row]))


@pytest.mark.parametrize(
    "train, grpo, said",
    [
        ({"nnodes": 2, "rdzv_endpoint": "h:1"}, {}, "the grpo stage runs on one node's processes"),
        ({"nproc_per_node": 3, "parallel": "fsdp2"}, {"prompts_per_step": 8}, r"must be a multiple of the processes"),
        ({"nproc_per_node": 2, "parallel": "fsdp2"}, {"peft": {"r": 4}}, "grpo.peft under train.parallel: fsdp2"),
    ],
)
def test_layouts_the_stage_cannot_run_are_refused_at_load(train, grpo, said):
    raw = _spec(**grpo)
    raw["train"] = {**raw["train"], **train, "global_batch_size": 96, "micro_batch_size": 16}
    with pytest.raises(ConfigError, match=said):
        validate_config(raw)
    raw["train"] = {**raw["train"], "parallel": "ddp", "nnodes": 1, "nproc_per_node": 2}
    raw["train"].pop("rdzv_endpoint", None)
    validate_config(raw)  # the same grpo settings on one node's DDP-style processes
