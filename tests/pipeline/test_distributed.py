"""Data-parallel training through torchrun (gloo, 2 CPU processes) equals the one-process run.

The same global batch (8 rows) is trained as 1 process × 2 micro-batches of 4 and as 2 processes ×
1 micro-batch of 4: same rows, same per-sample noise, counts all-reduced, backward × N under DDP.
Per-step training losses, validation losses and final weights must agree to float tolerance, and what each
layout publishes goes through the rest of the pipeline (evaluate, report)."""

import json
from pathlib import Path

import pytest
from runkit import metric_history

from tasks.train import model_dir, train

pytestmark = pytest.mark.slow


def _spec(
    tiny_spec,
    nproc: int,
    parallel: str = "ddp",
    checkpoint_every: int = 100,
    checkpoint_async=False,
    tie_embeddings: bool = True,
):
    return tiny_spec.model_copy(
        update={
            "model": tiny_spec.model.model_copy(update={"tie_embeddings": tie_embeddings}),
            "train": tiny_spec.train.model_copy(
                update={
                    "steps": 6,
                    "global_batch_size": 8,
                    "micro_batch_size": 4,
                    "val_every": 3,
                    "checkpoint_every": checkpoint_every,
                    "nproc_per_node": nproc,
                    "threads": 1,
                    "parallel": parallel,
                    "checkpoint_async": checkpoint_async,
                }
            ),
        }
    )


def _weights(ref) -> dict:
    from dllm_common.checkpoint import read_weights

    return read_weights(model_dir(ref))


def through_the_pipeline(spec, strategy, data, workdir, trained) -> dict:
    """What follows training in a pipeline: evaluate the published model (a strict load of the architecture) and
    render the report from MLflow; the evaluation's metrics."""
    from tasks.evaluate import evaluate
    from tasks.report import report

    evaluated = evaluate(spec, strategy, trained, data, str(workdir))
    rendered = report(spec.pipeline.name, [trained], [evaluated], str(workdir))
    assert f"| {strategy} |" in (Path(rendered.path) / "report.md").read_text()
    return json.loads((Path(evaluated.path) / "metrics.json").read_text())


def compare_published(one, two) -> float:
    """The same tensors under the same names (tied embeddings stored once, as the one-process run stores them);
    the largest difference."""
    wa, wb = _weights(one), _weights(two)
    assert sorted(wa) == sorted(wb)
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.fixture(scope="module")
def one_process(prepared, tiny_spec, tmp_path_factory):
    """Each (strategy, tied) of the layout matrix trained, evaluated and reported by one process."""
    data, _ = prepared
    workdir = tmp_path_factory.mktemp("one-process")
    runs = {}
    for strategy, tied in {(c[0], c[1]) for c in LAYOUTS}:
        spec = _spec(tiny_spec, 1, checkpoint_every=3, tie_embeddings=tied)
        ref = train(spec, strategy, data, str(workdir))
        runs[strategy, tied] = (ref, through_the_pipeline(spec, strategy, data, workdir, ref))
    return runs, workdir


# (strategy, tied embeddings, processes, parallel, asynchronous checkpoints): every publishing path a training can
# take — FSDP2 gathers the weights into a meta-device copy and must tie them again, DDP publishes its replica
LAYOUTS = [
    ("mdlm", True, 2, "fsdp2", False),
    ("mdlm", True, 2, "ddp", True),
    ("hybrid", False, 2, "fsdp2", False),
    ("block_diffusion", True, 2, "fsdp2", True),  # DiffusionGemma: one FSDP2 unit over shared layers
    ("mdlm", False, 1, "ddp", True),
]


@pytest.mark.parametrize(
    "strategy,tied,nproc,parallel,asynchronous",
    LAYOUTS,
    ids=[
        f"{s}-{'tied' if t else 'untied'}-{n}x{p if n > 1 else 'single'}-{'async' if a else 'sync'}"
        for s, t, n, p, a in LAYOUTS
    ],
)
def test_every_layout_publishes_what_evaluation_loads(
    prepared, tiny_spec, tmp_path, one_process, strategy, tied, nproc, parallel, asynchronous
):
    """Trained under the layout (a checkpoint every 3 steps), then evaluated and reported: the pipeline completes,
    per-step losses and validation losses equal the one-process run's, and so do the published weights."""
    data, _ = prepared
    runs, one_dir = one_process
    one, one_metrics = runs[strategy, tied]
    spec = _spec(tiny_spec, nproc, parallel, checkpoint_every=3, checkpoint_async=asynchronous, tie_embeddings=tied)
    two = train(spec, strategy, data, str(tmp_path))
    assert not two.reused and two.mlflow_run_id
    label = f"{strategy}/{'tied' if tied else 'untied'}/{nproc}x{parallel}/{'async' if asynchronous else 'sync'}"
    for key in ("train/loss", "val/loss"):
        a = metric_history(one_dir, one.mlflow_run_id, key)
        b = metric_history(tmp_path, two.mlflow_run_id, key)
        assert [s for s, _ in a] == [s for s, _ in b] and len(a) >= 2
        diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
        print(f"[measured] {label} {key}: max |1 proc − layout| = {diff:.2e} over {len(a)} steps")
        assert diff < 1e-5
    weights = compare_published(one, two)
    print(f"[measured] {label} published weights: max |1 proc − layout| = {weights:.2e}")
    assert weights < 1e-4
    metrics = through_the_pipeline(spec, strategy, data, tmp_path, two)
    for name in ("eval/nelbo", "eval/ar_nll"):
        if name in one_metrics:
            assert abs(metrics[name] - one_metrics[name]) < 1e-3, (name, metrics[name], one_metrics[name])


def test_dflash_draft_under_two_gloo_processes_matches_one_process(prepared, tiny_spec, tmp_path):
    """DDP over the DFlash draft (target frozen on every rank, cached features read per global row)."""
    from stagekit import dflash_spec

    from tasks.speculative.cache_target import cache_target
    from tasks.speculative.target import target

    data, _ = prepared
    base = dflash_spec(tiny_spec)
    shared = str(tmp_path / "shared")
    tgt = target(base, data, shared)
    inputs = {"target": tgt, "features": cache_target(base, tgt, data, shared)}
    runs = {}
    for nproc in (1, 2):
        spec = base.model_copy(update={"train": _spec(base, nproc).train})
        runs[nproc] = train(spec, "dflash", data, str(tmp_path / str(nproc)), inputs=inputs)
    a = metric_history(tmp_path / "1", runs[1].mlflow_run_id, "train/loss")
    b = metric_history(tmp_path / "2", runs[2].mlflow_run_id, "train/loss")
    assert [s for s, _ in a] == [s for s, _ in b] and len(a) == 6
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-5


def test_layout_settings_stay_out_of_the_training_key(prepared, tiny_spec):
    from tasks.train import stage_of

    data, _ = prepared
    key = lambda spec: stage_of(spec, "mdlm", data, "w")[1]  # noqa: E731
    base = key(_spec(tiny_spec, 1))
    same = [_spec(tiny_spec, 2, "ddp"), _spec(tiny_spec, 2, "fsdp2")]
    same.append(
        tiny_spec.model_copy(update={"train": _spec(tiny_spec, 1).train.model_copy(update={"micro_batch_size": 8})})
    )
    assert {key(s) for s in same} == {base}
    other = tiny_spec.model_copy(update={"train": _spec(tiny_spec, 1).train.model_copy(update={"lr": 1e-3})})
    assert key(other) != base


CHILD = """
import sys, json
from dataclasses import asdict
from dllm_common.config import validate_schema
from tasks.common import StageRef
from tasks.train import train
spec = validate_schema(json.loads(sys.argv[1]))
ref = train(spec, "mdlm", StageRef(**json.loads(sys.argv[2])), sys.argv[3])
print(json.dumps(asdict(ref)))
"""


def train_in_child(spec, data, workdir, **env):
    """`train` in a fresh interpreter (one that may be SIGKILLed, or one node of several); stdout: its StageRef."""
    import os
    import subprocess
    import sys
    from dataclasses import asdict

    from conftest import ROOT

    args = [json.dumps(spec.model_dump(mode="json")), json.dumps(asdict(data)), str(workdir)]
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *args], cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True
    )


def test_two_nodes_of_one_process_train_like_one_process(prepared, tiny_spec, tmp_path, one_process):
    """Two nodes × one process on 127.0.0.1 (static rendezvous at node 0, node rank from $NODE_RANK): the same
    global batch, so the per-step losses equal the one-process run's; node 0 publishes, node 1 waits for it."""
    from conftest import free_port

    from tasks.common import StageRef

    data, _ = prepared
    runs, one_dir = one_process
    one = runs["mdlm", True][0]
    base = _spec(tiny_spec, 1, checkpoint_every=3)
    two_nodes = base.model_copy(
        update={"train": base.train.model_copy(update={"nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{free_port()}"})}
    )
    nodes = [train_in_child(two_nodes, data, tmp_path / "two", NODE_RANK=str(r)) for r in (0, 1)]
    refs = [StageRef(**json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1])) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0] and refs[0].path == refs[1].path and refs[0].key == one.key
    a, b = _losses(one_dir, one), _losses(tmp_path / "two", refs[0])
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(6))
    diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    print(f"[measured] 2 nodes x 1 process vs 1 process: max per-step loss difference {diff:.1e}")
    assert diff < 1e-5
    layout = json.loads((Path(refs[0].path) / "model" / "dllm.json").read_text())["layout"]
    assert layout["nodes"] == 2 and layout["processes"] == 2


def _losses(workdir, ref):
    return metric_history(workdir, ref.mlflow_run_id, "train/loss")


@pytest.mark.parametrize(
    "before,after", [((2, "fsdp2"), (1, "ddp")), ((1, "ddp"), (2, "ddp")), ((2, "ddp"), (2, "fsdp2"))]
)
def test_a_checkpoint_resumes_at_another_world_size_and_layout(
    prepared, tiny_spec, tmp_path, one_process, monkeypatch, capfd, before, after
):
    """Killed after the step-3 checkpoint under one layout, resumed under another: the loss curve continues
    the uninterrupted one-process run's (same global batch, data order and noise; DCP reshards the state)."""
    data, _ = prepared
    runs, one_dir = one_process
    full = runs["mdlm", True][0]  # trained with checkpoints every 3 steps too
    work = str(tmp_path / "resumed")
    # SIGKILL at the start of step 5 (6 for the asynchronous checkpoint, swapped in once written, a step or two on)
    monkeypatch.setenv("DLLM_FLOW_FAULT", "train.step=kill@6" if before[1] == "fsdp2" else "train.step=kill@5")
    if before[0] == 1:  # a kill would take pytest with it: run the one-process attempt in a child
        child = train_in_child(_spec(tiny_spec, *before, checkpoint_every=3), data, work)
        assert child.wait(timeout=600) == -9
    else:
        with pytest.raises(RuntimeError, match="torchrun for train\\[mdlm\\] exited"):
            # FSDP2 writes its checkpoint asynchronously (train.checkpoint_async): swapped in a step later
            spec = _spec(tiny_spec, *before, checkpoint_every=3, checkpoint_async=before[1] == "fsdp2")
            train(spec, "mdlm", data, work)
    monkeypatch.delenv("DLLM_FLOW_FAULT")
    checkpoint = next((tmp_path / "resumed" / "store" / "train").glob("*.work/checkpoint"))
    assert json.loads((checkpoint / "dllm.json").read_text())["step"] == 3
    capfd.readouterr()
    resumed = train(_spec(tiny_spec, *after, checkpoint_every=3), "mdlm", data, work)
    assert "train[mdlm]: resuming from the step-3 checkpoint" in capfd.readouterr().out
    a, b = _losses(one_dir, full), _losses(tmp_path / "resumed", resumed)
    assert [s for s, _ in b] == list(range(6)) and [s for s, _ in a] == list(range(6))
    diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    with capfd.disabled():
        print(f"[measured] resumed {before} -> {after}: max per-step loss difference {diff:.1e}")
    assert diff < 1e-5
    layout = json.loads((Path(resumed.path) / "model" / "dllm.json").read_text())["layout"]
    assert layout["processes"] == after[0] and layout["parallel"] == (after[1] if after[0] > 1 else "single")
    assert compare_published(full, resumed) < 1e-4  # tied embeddings stored once, as one process stores them
    through_the_pipeline(_spec(tiny_spec, *after, checkpoint_every=3), "mdlm", data, tmp_path / "resumed", resumed)


def test_a_full_disk_during_a_sharded_checkpoint_is_one_line(prepared, tiny_spec, tmp_path, monkeypatch):
    """FSDP2 over 2 processes, the disk full while the ranks write their shards of the step-4 checkpoint: DCP's
    wrapped failure (a BaseException holding every rank's traceback) reaches the command as the one-line disk-full
    error, and the step-2 checkpoint is kept."""
    from dllm_common.store import DiskFullError

    data, _ = prepared
    monkeypatch.setenv("DLLM_FLOW_FAULT", "checkpoint.shards=enospc@2")  # each rank's second checkpoint write
    with pytest.raises(DiskFullError) as err:
        train(_spec(tiny_spec, 2, "fsdp2", checkpoint_every=2), "mdlm", data, str(tmp_path))
    checkpoint = next((tmp_path / "store" / "train").glob("*.work/checkpoint"))
    assert str(err.value) == (
        f"train[mdlm]: no space left on the device while writing the step-4 checkpoint in {checkpoint} (the step-2 "
        "checkpoint is kept; the partial write is removed): free space (or point --workdir at a larger disk), then "
        "`dllm-flow resume` continues from the kept checkpoint"
    )
    assert json.loads((checkpoint / "dllm.json").read_text())["step"] == 2
