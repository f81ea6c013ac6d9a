"""The prompts GRPO rolls out (docs/post-training.md, "Prompts"): the generated task's training problems, or the rows
of a JSONL file (`grpo.prompts`), each a `{"prompt": ..., <any other fields>}` object. A row's other fields reach the
rewards as TRL passes a dataset's columns: one list per field, aligned with the completions (`answer` is what
`math_answer` compares with; a `module:function` reward reads whatever it needs)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from dllm_common.config import ConfigError, PipelineSpec
from tasks.evaluation.chat import split_problems


@dataclass(frozen=True)
class PromptRow:
    """One prompt and the fields its rewards read (`problem` and `answer` for a generated task)."""

    prompt: str
    fields: dict = field(default_factory=dict)

    @property
    def answer(self):
        return self.fields.get("answer")


def read_prompt_rows(path: str | Path) -> list[PromptRow]:
    """Every row of a prompts JSONL file; one clear line for a missing file, a line that is not a JSON object, a row
    without a non-empty string `prompt`, or a file with no row."""
    source = Path(path)
    if not source.is_file():
        raise ConfigError(f'grpo.prompts: {source} is not a file; give a JSONL file of {{"prompt": ...}} rows')
    rows = []
    with source.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"grpo.prompts: {source} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where} is not JSON ({exc.msg}); each line holds one object") from None
            if not isinstance(row, dict):
                raise ConfigError(f'{where} is a {type(row).__name__}, not an object with a "prompt"')
            prompt = row.pop("prompt", None)
            if not isinstance(prompt, str) or not prompt.strip():
                raise ConfigError(f'{where} has no "prompt" string (keys: {sorted(row) or "none"})')
            rows.append(PromptRow(prompt, row))
    if not rows:
        raise ConfigError(f'grpo.prompts: {source} holds no row; give at least one {{"prompt": ...}} line')
    return rows


def training_prompts(spec: PipelineSpec) -> list[PromptRow]:
    """What GRPO draws its prompts from: `grpo.prompts`'s rows, else the task's training problems (never the
    held-out ones)."""
    if spec.grpo.prompts is not None:
        return read_prompt_rows(spec.grpo.prompts)
    train, _ = split_problems(spec)
    if not train:
        raise ConfigError("grpo: the task has no training problem to draw prompts from; raise data.task.problems")
    return [PromptRow(p.prompt, {"problem": p, "answer": p.answer}) for p in train]


def prompts_digest(spec: PipelineSpec) -> str | None:
    """The prompts file's content digest (part of the stage's key: edit the file and the stage runs again)."""
    if spec.grpo.prompts is None:
        return None
    return hashlib.sha256(Path(spec.grpo.prompts).read_bytes()).hexdigest()


def reward_fields(rows: list[PromptRow], ended: list[bool]) -> dict[str, list]:
    """The rows' fields as the rewards receive them: one list per field (None where a row lacks it), plus `ended`."""
    names = sorted({name for row in rows for name in row.fields})
    return {**{name: [row.fields.get(name) for row in rows] for name in names}, "ended": ended}
