"""SIGINT / SIGTERM: a run ends within seconds, saying where it stopped, with nothing left half-done.

`dllm-flow run` and `resume` call `install()` in the main thread. A signal then raises `Interrupted`
in that thread at once, except inside a `cooperative()` section (the training loop): there it only
sets a flag, the loop notices it at the end of the current step, saves a checkpoint when there is time,
and raises `Interrupted` itself. If the section does not react within `GRACE_SECONDS` (a step longer
than that), an alarm raises `Interrupted` anyway; a second signal does so at once.

`Interrupted` derives from `BaseException`, like `KeyboardInterrupt`: no `except Exception` on the way
up swallows it, and Prefect does not retry a task that raised it. See docs/operations.md (signals).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

GRACE_SECONDS = 6  # a cooperative section's time to reach a safe point; the whole stop stays under 10 s

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The run was stopped by a signal. `where` says what had been done (e.g. "step 40, checkpoint saved")."""

    def __init__(self, signame: str, where: str = ""):
        super().__init__(signame, where)
        self.signame, self.where = signame, where

    def __str__(self) -> str:
        return f"interrupted by {self.signame}" + (f" ({self.where})" if self.where else "")

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + int(getattr(signal, self.signame, signal.SIGTERM))


class _State:
    signame: str | None = None
    received_at: float | None = None
    cooperative: int = 0
    installed: bool = False
    where: str = ""


_state = _State()


def _on_signal(signum, _frame) -> None:
    name = signal.Signals(signum).name
    first = _state.signame is None
    if first:
        _state.signame, _state.received_at = name, time.monotonic()
    if _state.cooperative and first:
        signal.alarm(GRACE_SECONDS)  # the section has this long to stop by itself
        return
    raise Interrupted(_state.signame or name, _state.where)


def _on_alarm(_signum, _frame) -> None:
    if _state.signame is not None:
        raise Interrupted(_state.signame, _state.where or "the current step did not end in time")


PR_SET_PDEATHSIG = 1


def detach_and_die_with_parent() -> None:  # pragma: no cover - runs in a child between fork and exec
    """`preexec_fn` of a child this run starts: its own session, so a signal to the run's process group reaches
    only the run, which forwards it once; and Linux's parent-death signal, so it never outlives the run."""
    import ctypes
    import os

    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the run's own shutdown still stops the child


def install() -> None:
    """Route SIGINT and SIGTERM through this module (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _SIGNALS:
        signal.signal(sig, _on_signal)
    signal.signal(signal.SIGALRM, _on_alarm)
    _state.installed = True


def reset() -> None:
    """Forget a received signal (tests; a process that handles several runs)."""
    signal.alarm(0)
    _state.signame, _state.received_at, _state.where, _state.cooperative = None, None, "", 0


def requested() -> str | None:
    """The name of the signal received, if any."""
    return _state.signame


def seconds_left() -> float:
    """Of the grace period, since the signal came (the full period when none has)."""
    if _state.received_at is None:
        return float(GRACE_SECONDS)
    return GRACE_SECONDS - (time.monotonic() - _state.received_at)


def note(where: str) -> None:
    """What an interruption now would leave behind (shown in the final message)."""
    _state.where = where


def stop(where: str) -> None:
    """Called by a cooperative section at its safe point once `requested()`: raise `Interrupted`."""
    signal.alarm(0)
    _state.where = where
    raise Interrupted(_state.signame or "SIGTERM", where)


@contextmanager
def cooperative() -> Iterator[None]:
    """Inside, a signal only sets the flag; the code polls `requested()` and calls `stop()`. A signal
    received before the section began is acted on when the section's code polls."""
    if not _state.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.cooperative += 1
    try:
        if _state.signame is not None:
            signal.alarm(max(1, int(seconds_left())))
        yield
    except BaseException:
        signal.alarm(0)  # leaving on another error: the grace alarm must not fire later, in cleanup code
        raise
    finally:
        _state.cooperative -= 1
    if _state.signame is not None:  # the section ended without polling after the signal came
        stop(_state.where)
