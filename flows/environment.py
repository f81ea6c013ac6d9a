"""The process environment every command sets before Prefect or MLflow is imported."""

from __future__ import annotations

import os
from pathlib import Path

from dllm_common.tracking import quiet_environment


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
    # The console shows WARNING and up (PREFECT_LOGGING_LEVEL), while the run loggers send INFO and up to the
    # API, where they are the flow run's Logs tab: stage starts, reuse decisions, failures (flows/pipeline.py).
    level = os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", level)
    run_level = "DEBUG" if level == "DEBUG" else "INFO"
    for logger in ("FLOW_RUNS", "TASK_RUNS"):
        os.environ.setdefault(f"PREFECT_LOGGING_LOGGERS_PREFECT_{logger}_LEVEL", run_level)
    # a loaded 2-core machine can take longer than Prefect's default 20 s to boot the local API
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")
