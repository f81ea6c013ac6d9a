"""The process environment every command sets before Prefect or MLflow is imported."""

from __future__ import annotations

import os
from pathlib import Path

from dllm_common.tracking import quiet_environment

DEBUG_ENV = "DLLM_FLOW_DEBUG"  # `dllm-flow --debug`: Prefect's console lines and full tracebacks

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def open_log_file(workdir: Path) -> Path:
    """`<workdir>/logs/<time>-<pid>.log`: every Prefect and dllm-flow log line of this command, tracebacks
    included (call after Prefect is imported: its logging setup would replace the handler)."""
    import logging
    import time

    folder = Path(workdir) / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    for name in ("prefect", "dllm_flow"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(min(logger.level or logging.INFO, logging.INFO))
    # dllm-flow's own warnings (a damaged store entry set aside, ...) stay on the console as one line each
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter("[dllm-flow] %(levelname)s: %(message)s"))
    ours = logging.getLogger("dllm_flow")
    ours.addHandler(console)
    ours.propagate = False
    return path


def prefect_env(workdir: Path) -> None:
    """Call before Prefect is imported (tasks/ imports it): Prefect reads its settings, logging levels
    included, from the environment once, at import."""
    quiet_environment()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "PREFECT_API_URL" not in os.environ:
        home = Path(workdir).resolve() / ".prefect"
        try:
            home.mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("PREFECT_HOME", str(home))
        except OSError:
            pass  # an unusable workdir: check_workdir says why
    # The console shows dllm-flow's own lines only: Prefect's (a stage's traceback among them) go to the run's
    # log file (`open_log_file`) unless --debug; the run loggers send INFO and up to the API, where they are the
    # flow run's Logs tab: stage starts, reuse decisions, failures (flows/pipeline.py).
    level = os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", level if os.environ.get(DEBUG_ENV) else "CRITICAL")
    run_level = "DEBUG" if level == "DEBUG" else "INFO"
    for logger in ("FLOW_RUNS", "TASK_RUNS"):
        os.environ.setdefault(f"PREFECT_LOGGING_LOGGERS_PREFECT_{logger}_LEVEL", run_level)
    # a loaded 2-core machine can take longer than Prefect's default 20 s to boot the local API
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")
