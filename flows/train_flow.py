"""The per-strategy flows a GPU worker runs: training for `pipeline.train_deployment`, GRPO for
`pipeline.grpo_deployment`.

Parameters are small descriptors (resolved config, the data stage's descriptor, paths); the flow
calls the same stage function as a local run (`train`, `grpo`), against the same content-addressed store,
so a deployed stage and an in-process one publish the same entry under the same key.
"""

from __future__ import annotations

from dataclasses import asdict

from prefect import flow

from tasks.common import StageRef, check_workdir


@flow(name="dllm-train")
def dllm_train(
    spec: dict, strategy: str, data: dict, workdir: str, parent_run_id: str | None = None, inputs: dict | None = None
) -> dict:
    """Train one strategy on prepared data (or reuse / resume it) and return the train stage's descriptor.
    `inputs`: descriptors of further upstream stages (dflash: `target`, `features`)."""
    from strategies.options import validate_config  # the task layer imports torch: on the worker, at run time
    from tasks.train import train

    resolved = validate_config(spec, "deployment parameters")
    check_workdir(workdir)
    ref = train(
        resolved,
        strategy,
        StageRef(**data),
        workdir,
        parent_run_id,
        {name: StageRef(**value) for name, value in (inputs or {}).items()},
    )
    return asdict(ref)


@flow(name="dllm-grpo")
def dllm_grpo(spec: dict, strategy: str, trained: dict, workdir: str, parent_run_id: str | None = None) -> dict:
    """Tune one strategy's trained model with GRPO (or reuse / resume it) and return the stage's descriptor."""
    from strategies.options import validate_config
    from tasks.posttrain.grpo import grpo

    resolved = validate_config(spec, "deployment parameters")
    check_workdir(workdir)
    return asdict(grpo(resolved, strategy, StageRef(**trained), workdir, parent_run_id))
