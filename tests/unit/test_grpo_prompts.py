"""GRPO's prompts from a JSONL file (docs/post-training.md, "Prompts"): rows read with their fields, every malformed
file refused with one line naming the line to fix, fields handed to the rewards as TRL hands a dataset's columns,
and the configuration that goes with them."""

import json
from pathlib import Path

import pytest

from dllm_common.config import ConfigError
from strategies.options import validate_config
from tasks.posttrain.prompts import read_prompt_rows, reward_fields, training_prompts

TASK = {
    "pipeline": {"name": "t", "strategies": ["mdlm"]},
    "data": {"source": "task", "shape": "dialogue", "task": {"family": "arithmetic", "problems": 50}},
}


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    return path


def test_rows_keep_their_fields(tmp_path):
    path = _file(tmp_path, '{"prompt": "2+2=", "answer": "4", "level": 1}\n\n{"prompt": "x?", "tags": ["a"]}\n')
    rows = read_prompt_rows(path)
    assert [r.prompt for r in rows] == ["2+2=", "x?"]
    assert rows[0].fields == {"answer": "4", "level": 1} and rows[0].answer == "4" and rows[1].answer is None
    fields = reward_fields(rows, [True, False])
    assert fields == {"answer": ["4", None], "level": [1, None], "tags": [None, ["a"]], "ended": [True, False]}


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "holds no row"),
        ('{"prompt": "a"}\n{"prompt": \n', "line 2 is not JSON"),
        ('["a"]\n', 'line 1 is a list, not an object with a "prompt"'),
        ('{"prompt": ""}\n', r'line 1 has no "prompt" string \(keys: none\)'),
        ('{"question": "a", "answer": 1}\n', r"line 1 has no \"prompt\" string \(keys: \['answer', 'question'\]\)"),
    ],
)
def test_a_malformed_file_is_one_line_naming_what_to_fix(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        read_prompt_rows(_file(tmp_path, text))


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        read_prompt_rows(tmp_path / "none.jsonl")


def test_the_configuration_prompts_need(tmp_path, monkeypatch):
    path = _file(tmp_path, json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    monkeypatch.chdir(tmp_path)
    spec = validate_config({**TASK, "grpo": {"prompts": "p.jsonl", "rewards": ["math_answer"]}})
    assert spec.grpo.prompts == str(path.resolve())  # absolute: torchrun's processes start elsewhere
    assert [r.prompt for r in training_prompts(spec)] == ["1+1="]
    # no generated task needed when the prompts come from a file
    other = {**TASK, "data": {"source": "jsonl", "path": "d.jsonl", "shape": "dialogue"}}
    validate_config({**other, "grpo": {"prompts": str(path), "rewards": ["math_answer"]}})
    with pytest.raises(ConfigError, match="data.source: task .* or grpo.prompts"):
        validate_config({**other, "grpo": {"rewards": ["math_answer"]}})
    with pytest.raises(ConfigError, match="grpo.rewards task_answer scores the generated task's problems"):
        validate_config({**TASK, "grpo": {"prompts": str(path)}})
    # without a file: the task's training problems, with the fields the task rewards read
    rows = training_prompts(validate_config({**TASK, "grpo": {}}))
    assert rows and all(r.fields["problem"].prompt == r.prompt and r.answer == r.fields["problem"].answer for r in rows)
