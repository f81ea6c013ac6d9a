"""Data-parallel training through torchrun (gloo, 2 CPU processes) equals the one-process run.

The same global batch (8 rows) is trained as 1 process × 2 micro-batches of 4 and as 2 processes ×
1 micro-batch of 4: same rows, same per-sample noise, counts all-reduced, backward × N under DDP.
Per-step training losses, validation losses and final weights must agree to float tolerance."""

import pytest
from test_train import _metric_history

from tasks.train import model_dir, train

pytestmark = pytest.mark.slow


def _spec(tiny_spec, nproc: int, parallel: str = "ddp", checkpoint_every: int = 100):
    return tiny_spec.model_copy(
        update={
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
                }
            )
        }
    )


@pytest.mark.parametrize("strategy,parallel", [("block_diffusion", "ddp"), ("hybrid", "fsdp2")])
def test_two_gloo_processes_match_one_process(prepared, tiny_spec, tmp_path, strategy, parallel):
    from safetensors.torch import load_file

    data, _ = prepared
    one = train(_spec(tiny_spec, 1), strategy, data, str(tmp_path / "one"))
    # FSDP2 also writes a mid-run checkpoint (gathered full weights + optimizer state)
    two = train(
        _spec(tiny_spec, 2, parallel, checkpoint_every=3 if parallel == "fsdp2" else 100),
        strategy,
        data,
        str(tmp_path / "two"),
    )
    assert not two.reused and two.mlflow_run_id
    for key in ("train/loss", "val/loss"):
        a = _metric_history(tmp_path / "one", one.mlflow_run_id, key)
        b = _metric_history(tmp_path / "two", two.mlflow_run_id, key)
        assert [s for s, _ in a] == [s for s, _ in b] and len(a) >= 2
        diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
        print(f"{strategy}/{parallel} {key}: max |1 proc − 2 procs| = {diff:.2e} over {len(a)} steps")
        assert diff < 1e-5
    wa = load_file(str(model_dir(one) / "model.safetensors"))
    wb = load_file(str(model_dir(two) / "model.safetensors"))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4


def test_dflash_draft_under_two_gloo_processes_matches_one_process(prepared, tiny_spec, tmp_path):
    """DDP over the DFlash draft (target frozen on every rank, cached features read per global row)."""
    from test_dflash_stages import _dflash_spec

    from tasks.cache_target import cache_target
    from tasks.target import target

    data, _ = prepared
    base = _dflash_spec(tiny_spec)
    shared = str(tmp_path / "shared")
    tgt = target(base, data, shared)
    inputs = {"target": tgt, "features": cache_target(base, tgt, data, shared)}
    runs = {}
    for nproc in (1, 2):
        spec = base.model_copy(update={"train": _spec(base, nproc).train})
        runs[nproc] = train(spec, "dflash", data, str(tmp_path / str(nproc)), inputs=inputs)
    a = _metric_history(tmp_path / "1", runs[1].mlflow_run_id, "train/loss")
    b = _metric_history(tmp_path / "2", runs[2].mlflow_run_id, "train/loss")
    assert [s for s, _ in a] == [s for s, _ in b] and len(a) == 6
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-5
