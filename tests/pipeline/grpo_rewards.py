"""Reward functions the GRPO stage tests name as `module:function` entry points (importable on their own, as a user's
module is: no test fixtures)."""

import os


def shorter(prompts, completions, **_):
    """Fewer characters, more reward: keeps a tiny model's groups informative when it answers nothing right."""
    return [-float(len(c)) for c in completions]


def flaky(prompts, completions, **_):
    """Whether a completion is non-empty, until the call numbered $DLLM_TEST_FAIL_AT (then it raises: the stage dies
    mid-run). `flaky.calls` counts the calls."""
    flaky.calls = getattr(flaky, "calls", 0) + 1
    if flaky.calls == int(os.environ.get("DLLM_TEST_FAIL_AT", "0")):
        raise RuntimeError("killed")
    return [float(bool(c.strip())) for c in completions]


def raises(prompts, completions, **_):
    raise ValueError("no answer field")


def digits(prompts, completions, **_):
    """The share of a completion's characters that are digits (0 when empty): what an answer is made of, with no
    pull towards shorter or longer completions."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]


def length_target(prompts, completions, target, **_):
    """Closer to the row's `target` number of characters, more reward: a reward that needs a field of the prompts
    file's rows (a KeyError-free call proves the stage passed it)."""
    return [-abs(len(c) - int(t)) for c, t in zip(completions, target)]
