"""The Prefect API a `dllm-flow run` uses when no server is configured (`PREFECT_API_URL` unset).

Prefect would boot its own temporary server in the run's process group: Ctrl-C or `timeout` then
kills the API before the run can record how it ended, and a SIGTERM sent to the main process alone
(Kubernetes) leaves the server running as an orphan. This one is the same server (Prefect's app on
127.0.0.1, its database under the workdir's PREFECT_HOME) started in its own session, so group
signals don't reach it, and bound to this process's life (Linux's parent-death signal), so it
never outlives the run, even after a SIGKILL. The run stops it when it ends. docs/operations.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from dllm_common import interrupt


def _server_class():
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class DetachedServer(SubprocessASGIServer):
        """Prefect's temporary API server, launched detached from the run's process group."""

        def _run_uvicorn_command(self) -> subprocess.Popen:
            env = {
                **os.environ,
                "PREFECT_UI_ENABLED": "0",
                "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1",
                **get_current_settings().to_environment_variables(exclude_unset=True),
            }
            env.pop("PREFECT_API_URL", None)
            cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent)]
            cmd += ["--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1"]
            cmd += ["--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
            return subprocess.Popen(cmd, env=env, preexec_fn=interrupt.detach_and_die_with_parent)

    return DetachedServer


@contextmanager
def local_prefect_api() -> Iterator[str | None]:
    """Inside, Prefect talks to a detached local API (yields its URL), or to the configured one (None)."""
    if os.environ.get("PREFECT_API_URL"):
        yield None
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server = _server_class()()
    server.start()
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            try:
                yield server.api_url
            finally:
                _drain()
    finally:
        server.stop()


def _drain() -> None:
    """Send the log lines and events still queued while the server is up (at exit they would retry against a
    stopped server for a minute)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=5)
        except Exception:  # best effort: the run's outcome is already recorded
            pass
