"""The per-rank entry point of a torchrun-launched training: `python -m tasks.torchrun_entry ARGS.json`.

Every rank joins the process group and runs the training loop; rank 0 writes the result into the
launching process's temp dir and leaves the manifest fields beside the checkpoint, for the launcher
to publish (`tasks.train._build`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dllm_common.store import atomic_write_text
from tasks import distributed
from tasks.runtime import resolve_device
from tasks.train import TrainJob, run_training


def main(args_path: str) -> None:
    raw = json.loads(Path(args_path).read_text())
    job = TrainJob.from_dict(raw["job"])
    info = distributed.init_distributed(resolve_device(job.spec.train.device))
    try:
        fields = run_training(job, Path(raw["out"]), info)
        if fields is not None:
            atomic_write_text(job.manifest_file, json.dumps(fields, default=str))
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
