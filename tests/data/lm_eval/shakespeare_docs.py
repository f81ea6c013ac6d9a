"""Documents of the local lm-eval tasks in this folder: each task's YAML names its loader as
`custom_dataset`, so the JSONL next to it is found from any working directory, without the hub."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _split(name: str) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def multiple_choice(**_metadata) -> datasets.DatasetDict:
    return _split("shakespeare_mc.jsonl")


def generation(**_metadata) -> datasets.DatasetDict:
    return _split("shakespeare_gen.jsonl")


def perplexity(**_metadata) -> datasets.DatasetDict:
    return _split("shakespeare_ppl.jsonl")
