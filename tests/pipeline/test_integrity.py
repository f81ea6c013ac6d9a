"""What a training leaves when it goes wrong: a non-finite step stops it with nothing published, a full disk
during a checkpoint is one line and keeps the previous checkpoint, a damaged resumable checkpoint is set aside,
and a damaged published entry rebuilt bit for bit keeps the lineage its evaluations and exports refer to."""

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from runkit import metric_history
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dllm_common import faults
from dllm_common.checkpoint import checkpoint_digest
from dllm_common.config import TrainingDiverged
from dllm_common.store import DiskFullError
from dllm_common.tracking import default_tracking_uri
from tasks.train import model_dir, train


def _spec(tiny_spec, **train):
    settings = {"steps": 6, "val_every": 3, "checkpoint_every": 2, "log_every": 1, **train}
    return tiny_spec.model_copy(update={"train": tiny_spec.train.model_copy(update=settings)})


@pytest.fixture
def fault(monkeypatch):
    """Plan a fault for this process (each test counts the points it reaches from zero)."""
    monkeypatch.setattr(faults, "_seen", {})

    def plan(spec: str | None) -> None:
        if spec is None:
            monkeypatch.delenv(faults.ENV, raising=False)
        else:
            monkeypatch.setenv(faults.ENV, spec)
        monkeypatch.setattr(faults, "_seen", {})

    return plan


def _registered(workdir) -> list[str]:
    uri = default_tracking_uri(workdir)
    return [m.name for m in MlflowClient(uri, registry_uri=uri).search_registered_models()]


def _published(workdir) -> list[str]:
    train_dir = Path(workdir) / "store" / "train"
    return [p.name for p in train_dir.glob("*") if (p / "manifest.json").is_file()] if train_dir.is_dir() else []


def test_a_nan_loss_stops_the_training_at_that_step_and_resume_can_skip_it(prepared, tiny_spec, tmp_path, fault, capfd):
    data, _ = prepared
    work = str(tmp_path / "w")
    fault("train.loss=nan@4")  # the 4th step's loss
    with pytest.raises(TrainingDiverged) as err:
        train(_spec(tiny_spec), "mdlm", data, work)
    message = str(err.value)
    assert message.startswith("train[mdlm]: the loss is nan at step 4 of 6: the weights diverged: most likely ")
    assert "train.lr (0.003) is too high" in message and "train.warmup_steps (2)" in message
    assert "Nothing was published; the step-2 checkpoint is kept: `dllm-flow resume` continues from it" in message
    assert "--set train.skip_nonfinite_steps=N" in message and "\n" not in message
    assert _published(work) == [] and _registered(work) == []
    checkpoint = next((tmp_path / "w" / "store" / "train").glob("*.work/checkpoint"))
    assert json.loads((checkpoint / "dllm.json").read_text())["step"] == 2

    # resumed with one skip allowed (not part of the key): the same step diverges again, is skipped, and the
    # training completes from the kept checkpoint; the count is recorded with the result and in MLflow
    fault("train.loss=nan@2")  # the resumed run's 2nd step is step 4 again
    capfd.readouterr()
    ref = train(_spec(tiny_spec, skip_nonfinite_steps=1), "mdlm", data, work)
    out = capfd.readouterr().out
    assert "resuming from the step-2 checkpoint" in out
    assert "the loss is nan at step 4; step skipped, no update (1 of at most 1: train.skip_nonfinite_steps)" in out
    assert json.loads((model_dir(ref) / "dllm.json").read_text())["skipped_steps"] == 1
    assert [v for _, v in metric_history(work, ref.mlflow_run_id, "train/skipped_steps")][-1] == 1
    assert _registered(work) == ["t-mdlm"]


def test_weights_that_turn_non_finite_are_never_checkpointed_or_published(prepared, tiny_spec, tmp_path, fault):
    """An update that leaves a NaN in the weights is caught before the checkpoint that follows it, although the
    step's own loss and gradient were finite (no later loss would show it after the last step)."""
    data, _ = prepared
    work = str(tmp_path / "w")
    fault("train.update=nan@3")
    with pytest.raises(TrainingDiverged) as err:
        train(_spec(tiny_spec, checkpoint_every=1), "mdlm", data, work)
    assert str(err.value) == (
        "train[mdlm]: the weights hold NaN or infinite values at step 3 of 6: the weights diverged: most likely "
        "train.lr (0.003) is too high for this model; lower it or raise train.warmup_steps (2). Nothing was "
        "published; the step-2 checkpoint is kept: `dllm-flow resume` continues from it (with `--set "
        "train.skip_nonfinite_steps=N` it skips up to N such steps instead of stopping)"
    )
    assert _published(work) == []
    fault("train.update=nan@4")  # the last step's update: nothing after it would see it
    with pytest.raises(TrainingDiverged, match="at step 6 of 6"):
        train(_spec(tiny_spec, checkpoint_every=1), "mdlm", data, work)
    assert _published(work) == [] and _registered(work) == []
    for checkpoint in (tmp_path / "w" / "store" / "train").glob("*.work/checkpoint"):
        dcp_to_torch_save(checkpoint / "shards", tmp_path / "state.pt")  # what a resume would load
        state = torch.load(tmp_path / "state.pt", weights_only=True)
        assert all(bool(v.isfinite().all()) for v in state["model"].values()), "a non-finite checkpoint was kept"


def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_keeps_the_previous_one(
    prepared, tiny_spec, tmp_path, fault
):
    data, _ = prepared
    work = str(tmp_path / "w")
    fault("checkpoint.shards=enospc@2")  # the step-4 checkpoint's shards
    with pytest.raises(DiskFullError) as err:
        train(_spec(tiny_spec), "mdlm", data, work)
    checkpoint = next((tmp_path / "w" / "store" / "train").glob("*.work/checkpoint"))
    assert str(err.value) == (
        f"no space left on the device while writing the step-4 checkpoint in {checkpoint} (the step-2 checkpoint "
        "is kept; the partial write is removed): free space (or point --workdir at a larger disk), then "
        "`dllm-flow resume` continues from the kept checkpoint"
    )
    assert json.loads((checkpoint / "dllm.json").read_text())["step"] == 2
    assert sorted(p.name for p in checkpoint.parent.iterdir() if p.name.startswith(".tmp")) == []
    fault(None)
    ref = train(_spec(tiny_spec), "mdlm", data, work)  # the disk freed: resumes and publishes
    assert json.loads((model_dir(ref) / "dllm.json").read_text())["step"] == 6


def test_a_full_disk_at_the_first_checkpoint_says_a_resume_starts_again(prepared, tiny_spec, tmp_path, fault):
    """No earlier checkpoint: the line does not promise one to continue from."""
    data, _ = prepared
    fault("checkpoint.shards=enospc@1")  # the step-2 checkpoint, the first
    with pytest.raises(DiskFullError) as err:
        train(_spec(tiny_spec), "mdlm", data, str(tmp_path / "w"))
    checkpoint = next((tmp_path / "w" / "store" / "train").glob("*.work")) / "checkpoint"  # never written
    assert str(err.value) == (
        f"no space left on the device while writing the step-2 checkpoint in {checkpoint} (no earlier checkpoint; "
        "the partial write is removed): free space (or point --workdir at a larger disk), then `dllm-flow resume` "
        "starts the training again"
    )


def test_a_damaged_resumable_checkpoint_is_set_aside_and_the_training_starts_over(
    prepared, tiny_spec, tmp_path, fault, capfd
):
    data, _ = prepared
    clean = train(_spec(tiny_spec), "mdlm", data, str(tmp_path / "clean"))
    work = str(tmp_path / "w")
    fault("train.loss=nan@6")
    with pytest.raises(TrainingDiverged):
        train(_spec(tiny_spec), "mdlm", data, work)
    checkpoint = next((tmp_path / "w" / "store" / "train").glob("*.work/checkpoint"))
    shard = next((checkpoint / "shards").glob("*.distcp"))
    shard.write_bytes(bytes(reversed(shard.read_bytes())))  # same size: only the digests see it
    fault(None)
    capfd.readouterr()
    ref = train(_spec(tiny_spec), "mdlm", data, work)
    out = capfd.readouterr().out
    aside = next(checkpoint.parent.parent.glob("*.checkpoint.damaged-*"))  # kept for inspection
    assert (
        f"train[mdlm]: its step-4 checkpoint is damaged (checkpoint file {checkpoint}/shards/{shard.name} is corrupt "
        f"(sha256 mismatch, not loaded)); moved aside to {aside}; the training starts over from step 0"
    ) in out
    assert "resuming" not in out
    assert (model_dir(ref) / "model.safetensors").read_bytes() == (model_dir(clean) / "model.safetensors").read_bytes()


def test_a_repaired_entry_keeps_its_lineage_through_evaluate_report_and_export(
    prepared, tiny_spec, tmp_path, monkeypatch
):
    """A published training damaged, set aside (`run --verify`) and trained again bit for bit in a new MLflow run:
    the content digest is unchanged, so the evaluation is reused and logged to the new run, the report renders
    from the new run, and `export` finds the evaluation."""
    from tasks.commands.export import export_checkpoint
    from tasks.evaluate import evaluate
    from tasks.report import report

    data, _ = prepared
    work = str(tmp_path / "w")
    spec = _spec(tiny_spec)
    first = train(spec, "mdlm", data, work)
    evaluated = evaluate(spec, "mdlm", first, data, work)
    digest = checkpoint_digest(model_dir(first))
    weights = model_dir(first) / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(bytes(reversed(original)))  # same size: caught by the full check
    monkeypatch.setenv("DLLM_FLOW_VERIFY", "full")
    again = train(spec, "mdlm", data, work)
    assert not again.reused and again.mlflow_run_id != first.mlflow_run_id
    assert weights.read_bytes() == original  # rebuilt bit for bit
    assert checkpoint_digest(model_dir(again)) == digest
    reevaluated = evaluate(spec, "mdlm", again, data, work)
    assert reevaluated.reused and reevaluated.key == evaluated.key
    metrics = json.loads((Path(reevaluated.path) / "metrics.json").read_text())
    logged = MlflowClient(default_tracking_uri(work)).get_run(again.mlflow_run_id).data.metrics
    assert {k: logged[k] for k in metrics} == metrics  # the new run carries the evaluation
    rendered = report("t", [again], [reevaluated], work)
    assert json.loads((Path(rendered.path) / "manifest.json").read_text())["runs"][0]["run_id"] == again.mlflow_run_id
    card = (export_checkpoint(again.path, tmp_path / "export", work) / "README.md").read_text()
    assert "No evaluation found" not in card and f"| checkpoint_digest | {digest} |" in card


@pytest.mark.slow
def test_the_command_reports_a_diverged_training_in_one_line_and_resume_can_skip_it(tmp_path, prefect_api):
    """Through `dllm-flow run`: exit 2, one line naming the step and the setting, the command that resumes; then
    `dllm-flow resume RUN_ID --set train.skip_nonfinite_steps=1` continues from the kept checkpoint."""
    import subprocess
    import sys

    from conftest import ROOT
    from runkit import environ

    steps = ["--set", "train.steps=14", "--set", "train.checkpoint_every=10"]
    cmd = [sys.executable, "-m", "flows.cli", "run", "configs/smoke.yaml", *steps, "--workdir", str(tmp_path)]
    env = environ(prefect_api, DLLM_FLOW_FAULT="train.loss=nan@12")
    failed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert failed.returncode == 2, failed.stderr[-3000:]
    error = [line for line in failed.stderr.splitlines() if line.startswith("dllm-flow: error:")]
    assert len(error) == 1 and "Traceback" not in failed.stderr
    assert error[0].startswith("dllm-flow: error: train[mdlm]: the loss is nan at step 12 of 14: the weights diverged")
    assert "train.lr (0.003) is too high" in error[0] and "the step-10 checkpoint is kept" in error[0]
    run_id = json.loads(sorted((tmp_path / "runs").glob("*.json"))[-1].read_text())["run_id"]
    assert f"  resume with: dllm-flow resume {run_id} --workdir {tmp_path}" in failed.stderr
    assert _published(tmp_path) == [] and _registered(tmp_path) == []

    resume = [sys.executable, "-m", "flows.cli", "resume", run_id, "--set", "train.skip_nonfinite_steps=1"]
    env = environ(prefect_api, DLLM_FLOW_FAULT="train.loss=nan@2")  # step 12 again, the resumed run's second
    done = subprocess.run([*resume, "--workdir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from the step-10 checkpoint" in done.stdout + done.stderr
    assert "step skipped, no update (1 of at most 1" in done.stdout + done.stderr
    assert _registered(tmp_path) == ["smoke-mdlm"]
