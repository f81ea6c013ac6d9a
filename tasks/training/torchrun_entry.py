"""The per-rank entry point of a torchrun-launched job: `python -m tasks.training.torchrun_entry ARGS.json`.

The args file names the job's class (`kind`: a training, `tasks.train.TrainJob`, or the GRPO stage's
`tasks.posttrain.grpo.GRPOJob`). Every rank joins the process group and runs the job; rank 0 writes the result
into the launching process's temp dir and leaves the manifest fields beside the checkpoint, for the launcher
to publish (`tasks.train._build`, `tasks.posttrain.grpo._build`).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from dllm_common import interrupt
from dllm_common.store import atomic_write_text
from strategies.registration import load_object
from tasks.devices import resolve_device
from tasks.training import distributed
from tasks.training.distributed import CHILD_ERROR


def main(args_path: str) -> None:
    raw = json.loads(Path(args_path).read_text())
    job = load_object(raw.get("kind", "tasks.train:TrainJob")).from_dict(raw["job"])
    if not distributed.under_torchrun():  # a lone training child: a signal checkpoints the step, then it stops
        interrupt.install()
    info = distributed.init_distributed(resolve_device(job.spec.train.device))
    try:
        fields = job.run(Path(raw["out"]), info)
        if fields is not None:
            atomic_write_text(job.manifest_file, json.dumps(fields, default=str))
    except interrupt.Interrupted as exc:
        print(f"[dllm-flow] {job.label}: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    except Exception as exc:
        # the launching process reports rank 0's error in one line, as its type (a user error stays one); the
        # traceback goes to its log file
        if info.is_main:
            record = {
                "type": type(exc).__name__,
                "bases": [c.__name__ for c in type(exc).__mro__],  # the launcher keeps the nearest it knows
                "message": str(exc),
                "traceback": traceback.format_exception(exc),
            }
            atomic_write_text(job.work / CHILD_ERROR, json.dumps(record))
        if distributed.under_torchrun():  # torchrun reports each rank's failure itself
            raise
        sys.exit(1)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
