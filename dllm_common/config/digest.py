"""A config as data: its canonical JSON, its sha256 and its flat `section.key` params (MLflow)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel

from dllm_common.config.spec import PipelineSpec


def canonical_json(obj: Any) -> str:
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_sha256(spec: PipelineSpec) -> str:
    return hashlib.sha256(canonical_json(spec).encode()).hexdigest()


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested config → {'train.lr': 0.003, ...} for MLflow params."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    out[prefix[:-1]] = obj
    return out
