"""SIGINT / SIGTERM: real signals to a real `dllm-flow run`, to its process group (Ctrl-C, `timeout`) and
to the main process alone (Kubernetes). The run must end within 10 s with one line saying how to resume,
a checkpoint at the step it stopped, INTERRUPTED in the run record, KILLED MLflow runs, a Cancelled Prefect
flow run and no process left behind; resuming it must give the weights of an undisturbed run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from runkit import environ, mlflow_statuses, processes_of, start_run, weights_digest

from dllm_common import interrupt

pytestmark = pytest.mark.slow

# ---------------------------------------------------------------- the interrupt module, in this process


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    interrupt.reset()
    interrupt.install()
    yield
    interrupt.reset()
    interrupt._state.installed = False
    for s, h in saved.items():
        signal.signal(s, h)


def test_a_signal_outside_a_cooperative_section_raises_at_once(handlers):
    with pytest.raises(interrupt.Interrupted) as err:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert err.value.signame == "SIGTERM" and err.value.exit_code == 143


def test_a_cooperative_section_finishes_its_step_then_stops(handlers):
    steps = []
    with pytest.raises(interrupt.Interrupted) as err:
        with interrupt.cooperative():
            for step in range(100):
                steps.append(step)
                if step == 3:
                    os.kill(os.getpid(), signal.SIGINT)  # arrives mid-step: the step still completes
                    steps.append("rest of step 3")
                if interrupt.requested():
                    interrupt.stop(f"after step {step}")
    assert steps == [0, 1, 2, 3, "rest of step 3"]
    assert str(err.value) == "interrupted by SIGINT (after step 3)" and err.value.exit_code == 130


def test_a_section_that_never_polls_is_stopped_by_the_grace_alarm(handlers, monkeypatch):
    monkeypatch.setattr(interrupt, "GRACE_SECONDS", 1)
    t0 = time.monotonic()
    with pytest.raises(interrupt.Interrupted):
        with interrupt.cooperative():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # a step far longer than the grace period
    assert time.monotonic() - t0 < 5


def test_a_second_signal_stops_a_cooperative_section_at_once(handlers):
    with pytest.raises(interrupt.Interrupted):
        with interrupt.cooperative():
            os.kill(os.getpid(), signal.SIGTERM)
            assert interrupt.requested() == "SIGTERM"
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)


# ---------------------------------------------------------------- end to end


def wait_for_checkpoint(proc, workdir, seconds=300):
    deadline = time.time() + seconds
    while not list((workdir / "store" / "train").glob("*.work/checkpoint/dllm.json")):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.2)


def interrupt_run(workdir, sig, to_group: bool):
    proc = start_run(workdir)
    wait_for_checkpoint(proc, workdir)
    t0 = time.monotonic()
    if to_group:
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, time.monotonic() - t0, out, err


def prefect_state(workdir, flow_run_id: str) -> str:
    """The flow run's state, read through a throwaway API server on the workdir's Prefect database."""
    code = (
        "import sys\n"
        "from flows.local_api import local_prefect_api\n"
        "from prefect.client.orchestration import get_client\n"
        "with local_prefect_api():\n"
        "    with get_client(sync_client=True) as c:\n"
        "        print(c.read_flow_run(sys.argv[1]).state.type.value)\n"
    )
    env = environ(PREFECT_HOME=str(workdir / ".prefect"))
    out = subprocess.run(
        [sys.executable, "-c", code, flow_run_id], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "sig, to_group",
    [(signal.SIGTERM, True), (signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["SIGTERM-to-the-group", "Ctrl-C", "SIGTERM-to-the-main-process-alone"],
)
def test_a_signal_ends_the_run_cleanly_and_resume_matches_an_undisturbed_run(tmp_path, undisturbed, sig, to_group):
    code, seconds, out, err = interrupt_run(tmp_path, sig, to_group)
    assert code == 128 + sig and seconds < 10, (code, seconds, err[-3000:])
    lines = [line for line in err.splitlines() if line.startswith("dllm-flow")]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    record = json.loads(next((tmp_path / "runs").glob("*.json")).read_text())
    assert lines[0].startswith(f"dllm-flow: interrupted by {signal.Signals(sig).name} (train[mdlm] stopped after step ")
    assert lines[0].endswith(f"resume with: dllm-flow resume {record['run_id']} --workdir {tmp_path}")
    stages = {s["name"]: s["status"] for s in record["stages"]}
    assert record["status"] == "INTERRUPTED" and stages == {"prepare_data": "COMPLETED", "train[mdlm]": "INTERRUPTED"}
    checkpoint = json.loads(next((tmp_path / "store" / "train").glob("*.work/checkpoint/dllm.json")).read_text())
    assert f"checkpoint at step {checkpoint['step']}" in lines[0]  # saved at the step it stopped, not the last 10th
    assert set(mlflow_statuses(tmp_path).values()) == {"KILLED"}
    assert processes_of(tmp_path) == []
    if sig == signal.SIGTERM and to_group:  # the Prefect side once (a throwaway server costs seconds)
        assert prefect_state(tmp_path, record["prefect_flow_run_id"]) == "CANCELLED"
        resumed = subprocess.run(
            [sys.executable, "-m", "flows.cli", "resume", record["run_id"], "--workdir", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
            env=environ(),
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resuming from the step-{checkpoint['step']} checkpoint" in resumed.stdout
        assert weights_digest(tmp_path) == weights_digest(undisturbed)
        assert set(mlflow_statuses(tmp_path).values()) >= {"FINISHED"}
