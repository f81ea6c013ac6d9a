"""Fault injection: each fault must end either in a rerun that completes with the results of an undisturbed
run, or in one clear message, and every published store entry must still verify. Faults are injected with
real signals and at named points (`DLLM_FLOW_FAULT`, dllm_common/faults.py) in separate processes.

Store, checkpoint and run-record faults run against the components (a fraction of a second each); the
pipeline faults chain through one workdir, each run getting one stage further than the last."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT, free_port, stop_group, wait_http
from runkit import STEPS, environ, processes_of, run, start_run, unverified_entries, weights_digest

from dllm_common.store import Store

pytestmark = pytest.mark.slow


def child(code: str, fault: str | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with a fault planned."""
    env = environ(**({"DLLM_FLOW_FAULT": fault} if fault else {}))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---------------------------------------------------------------- the store's publish protocol

BUILD = """
import sys
from pathlib import Path
from dllm_common.store import Store
root, stage, key = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def build(out):
    (root / "builds").open("a").write("1")
    (out / "model").mkdir()
    (out / "model" / "w.bin").write_bytes(bytes(range(256)) * 64)
    (out / "info.json").write_text('{"n": 1}')
    return {"info": {"n": 1}}
entry, reused = Store(root / "store").reuse_or_build(stage, key, build)
print("reused" if reused else "built", entry.path)
"""


def build(root, fault=None, stage="train", key="k1") -> subprocess.CompletedProcess:
    code = f"import sys; sys.argv = ['x', {str(root)!r}, {stage!r}, {key!r}]\n" + BUILD
    return child(code, fault)


def reference_entry(tmp_path_factory) -> dict:
    ref = tmp_path_factory.mktemp("ref")
    assert build(ref).returncode == 0
    return json.loads((ref / "store" / "train" / "k1" / "manifest.json").read_text())["files"]


@pytest.mark.parametrize("point", ["publish.train.written", "publish.train.renaming"])
def test_sigkill_while_publishing_leaves_nothing_half_published(tmp_path, tmp_path_factory, point):
    killed = build(tmp_path, f"{point}=kill")
    assert killed.returncode == -signal.SIGKILL
    store = Store(tmp_path / "store")
    assert store.lookup("train", "k1") is None  # a reader never sees the half-written entry
    again = build(tmp_path)
    assert again.returncode == 0 and again.stdout.startswith("built")
    entry = store.lookup("train", "k1")
    assert store.verify(entry) == [] and entry.manifest["files"] == reference_entry(tmp_path_factory)
    assert not list((tmp_path / "store" / "train").glob(".tmp-*"))  # the killed builder's temp dir is cleared


def test_disk_full_while_publishing_is_one_message_and_nothing_is_left(tmp_path):
    full = build(tmp_path, "publish.train.written=enospc")
    assert full.returncode == 1
    last = full.stderr.strip().splitlines()[-1]
    assert "DiskFullError: no space left on the device while writing train/k1 under" in last
    assert "nothing was published and its temp dir is removed" in last
    assert not list((tmp_path / "store" / "train").iterdir()) or [
        p.name for p in (tmp_path / "store" / "train").iterdir()
    ] == ["k1.lock"]
    assert build(tmp_path).returncode == 0 and Store(tmp_path / "store").lookup("train", "k1") is not None


def test_two_concurrent_builders_build_once_and_agree(tmp_path):
    code = f"import sys; sys.argv = ['x', {str(tmp_path)!r}, 'train', 'k1']\nimport time\n" + BUILD.replace(
        '(out / "info.json")', 'time.sleep(2); (out / "info.json")'
    )
    env = environ()
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = sorted(p.communicate(timeout=120)[0].split()[0] for p in procs)
    assert outs == ["built", "reused"] and (tmp_path / "builds").read_text() == "1"


@pytest.mark.parametrize(
    "damage",
    ["truncated manifest", "manifest not an object", "weights truncated", "weights deleted", "weights flipped"],
)
def test_a_damaged_entry_is_set_aside_and_rebuilt_identically(tmp_path, tmp_path_factory, damage, monkeypatch):
    assert build(tmp_path).returncode == 0
    entry = tmp_path / "store" / "train" / "k1"
    manifest, weights = entry / "manifest.json", entry / "model" / "w.bin"
    if damage == "truncated manifest":
        manifest.write_text(manifest.read_text()[:50])
    elif damage == "manifest not an object":
        manifest.write_text("[1, 2]")
    elif damage == "weights truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "weights deleted":
        weights.unlink()
    else:  # same size: only a full re-hash (`--verify`) sees it
        weights.write_bytes(bytes(reversed(weights.read_bytes())))
        assert Store(tmp_path / "store").lookup("train", "k1") is not None
        monkeypatch.setenv("DLLM_FLOW_VERIFY", "full")
    assert Store(tmp_path / "store").lookup("train", "k1") is None  # reported and set aside, not reused
    code = f"import sys; sys.argv = ['x', {str(tmp_path)!r}, 'train', 'k1']\n" + BUILD
    again = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**environ(), **dict(os.environ)}, capture_output=True, text=True
    )
    assert again.stdout.startswith("built")
    assert json.loads(manifest.read_text())["files"] == reference_entry(tmp_path_factory)
    assert len(list((tmp_path / "store" / "train").glob("k1.damaged-*"))) == 1  # kept for inspection
    assert unverified_entries(tmp_path) == []


# ---------------------------------------------------------------- training checkpoints

CHECKPOINT = """
import sys
from pathlib import Path
from dllm_common.checkpoint import write_checkpoint
from strategies.models import build_model, tiny_model_config
model = build_model(tiny_model_config("llama", 32, 8, 16, 1, 2, None, None, True), seed=int(sys.argv[2]))
write_checkpoint(Path(sys.argv[1]), model, None, {"step": int(sys.argv[2])}, {"scheduler": {"step": int(sys.argv[2])}})
"""


def write_step(dest, step: int, fault=None) -> subprocess.CompletedProcess:
    return child(f"import sys; sys.argv = ['x', {str(dest)!r}, '{step}']\n" + CHECKPOINT, fault)


@pytest.mark.parametrize(
    "fault, code",
    [("checkpoint.written=kill", -signal.SIGKILL), ("checkpoint.swap=kill", -signal.SIGKILL)]
    + [("checkpoint.written=enospc", 1)],
    ids=["sigkill-mid-write", "sigkill-mid-swap", "disk-full"],
)
def test_a_fault_while_checkpointing_never_loses_the_previous_checkpoint(tmp_path, fault, code):
    from dllm_common.checkpoint import read_meta, recover_checkpoint, verify_checkpoint

    dest = tmp_path / "work" / "checkpoint"
    assert write_step(dest, 10).returncode == 0
    before = verify_checkpoint(dest)
    assert write_step(dest, 20, fault).returncode == code
    recover_checkpoint(dest)  # what the train stage does before it looks for its checkpoint
    assert verify_checkpoint(dest) == before and read_meta(dest)["step"] == 10
    assert sorted(p.name for p in dest.parent.iterdir()) == ["checkpoint"]
    assert write_step(dest, 20).returncode == 0 and read_meta(dest)["step"] == 20


def test_a_corrupt_checkpoint_is_refused_by_name(tmp_path):
    from dllm_common.checkpoint import CorruptCheckpointError, verify_checkpoint

    dest = tmp_path / "checkpoint"
    assert write_step(dest, 10).returncode == 0
    weights = dest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="model.safetensors is corrupt"):
        verify_checkpoint(dest)


# ---------------------------------------------------------------- run records and the tracking store


def test_sigkill_while_saving_a_run_record_keeps_the_previous_one(tmp_path):
    code = f"""
    from pathlib import Path
    from dllm_common.runs import RunRecord
    r = RunRecord(run_id="20261201-000000-aaaaaa", pipeline="p", config_path="c.yaml", overrides=[], config={{}},
                  config_sha256="0" * 64, pid=None)
    r.save(Path({str(tmp_path)!r}))
    r.stage("train[mdlm]").status = "RUNNING"
    r.save(Path({str(tmp_path)!r}))
    """
    assert child(code, "record.save=kill@2").returncode == -signal.SIGKILL
    from dllm_common.runs import read_records

    records, unreadable = read_records(tmp_path)
    assert unreadable == [] and [r.stages for r in records] == [[]]  # the first save, whole
    # what the kill leaves is a hidden temp file beside it, which nothing reads
    assert [p.name for p in (tmp_path / "runs").glob("*.json")] == ["20261201-000000-aaaaaa.json"]


def test_a_truncated_tracking_store_is_one_message_and_left_untouched(tmp_path):
    (tmp_path / "mlflow.db").write_bytes(b"SQLite format 3\x00" + bytes(3000))
    before = (tmp_path / "mlflow.db").read_bytes()
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "configs/smoke.yaml", "--workdir", str(tmp_path)],
        cwd=ROOT,
        env=environ(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"dllm-flow: error: MLflow store {tmp_path / 'mlflow.db'} is damaged (file is not a database); move it aside "
        f"(mv {tmp_path / 'mlflow.db'} {tmp_path / 'mlflow.db'}.damaged) to start a fresh tracking store — the stage "
        f"store under {tmp_path / 'store'} is untouched"
    ]
    assert (tmp_path / "mlflow.db").read_bytes() == before and not (tmp_path / "store").exists()


# ---------------------------------------------------------------- the pipeline, fault after fault


def statuses(workdir) -> dict:
    record = json.loads(sorted((workdir / "runs").glob("*.json"))[-1].read_text())
    return {s["name"]: s["status"] for s in record["stages"]}


def eval_numbers(workdir) -> dict:
    manifest = next(p for p in (workdir / "store" / "evaluate").glob("*/manifest.json") if ".damaged-" not in str(p))
    metrics = json.loads(manifest.read_text())["info"]["metrics"]
    return {k: v for k, v in metrics.items() if not k.endswith("per_s")}  # all but the timings


# (fault, what the run's stages look like after it); each run gets one stage further than the one before.
# Publishing is the store's, the same for every stage: a kill at each of its points (files written, renaming) is
# test_sigkill_while_publishing_leaves_nothing_half_published's on the store alone (a second, not a pipeline run);
# here one kill while publishing each of prepare_data and report shows the pipeline resuming past it
CHAIN = [
    ("publish.prepare_data.renaming=kill", {"prepare_data": "RUNNING"}),
    ("train.step=kill@15", {"prepare_data": "COMPLETED", "train[mdlm]": "RUNNING"}),
    ("checkpoint.swap=kill@2", {"prepare_data": "REUSED", "train[mdlm]": "RUNNING"}),
    ("publish.evaluate.written=enospc", {"prepare_data": "REUSED", "train[mdlm]": "COMPLETED"}),
    ("publish.report.written=kill", {"train[mdlm]": "REUSED", "evaluate[mdlm]": "COMPLETED", "report": "RUNNING"}),
]


def test_a_pipeline_killed_at_every_stage_completes_on_rerun_like_an_undisturbed_run(
    tmp_path, undisturbed, prefect_api
):
    workdir = tmp_path / "a"
    for i, (fault, expected) in enumerate(CHAIN):
        code, out, err = run(workdir, api=prefect_api, fault=fault)
        if fault.endswith("enospc"):  # one clear message, exit 2, the traceback in the log file only
            assert code == 2 and "Traceback" not in err, err[-3000:]
            line = [ln for ln in err.splitlines() if ln.startswith("dllm-flow: error:")]
            assert len(line) == 1 and "no space left on the device while writing evaluate/" in line[0]
            log = line[0].rsplit("(details: ", 1)[1].rstrip(")")
            assert "Traceback" in open(log).read()
        else:
            assert code == -signal.SIGKILL, (fault, err[-3000:])
        got = statuses(workdir)
        assert {k: got.get(k) for k in expected} == expected, (fault, got)
        assert unverified_entries(workdir) == [], fault  # every published entry still verifies
        if i == 2:  # the workdir moves between two faults: everything reused from the new place
            shutil.move(workdir, tmp_path / "b")
            workdir = tmp_path / "b"
    code, out, err = run(workdir, api=prefect_api)
    assert code == 0, err[-3000:]
    assert weights_digest(workdir) == weights_digest(undisturbed)
    assert eval_numbers(workdir) == eval_numbers(undisturbed)
    assert unverified_entries(workdir) == [] and not list((workdir / "store").rglob(".tmp-*"))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    train_runs = [
        r
        for r in client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
        if r.info.run_name == "mdlm"
    ]
    steps = sorted(m.step for m in client.get_metric_history(train_runs[0].info.run_id, "train/loss"))
    assert len(train_runs) == 1 and steps == list(range(150))  # one training run, every step logged once


def test_sigkill_of_the_main_process_leaves_no_server_behind(tmp_path):
    proc = start_run(tmp_path, fault="train.step=kill@3")  # its own local Prefect API
    proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.time() + 10
    while processes_of(tmp_path) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_of(tmp_path) == []


def test_two_concurrent_runs_on_one_workdir_build_each_stage_once(tmp_path, undisturbed, prefect_api):
    procs = [start_run(tmp_path, api=prefect_api) for _ in range(2)]
    results = [(p.wait(timeout=900), p.stderr.read()) for p in procs]
    assert [code for code, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    for stage in ("prepare_data", "train", "evaluate"):
        assert len(list((tmp_path / "store" / stage).glob("*/manifest.json"))) == 1
    records = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*.json")]
    trained = sorted(next(s["status"] for s in r["stages"] if s["name"] == "train[mdlm]") for r in records)
    assert trained == ["COMPLETED", "REUSED"]  # the second waited for the first, then reused its result
    assert weights_digest(tmp_path) == weights_digest(undisturbed) and unverified_entries(tmp_path) == []


# ---------------------------------------------------------------- servers that go away mid-run


def mlflow_server(root, port):
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    cmd += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")]
    log = root / f"server-{time.time_ns()}.log"
    proc = subprocess.Popen(cmd, cwd=root, start_new_session=True, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/health", proc, log, seconds=180)
    return proc


def test_the_tracking_server_stopping_mid_training_fails_cleanly_and_loses_nothing(tmp_path, undisturbed, prefect_api):
    root, port = tmp_path / "mlflow", free_port()
    root.mkdir()
    server = mlflow_server(root, port)
    uri = ["--set", f"tracking.uri=http://127.0.0.1:{port}"]
    workdir = tmp_path / "w"
    env_fast = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", "configs/smoke.yaml", *STEPS, *uri, "--workdir", str(workdir)],
            cwd=ROOT,
            env=environ(prefect_api, **env_fast),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while not list((workdir / "store" / "train").glob("*.work/checkpoint/dllm.json")):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        stop_group(server)
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
        line = [ln for ln in err.splitlines() if ln.startswith("dllm-flow: error:")]
        assert len(line) == 1 and "the tracking server stopped answering at step" in line[0], err[-3000:]
        checkpoint = json.loads(next((workdir / "store" / "train").glob("*.work/checkpoint/dllm.json")).read_text())
        assert f"checkpoint saved at step {checkpoint['step']}" in line[0] and checkpoint["pending_metrics"]
        server = mlflow_server(root, port)  # back, on the same store
        record = json.loads(next((workdir / "runs").glob("*.json")).read_text())
        resumed = subprocess.run(
            [sys.executable, "-m", "flows.cli", "resume", record["run_id"], "--workdir", str(workdir)],
            cwd=ROOT,
            env=environ(prefect_api, **env_fast),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"http://127.0.0.1:{port}")
        train_run = next(
            s["mlflow_run_id"]
            for s in json.loads(sorted((workdir / "runs").glob("*.json"))[-1].read_text())["stages"]
            if s["name"] == "train[mdlm]"
        )
        steps = sorted(m.step for m in client.get_metric_history(train_run, "train/loss"))
        assert steps == list(range(150))  # the metrics buffered across the outage were logged, once each
        assert weights_digest(workdir) == weights_digest(undisturbed)
    finally:
        stop_group(server)


def prefect_server(home, port):
    cmd = [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    env = environ(PREFECT_HOME=str(home))
    log = home / f"server-{time.time_ns()}.log"
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/api/health", proc, log)
    return proc


def test_the_prefect_server_restarting_mid_run_does_not_stop_it(tmp_path, undisturbed):
    home, port = tmp_path / "prefect", free_port()
    home.mkdir()
    server = prefect_server(home, port)
    workdir = tmp_path / "w"
    try:
        proc = start_run(workdir, api=f"http://127.0.0.1:{port}/api")
        while not list((workdir / "store" / "train").glob("*.work/checkpoint/dllm.json")):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        stop_group(server)
        server = prefect_server(home, port)  # the same database, back on the same port
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
        assert set(statuses(workdir).values()) == {"COMPLETED"}
        assert weights_digest(workdir) == weights_digest(undisturbed) and unverified_entries(workdir) == []
    finally:
        stop_group(server)


# ---------------------------------------------------------------- prepared rows deleted under a running pipeline


def test_prepared_rows_deleted_under_a_run_name_the_entry_and_the_resume_that_rebuilds_it(prepared, tmp_path):
    """A prepare_data entry (or a file of it) deleted while a run uses it: the stage that opens the rows next (the
    evaluation, after a training that had them memory-mapped) says which entry lost which file and that resuming
    the run rebuilds it; it used to be `[Errno 2] No such file or directory: …/val.input_ids.npy`. Run against the
    components: the pipeline-level run (train, delete, resume) takes minutes and is what this reproduces."""
    import pickle
    from types import SimpleNamespace

    from dllm_common.runs import RunRecord
    from flows.pipeline import _record_end
    from tasks.rows import MissingRowsError, load_split
    from tasks.training.runtime import Split

    data, _ = prepared
    entry = tmp_path / "store" / "prepare_data" / data.key
    shutil.copytree(data.path, entry)
    store = Store(tmp_path / "store")
    assert (
        store.verify(store.lookup("prepare_data", data.key)) == [] and Split.open(entry, "val").doc_starts is not None
    )
    (entry / "val.input_ids.npy").unlink()
    with pytest.raises(MissingRowsError) as err:
        load_split(entry, "val")
    assert isinstance(err.value, FileNotFoundError)  # a user error: exit 2
    assert str(err.value) == (
        f"val.input_ids.npy is missing from the store entry prepare_data/{data.key} ({entry}): the entry was deleted "
        "or changed while this run used it. `dllm-flow resume RUN_ID` (`dllm-flow runs` lists them), or the same "
        "`dllm-flow run` again, sets what is left of it aside and rebuilds it"
    )
    # the pipeline that hits it names its own run, and the name survives a trip through another process
    record = RunRecord(
        run_id="20261201-000000-cccccc",
        pipeline="p",
        config_path="c.yaml",
        overrides=[],
        config={},
        config_sha256="0" * 64,
        pid=None,
    )
    _record_end(err.value, record, tmp_path, SimpleNamespace(close=lambda status: None))
    resumable = pickle.loads(pickle.dumps(err.value))
    assert f"`dllm-flow resume {record.run_id}`, or the same `dllm-flow run` again" in str(resumable)
    # packed rows whose document starts are gone are refused too, not silently trained without them
    (entry / "train.doc_starts.npy").unlink()
    with pytest.raises(
        MissingRowsError, match=rf"^train\.doc_starts\.npy is missing from the store entry prepare_data/{data.key} "
    ):
        Split.open(entry, "train")
    # what `resume` does then: the damaged entry is set aside (kept) and the lookup misses, so it is rebuilt
    assert store.lookup("prepare_data", data.key) is None
    assert [p.name.split(".damaged-")[0] for p in entry.parent.glob("*.damaged-*")] == [data.key]
