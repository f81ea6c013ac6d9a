"""`dllm-flow ui` under SIGTERM (`kill`, a service manager) and SIGINT: it exits, and so does the MLflow server it
started, with its uvicorn worker; the port is free again (docs/operations.md, "The local Prefect API, and no
orphans")."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, free_port, group_members, stop_group, wait_http


def _descendants(pid: int) -> dict[int, str]:
    import psutil

    return {p.pid: " ".join(p.cmdline()) for p in psutil.Process(pid).children(recursive=True)}


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_dllm_flow_ui_stops_its_mlflow_server(tmp_path, sig):
    from dllm_common.tracking import Tracking

    Tracking(tmp_path, None, "tiny")  # an experiment for the UI to open on
    port, log = free_port(), tmp_path / "ui.log"
    ui = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "ui", "--workdir", str(tmp_path), "--port", str(port)],
        cwd=ROOT,
        start_new_session=True,  # a session of its own: only its own handling reaches what it started
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", ui, log, seconds=180)
        children = _descendants(ui.pid)
        assert any("mlflow" in c for c in children.values()) and len(children) >= 2, children  # cli + uvicorn
        started = time.monotonic()
        os.kill(ui.pid, sig)  # the command alone, not its group: as `kill PID` or a service manager
        code = ui.wait(timeout=30)
        took = time.monotonic() - started
        assert code == 128 + sig, (code, log.read_text()[-3000:])
        # the server ran in a session of its own: its group, and every process the command had started, is gone
        assert [children[pid] for pid in children if _running(pid)] == []
        assert group_members(ui.pid) == [] and all(group_members(pid) == [] for pid in children)
        assert _port_free(port)
        print(f"[measured] {sig.name}: dllm-flow ui and its {len(children)} server processes gone in {took:.1f} s")
    finally:
        stop_group(ui)
