"""What every stage that runs a model starts with: the device it runs on and the threads it uses."""

from __future__ import annotations

import torch

from dllm_common.config import PipelineSpec


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is visible; use train.device: auto or cpu")
    return name


def stage_device(spec: PipelineSpec) -> str:
    """What every stage that runs a model starts with: `train.threads` applied, `train.device` resolved."""
    if spec.train.threads:
        torch.set_num_threads(spec.train.threads)
    return resolve_device(spec.train.device)
