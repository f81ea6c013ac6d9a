"""Stage `evaluate_grpo[strategy]`: the GRPO checkpoint evaluated as the trained one is (the evaluate stage's own
function: likelihoods, samples, held-out accuracy, logged to the GRPO run), then its held-out accuracy paired with
the trained checkpoint's, problem by problem (docs/post-training.md, "The GRPO stage"): `grpo/heldout_sft`,
`grpo/heldout_accuracy` and `grpo/heldout_gain` with its 95 % paired-bootstrap interval, logged to both runs; the
report shows them beside the trained model's numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

from dllm_common.config import PipelineSpec
from tasks import evaluate as evaluation
from tasks.common import StageRef, prefect_task, tracking_for
from tasks.evaluation.chat import paired_difference
from tasks.stages import Column, Stage

STAGE = "evaluate_grpo"


def _verdicts(ref: StageRef) -> dict[str, float]:
    path = Path(ref.path) / "problems.jsonl"
    if not path.is_file():
        raise RuntimeError(f"{ref.stage} holds no problems.jsonl ({path}): it was not evaluated on the task")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["prompt"]: float(r["correct"]) for r in rows}


def accuracy_gain(sft: StageRef, tuned: StageRef, seed: int) -> dict[str, float]:
    """Held-out accuracy of both checkpoints over the problems both answered, and the paired difference."""
    before, after = _verdicts(sft), _verdicts(tuned)
    shared = [p for p in before if p in after]
    a, b = [before[p] for p in shared], [after[p] for p in shared]
    gain, lo, hi = paired_difference(a, b, seed)
    return {
        "grpo/heldout_sft": sum(a) / len(a) if a else math.nan,
        "grpo/heldout_accuracy": sum(b) / len(b) if b else math.nan,
        "grpo/heldout_gain": gain,
        "grpo/heldout_gain_lo": lo,
        "grpo/heldout_gain_hi": hi,
        "grpo/heldout_problems": float(len(shared)),
    }


def evaluate_tuned(
    spec: PipelineSpec, strategy: str, tuned: StageRef, evaluated: StageRef, data: StageRef, workdir: str
) -> StageRef:
    """Evaluate the tuned model (or reuse its evaluation), then log the paired accuracy gain over the trained one."""
    ref = evaluation.evaluate(spec, strategy, tuned, data, workdir)
    gain = accuracy_gain(evaluated, ref, spec.eval.seed)
    tracking = tracking_for(spec, workdir)
    for run_id in {tuned.mlflow_run_id, evaluated.mlflow_run_id} - {None}:
        if not tracking.run_exists(run_id):  # a training tracked elsewhere (its run is not in this store)
            continue
        tracker = tracking.reopen(run_id)
        tracker.log_metrics(gain, step=spec.grpo.steps)
        tracker.close()
    print(
        f"[dllm-flow] grpo[{strategy}]: held-out accuracy {gain['grpo/heldout_sft']:.3f} -> "
        f"{gain['grpo/heldout_accuracy']:.3f}, "
        f"paired gain {gain['grpo/heldout_gain']:+.3f} "
        f"[{gain['grpo/heldout_gain_lo']:+.3f}, {gain['grpo/heldout_gain_hi']:+.3f}] "
        f"over {int(gain['grpo/heldout_problems'])} problems",
        flush=True,
    )
    return StageRef(
        f"evaluate_grpo[{strategy}]", ref.key, ref.path, ref.reused, ref.mlflow_run_id, {**ref.info, **gain}
    )


def stage_of(spec: PipelineSpec, strategy: str, tuned: StageRef, data: StageRef, workdir: str, **_):
    return evaluation.stage_of(spec, strategy, tuned, data, workdir)


evaluate_tuned_task = prefect_task(
    evaluate_tuned, name="evaluate", stage_of=stage_of, side_effects_for=lambda evaluated, **_: evaluated.key
)
DECLARATION = Stage(
    name=STAGE,
    task=evaluate_tuned_task,
    produces="tuned_evaluated",
    consumes={"tuned": "tuned", "evaluated": "evaluated", "data": "data"},
    per_strategy=True,
    # the paired comparison needs the task's held-out problems (prompts from a file have no held-out half)
    enabled=lambda spec: spec.grpo is not None and spec.data.source == "task",
    leader_only=True,
    report_columns=(
        Column("accuracy (trained)", "grpo/heldout_sft", 3),
        Column("accuracy (GRPO)", "grpo/heldout_accuracy", 3),
        Column("GRPO gain", "grpo/heldout_gain", 3),
        Column("gain lo", "grpo/heldout_gain_lo", 3),
        Column("gain hi", "grpo/heldout_gain_hi", 3),
    ),
)
