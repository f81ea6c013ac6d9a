"""Loaded by every Python process `benchmarks/server_load.py` starts (it is first on their PYTHONPATH): each HTTP
request the process makes (Prefect's httpx client, MLflow's requests session) is appended to
`$DLLM_LOAD_LOG/<pid>.jsonl` with its method, path, status or exception, and seconds. Not part of dllm-flow."""

import json
import os
import threading
import time

_DIR = os.environ.get("DLLM_LOAD_LOG")
_LOCK = threading.Lock()


def _record(method: str, url: str, seconds: float, status: int | None, error: str | None) -> None:
    entry = {"method": method, "path": url.split("://", 1)[-1].split("/", 1)[-1].split("?")[0], "s": seconds}
    entry.update(status=status, error=error, at=time.time())
    with _LOCK, open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")


def _patch_httpx() -> None:
    import httpx

    sync_send, async_send = httpx.Client.send, httpx.AsyncClient.send

    def send(self, request, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            response = sync_send(self, request, *args, **kwargs)
        except Exception as exc:
            _record(request.method, str(request.url), time.perf_counter() - t0, None, type(exc).__name__)
            raise
        _record(request.method, str(request.url), time.perf_counter() - t0, response.status_code, None)
        return response

    async def asend(self, request, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            response = await async_send(self, request, *args, **kwargs)
        except Exception as exc:
            _record(request.method, str(request.url), time.perf_counter() - t0, None, type(exc).__name__)
            raise
        _record(request.method, str(request.url), time.perf_counter() - t0, response.status_code, None)
        return response

    httpx.Client.send, httpx.AsyncClient.send = send, asend


def _patch_requests() -> None:
    import requests

    session_send = requests.Session.send

    def send(self, request, **kwargs):
        t0 = time.perf_counter()
        try:
            response = session_send(self, request, **kwargs)
        except Exception as exc:
            _record(request.method, request.url, time.perf_counter() - t0, None, type(exc).__name__)
            raise
        _record(request.method, request.url, time.perf_counter() - t0, response.status_code, None)
        return response

    requests.Session.send = send


if _DIR:
    for _patch in (_patch_httpx, _patch_requests):
        try:
            _patch()
        except ImportError:
            pass
