"""The descriptor of a stage's work that crosses to torchrun's ranks and to GPU workers (`tasks.train.TrainJob`,
`tasks.posttrain.grpo.GRPOJob`): small values only, the config validated again on the other side."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from dllm_common.config import PipelineSpec
from strategies.options import validate_config
from tasks.common import store_for


@dataclass(frozen=True, kw_only=True)
class StageJob:
    """What one stage's processes need, as small descriptors (what crosses to torchrun's ranks and to workers): the
    config, the strategy, where the store is, the pipeline's MLflow run and the stage's key. A subclass names its
    stage (`stage`), adds its upstream descriptors (`_upstream`, `_upstream_from`) and what each rank runs (`run`)."""

    stage: ClassVar[str]
    spec: PipelineSpec
    strategy: str
    workdir: str
    parent_run_id: str | None
    key: str

    def _upstream(self) -> dict:
        return {}

    @classmethod
    def _upstream_from(cls, raw: dict) -> dict:
        return {}

    def to_json(self) -> str:
        return json.dumps(
            {
                "spec": self.spec.model_dump(mode="json"),
                "strategy": self.strategy,
                "workdir": str(self.workdir),
                "parent_run_id": self.parent_run_id,
                "key": self.key,
                **self._upstream(),
            }
        )

    @classmethod
    def from_dict(cls, raw: dict) -> StageJob:
        """The job `to_json` wrote, its config validated again (strategy options included)."""
        return cls(
            spec=validate_config(raw["spec"], "torchrun args"),
            strategy=raw["strategy"],
            workdir=raw["workdir"],
            parent_run_id=raw["parent_run_id"],
            key=raw["key"],
            **cls._upstream_from(raw),
        )

    @property
    def work(self) -> Path:
        return store_for(self.workdir).work_dir(self.stage, self.key)

    @property
    def manifest_file(self) -> Path:
        """Where rank 0 leaves the published entry's manifest fields for the launching process."""
        return self.work / "manifest-fields.json"

    @property
    def label(self) -> str:
        return f"{self.stage}[{self.strategy}]"
