"""The team server's login and `make server`'s refusals: what is read from where, and one line for each mistake;
a server that fails to start stops the other."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT

from dllm_common import credentials
from dllm_common.config import ConfigError


def test_credentials_come_from_the_environment_or_a_file(tmp_path):
    assert credentials.read({}) is None
    assert credentials.read({"DLLM_SERVER_USER": "team", "DLLM_SERVER_PASSWORD": "p:w"}) == ("team", "p:w")
    secret = tmp_path / "login"
    secret.write_text("alice:s3cret:with:colons\nignored\n")
    secret.chmod(
        0o600
    )  # docs/operations.md: a file others can read is refused (tests/pipeline/test_bad_inputs_config.py)
    assert credentials.read({"DLLM_SERVER_AUTH_FILE": str(secret)}) == ("alice", "s3cret:with:colons")
    env = {"DLLM_SERVER_AUTH_FILE": str(secret), "MLFLOW_TRACKING_USERNAME": "already-set"}
    assert credentials.apply_to_client(env)
    assert env["PREFECT_API_AUTH_STRING"] == "alice:s3cret:with:colons"
    assert env["MLFLOW_TRACKING_USERNAME"] == "already-set"  # a value the user set wins
    assert env["MLFLOW_TRACKING_PASSWORD"] == "s3cret:with:colons"
    assert not credentials.apply_to_client(no_login := {}) and no_login == {}


@pytest.mark.parametrize(
    "env,message",
    [
        ({"DLLM_SERVER_USER": "team"}, "need a user and a password: set both, as USER:PASSWORD in DLLM_SERVER_USER"),
        ({"DLLM_SERVER_AUTH_FILE": "/no/such/file"}, "DLLM_SERVER_AUTH_FILE=/no/such/file cannot be read"),
    ],
)
def test_half_a_login_is_one_clear_error(env, message):
    with pytest.raises(ConfigError, match=message):
        credentials.read(env)


def _serve(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLLM_SERVER")}
    env.update(DLLM_SERVER_DIR=str(tmp_path / "server"), VENV_BIN=str(os.path.dirname(sys.executable)), **extra)
    return subprocess.run(
        ["bash", "deployments/serve.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"DB": "mysql"}, "DB=mysql is not a backend; use DB=sqlite (one machine) or DB=postgres"),
        ({"SERVER_HOST": "10.1.2.3"}, "give them credentials (DLLM_SERVER_USER + DLLM_SERVER_PASSWORD, or"),
        ({"DLLM_SERVER_PASSWORD": "x"}, "need a user and a password"),
        # MLflow's login app would die at start with a traceback while Prefect kept serving
        (
            {"DLLM_SERVER_USER": "team", "DLLM_SERVER_PASSWORD": "eleven-char"},
            "the server password has 11 characters; MLflow's login needs at least 12",
        ),
    ],
)
def test_make_server_refuses_in_one_line_before_starting_anything(tmp_path, extra, message):
    out = _serve(tmp_path, **extra)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "server" / "migrate.log").exists()  # no database was touched


@pytest.mark.slow
def test_a_server_that_fails_to_start_stops_the_other_and_make_server_exits_non_zero(tmp_path):
    """MLflow's port already taken: Prefect is stopped too, serve.sh exits 1 saying which server failed, and its
    URLs are never printed."""
    from conftest import free_port, group_members

    prefect_port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        mlflow_port = taken.getsockname()[1]
        started = time.monotonic()
        env = {k: v for k, v in os.environ.items() if not k.startswith("DLLM_SERVER")}
        env.update(DLLM_SERVER_DIR=str(tmp_path / "server"), VENV_BIN=os.path.dirname(sys.executable))
        env.update(PREFECT_PORT=str(prefect_port), MLFLOW_PORT=str(mlflow_port))
        env.pop("PREFECT_API_URL", None)
        proc = subprocess.Popen(
            ["bash", "deployments/serve.sh"],
            cwd=ROOT,
            env=env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        took = time.monotonic() - started
    assert proc.returncode == 1, err[-3000:]
    assert "serve.sh: the MLflow server exited (status" in err and "before it answered; stopping the other" in err
    assert "Prefect API  http" not in out and "MLflow       http" not in out, out  # no URL of a server down
    assert group_members(proc.pid) == []  # Prefect (and everything else serve.sh started) is gone
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", prefect_port)) != 0
    print(f"[measured] serve.sh with MLflow's port taken: exit 1 after {took:.1f} s, Prefect stopped; its stderr:")
    print(err[-1500:])
