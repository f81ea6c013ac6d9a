"""An evaluation records its settings on the MLflow run its metrics land in: a training reused by a later pipeline
with other evaluation settings gets that evaluation's metrics too, and its run's page says which settings
produced which values (tags `dllm.eval.<key>`, `dllm.eval.latest`, `dllm.eval.note`) instead of mixing them."""

import json

from mlflow.tracking import MlflowClient

from dllm_common.tracking import default_tracking_uri


def test_a_second_evaluation_of_a_reused_training_records_its_settings(prepared, tiny_spec, tmp_path):
    from tasks.evaluate import eval_slice, evaluate
    from tasks.train import train

    data, _ = prepared
    workdir = str(tmp_path / "w")
    trained = train(tiny_spec, "mdlm", data, workdir)
    first = evaluate(tiny_spec, "mdlm", trained, data, workdir)
    hotter = tiny_spec.model_copy(update={"eval": tiny_spec.eval.model_copy(update={"temperature": 0.5})})
    again = train(hotter, "mdlm", data, workdir)  # eval settings are not in the training's key: reused
    assert again.reused and again.mlflow_run_id == trained.mlflow_run_id
    second = evaluate(hotter, "mdlm", again, data, workdir)
    assert second.key != first.key

    run = MlflowClient(default_tracking_uri(workdir)).get_run(trained.mlflow_run_id)
    tags = run.data.tags
    a, b = first.key[:12], second.key[:12]
    assert json.loads(tags[f"dllm.eval.{a}"]) == eval_slice(tiny_spec, "mdlm")
    assert json.loads(tags[f"dllm.eval.{b}"]) == eval_slice(hotter, "mdlm")
    assert json.loads(tags[f"dllm.eval.{b}"])["eval"]["temperature"] == 0.5
    assert tags["dllm.eval.latest"] == b
    assert tags["dllm.eval.note"].startswith(f"this run holds 2 evaluations with different settings ({a}, {b}); ")
    assert f"the metrics' latest values are evaluation {b}'s" in tags["dllm.eval.note"]
    # each evaluation's files are under its own key
    client = MlflowClient(default_tracking_uri(workdir))
    assert {f.path for f in client.list_artifacts(trained.mlflow_run_id, "eval")} == {f"eval/{a}", f"eval/{b}"}


def test_one_evaluation_leaves_no_note(prepared, tiny_spec, tmp_path):
    from tasks.evaluate import evaluate
    from tasks.train import train

    data, _ = prepared
    workdir = str(tmp_path / "w")
    trained = train(tiny_spec, "mdlm", data, workdir)
    evaluated = evaluate(tiny_spec, "mdlm", trained, data, workdir)
    evaluate(tiny_spec, "mdlm", trained, data, workdir)  # reused: logged once, the same key
    tags = MlflowClient(default_tracking_uri(workdir)).get_run(trained.mlflow_run_id).data.tags
    assert tags["dllm.eval.latest"] == evaluated.key[:12] and "dllm.eval.note" not in tags
