"""A stage plugs in like a strategy: one declaration, and the flow derives the DAG (docs/architecture.md, "How a stage
plugs in"). The toy stage below is the whole of a new stage: it counts the trained model's parameters, publishes the
count in the store, logs it to the strategy's MLflow run and adds a report column. The end-to-end test registers it
from this module and runs the smoke pipeline: no other file knows it exists."""

import json
import math
from pathlib import Path

import pytest
from conftest import ROOT
from safetensors import safe_open

from dllm_common.store import stage_key
from dllm_common.tracking import Tracking
from strategies import strategy_class
from strategies.options import load_config
from tasks.common import StageRef, prefect_task, stage_code_version, store_for
from tasks.stages import Column, Roles, Stage, derive, register, registered

# ---------------------------------------------------------------------------------------------- the toy stage

TOY = "count_params"


def toy_stage_of(trained: StageRef, workdir: str, **_) -> tuple[str, str]:
    return TOY, stage_key(TOY, {}, {"train": trained.key}, stage_code_version(__name__))


def count_params(
    trained: StageRef, strategy: str, workdir: str, pipeline_name: str, tracking_uri=None, experiment=None
) -> StageRef:
    """Parameters of the trained model (its safetensors header), published and logged to the training's run."""
    stage, key = toy_stage_of(trained, workdir)

    def build(out: Path) -> dict:
        with safe_open(Path(trained.path) / "model" / "model.safetensors", "pt") as f:
            count = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        (out / "count.json").write_text(json.dumps({"params": count}))
        return {"info": {"params": count}}

    entry, reused = store_for(workdir).reuse_or_build(stage, key, build)
    client = Tracking(Path(workdir), tracking_uri, experiment or pipeline_name).client
    client.log_metric(trained.mlflow_run_id, "toy/params", entry.manifest["info"]["params"])
    return StageRef.of(entry, reused, f"{TOY}[{strategy}]")


TOY_STAGE = Stage(
    name=TOY,
    task=prefect_task(
        count_params, name=TOY, stage_of=toy_stage_of, side_effects_for=lambda trained, **_: str(trained)
    ),
    produces="counted",
    consumes={"trained": "trained"},
    per_strategy=True,
    leader_only=True,
    report_columns=(Column("parameters", "toy/params", 0),),
)

# ---------------------------------------------------------------------------------------------- the derived graph


def table(config: str, *overrides: str) -> list[tuple[str, str, str]]:
    return derive(load_config(config, list(overrides), note=False), strategy_class).table()


def test_the_flow_derives_the_dflash_wing_from_the_declarations():
    assert table("configs/dflash.yaml") == [
        ("prepare_data", "–", "data"),
        ("pretrain_target", "prepare_data", "target"),
        ("regenerate", "pretrain_target, prepare_data", "regenerated"),
        ("cache_target", "pretrain_target, regenerate", "features"),
        ("train[dflash]", "regenerate, pretrain_target, cache_target", "trained"),
        ("evaluate[dflash]", "train[dflash], prepare_data", "evaluated"),
        ("report", "train[dflash], evaluate[dflash]", "report"),
    ]
    # a draft on the raw rows: no regeneration; a target from a local checkpoint is the `target` stage
    raw = table("configs/dflash.yaml", "dflash.regenerate=null")
    assert [row[0] for row in raw] == [
        "prepare_data",
        "pretrain_target",
        "cache_target",
        "train[dflash]",
        "evaluate[dflash]",
        "report",
    ]
    assert raw[2][1] == "pretrain_target, prepare_data"


def test_stages_a_pipeline_does_not_need_are_left_out():
    rows = table("configs/compare.yaml")
    assert [r[0] for r in rows] == [
        "prepare_data",
        *(
            f"{stage}[{s}]"
            for s in ("mdlm", "scdd", "hybrid", "idlm", "block_diffusion")
            for stage in ("train", "evaluate")
        ),
        "report",
    ]
    assert rows[-1][1].count("train[") == rows[-1][1].count("evaluate[") == 5


def test_a_declared_stage_joins_every_strategy_and_the_report():
    with registered(TOY_STAGE):
        rows = {r[0]: r for r in table("configs/compare.yaml")}
    assert rows["count_params[idlm]"] == ("count_params[idlm]", "train[idlm]", "counted")
    assert "count_params[mdlm]" in rows["report"][1]  # the report is keyed by what adds its columns


def test_bad_declarations_get_one_clear_error():
    orphan = Stage(name="orphan", task=TOY_STAGE.task, produces="x", consumes={"trained": "calibrated"})
    with registered(orphan), pytest.raises(ValueError, match="consumes 'calibrated' .* no stage enabled"):
        table("configs/smoke.yaml")
    with pytest.raises(ValueError, match="already declared"):
        register(Stage(name="train", task=TOY_STAGE.task, produces="x"))
    with pytest.raises(ValueError, match="identifier"):
        Stage(name="not a name", task=TOY_STAGE.task, produces="x")
    late = Stage(name="late", task=TOY_STAGE.task, produces="y", consumes={"r": "report"}, per_strategy=True)
    with registered(late), pytest.raises(ValueError, match="late\\[mdlm\\] runs per strategy but reads"):
        table("configs/smoke.yaml")
    optional = Stage(name="opt", task=TOY_STAGE.task, produces="z", consumes={"r": Roles(("nothing",), optional=True)})
    with registered(optional):
        assert ("opt", "–", "z") in table("configs/smoke.yaml")


def test_the_report_key_takes_the_reported_stages():
    from tasks.report import stage_of

    trained, evaluated = (
        StageRef("train[mdlm]", "a" * 24, "/t", mlflow_run_id="r"),
        StageRef("evaluate[mdlm]", "b" * 24, "/e"),
    )
    counted = StageRef("count_params[mdlm]", "c" * 24, "/c")
    plain = stage_of("p", [trained], [evaluated], "w")[1]
    assert stage_of("p", [trained], [evaluated], "w", {"counted": []})[1] == plain
    with_toy = stage_of("p", [trained], [evaluated], "w", {"counted": [counted]})[1]
    other = stage_of("p", [trained], [evaluated], "w", {"counted": [StageRef("count_params[mdlm]", "d" * 24, "/c")]})
    assert len({plain, with_toy, other[1]}) == 3


# ---------------------------------------------------------------------------------------------- end to end

RUN_TWICE = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests", sys.argv[1] + "/tests/pipeline"]
import test_declared_stages as toy
from flows.cli import main
from tasks.stages import register
register(toy.TOY_STAGE)
print(json.dumps([main(["run", "configs/smoke.yaml", "--workdir", sys.argv[2]]) for _ in range(2)]))
"""


@pytest.mark.slow
def test_a_stage_declared_in_a_test_module_runs_cached_and_keyed_in_the_pipeline_and_the_report(tmp_path, prefect_api):
    from runkit import run_twice
    from stagekit import expected_statuses

    workdir = tmp_path / "w"
    first, second = run_twice(RUN_TWICE, [str(ROOT), str(workdir)], workdir, prefect_api)
    statuses = [{s["name"]: s["status"] for s in r["stages"]} for r in (first, second)]
    with registered(TOY_STAGE):
        assert statuses[0] == expected_statuses("configs/smoke.yaml")  # count_params[mdlm] included
        assert statuses[1] == expected_statuses("configs/smoke.yaml", {"none"})  # every stage reused
    assert statuses[0]["count_params[mdlm]"] == "COMPLETED" and statuses[1]["count_params[mdlm]"] == "REUSED"
    # published in the store under its key, the count right
    (manifest,) = (workdir / "store" / TOY).glob("*/manifest.json")
    counted = json.loads(manifest.read_text())
    with safe_open(next((workdir / "store" / "train").glob("*/model/model.safetensors")), "pt") as f:
        params = sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys())
    assert counted["info"]["params"] == params > 10_000
    # the report's column, and the report keyed by the toy stage's result
    report = (workdir / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| strategy |"))
    row = next(line for line in report.splitlines() if line.startswith("| mdlm |"))
    cells = dict(zip(header.split("|"), row.split("|")))
    assert cells[" parameters "].strip() == str(params)
    from tasks.report import stage_of

    keys = {s["name"]: s["key"] for s in first["stages"]}
    run_id = next(s["mlflow_run_id"] for s in first["stages"] if s["name"] == "train[mdlm]")
    trained = [StageRef("train[mdlm]", keys["train[mdlm]"], "", mlflow_run_id=run_id)]
    evaluated = [StageRef("evaluate[mdlm]", keys["evaluate[mdlm]"], "")]
    toy = {"counted": [StageRef("count_params[mdlm]", keys["count_params[mdlm]"], "")]}
    assert keys["count_params[mdlm]"] == counted["key"]
    assert keys["report"] == stage_of("smoke", trained, evaluated, str(workdir), toy)[1]
    assert keys["report"] != stage_of("smoke", trained, evaluated, str(workdir))[1]
