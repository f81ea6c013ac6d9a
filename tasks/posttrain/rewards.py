"""GRPO's rewards (docs/post-training.md, "Rewards"): functions of TRL's reward shape,
`f(prompts=[...], completions=[...], **fields) -> list of floats` (one float per completion; `fields` are the rows'
columns, each a list aligned with the completions), named in `grpo.rewards` as a built-in or a "module:function"
entry point, and summed with `grpo.reward_weights`.

Built-ins, over the generated task's fields (`problem`: the `Problem` each completion answers):
- `task_answer`: 1 when the family's checker accepts the completion's answer (its first line), else 0;
- `task_format`: 1 when the completion ends (holds EOS within the rollout's length) and its answer has the family's
  shape (an integer; an expression over digits, + − × and brackets; 16 digits), else 0;
- `math_answer`: 1 when `math-verify` finds the completion's answer equal to the reference `answer` (maths answers
  in any notation it parses: 0.5 = 1/2 = \\frac{1}{2}), else 0.

A reward that raises, returns another count than the completions or a value that is not a finite number stops the
stage with one line naming the reward (checked before the first update, so nothing is published)."""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tasks.posttrain.families import Problem, check

RewardFn = Callable[..., Sequence[float]]

_SHAPES = {
    "arithmetic": re.compile(r"-?\d+"),
    "countdown": re.compile(r"[\d+\-*() ]+"),
    "sudoku4": re.compile(r"[1-4]{16}"),
}


def _answer(completion: str) -> str:
    return completion.strip().split("\n", 1)[0].strip() if completion.strip() else ""


def task_answer(prompts: list[str], completions: list[str], problem: list[Problem], **_) -> list[float]:
    return [float(check(p, c)) for p, c in zip(problem, completions)]


def task_format(prompts: list[str], completions: list[str], problem: list[Problem], ended: list[bool], **_):
    return [float(e and bool(_SHAPES[p.family].fullmatch(_answer(c)))) for p, c, e in zip(problem, completions, ended)]


def math_answer(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError(
            "grpo.rewards math_answer checks answers with math-verify: pip install math-verify (or `make install`)"
        ) from None
    out = []
    for gold, completion in zip(answer, completions):
        said = _answer(completion)
        out.append(float(bool(said) and verify(parse(gold), parse(said))))
    return out


BUILTIN: dict[str, RewardFn] = {"task_answer": task_answer, "task_format": task_format, "math_answer": math_answer}


class RewardError(ValueError):
    """A reward function that cannot be used: not found, raising, or returning something other than one finite
    number per completion."""


def resolve(name: str) -> RewardFn:
    """The function `grpo.rewards` names: a built-in, or "module:function" imported now."""
    if name in BUILTIN:
        return BUILTIN[name]
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise RewardError(f"grpo.rewards {name!r}: module {module!r} cannot be imported ({exc})") from None
    except AttributeError:
        raise RewardError(f"grpo.rewards {name!r}: module {module!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise RewardError(f"grpo.rewards {name!r} is a {type(fn).__name__}, not a function")
    return fn


@dataclass(frozen=True)
class Rewards:
    """The configured rewards and their weights: `score` gives each completion's weighted sum and each reward's
    values (logged per reward)."""

    names: tuple[str, ...]
    fns: tuple[RewardFn, ...]
    weights: tuple[float, ...]

    @classmethod
    def of(cls, grpo) -> Rewards:
        return cls(tuple(grpo.rewards), tuple(resolve(n) for n in grpo.rewards), tuple(grpo.weights()))

    def score(self, prompts: list[str], completions: list[str], fields: dict[str, list]) -> tuple[list, dict]:
        total = [0.0] * len(completions)
        each: dict[str, list[float]] = {}
        for name, fn, weight in zip(self.names, self.fns, self.weights):
            try:
                values = fn(prompts=prompts, completions=completions, **fields)
            except Exception as exc:  # a user's function: any failure is reported as that reward's
                raise RewardError(f"grpo.rewards {name!r} raised {type(exc).__name__}: {exc}") from exc
            values = _checked(name, values, len(completions))
            each[name] = values
            total = [t + weight * v for t, v in zip(total, values)]
        return total, each


def _checked(name: str, values, count: int) -> list[float]:
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise RewardError(f"grpo.rewards {name!r} returned {type(values).__name__}, not a list of numbers") from None
    if len(values) != count:
        raise RewardError(
            f"grpo.rewards {name!r} returned {len(values)} values for {count} completions; a reward returns one "
            "number per completion"
        )
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardError(
            f"grpo.rewards {name!r} returned {values[bad[0]]} for completion {bad[0]} ({len(bad)} non-finite values); "
            "a reward must be a finite number (return 0 for an unparseable answer)"
        )
    return values
