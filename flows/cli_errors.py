"""How a `dllm-flow` command ends: its exit status, and the one `dllm-flow: error:` line with where the
traceback is (the command's log file, or `--debug`) and, where resuming can fix the failure, `resume with:`."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

from dllm_common import credentials
from dllm_common.checkpoint import CorruptCheckpointError
from dllm_common.config import ConfigError, TrainingDiverged
from dllm_common.interrupt import Interrupted
from dllm_common.store import DiskFullError, is_disk_full


class Session:
    log_file: Path | None = None  # this command's log file (`run`, `resume`), named in error messages


# what the user can change: a config, a path, a damaged file, a full disk
USER_ERRORS = (
    ConfigError,
    CorruptCheckpointError,
    DiskFullError,
    FileExistsError,
    FileNotFoundError,
    PermissionError,
    ValueError,
)


def run_command(args) -> int:
    """`args.func(args)`'s exit status: 0, 2 with one `dllm-flow: error:` line for what the user can change (a
    stage's traceback is in the command's log file), 1 with one line for anything else, 128 + N after signal N.
    `--debug` raises instead, for the traceback."""
    Session.log_file = None
    try:
        credentials.apply_to_client()  # a team server's login, from the environment (docs/operations.md)
        return args.func(args)
    except USER_ERRORS as exc:
        if args.debug:
            raise
        print(f"dllm-flow: error: {exc}{_log_hint(exc)}{resume_hint(exc, args)}", file=sys.stderr)
        return 2
    except Exception as exc:
        if args.debug:
            raise
        causes = getattr(exc, "errors", {}).values()  # several strategies failed: their summary says which finished
        if not causes and is_disk_full(exc):  # a library's error over an ENOSPC (torch's "unexpected pos 704 vs 598")
            print(f"dllm-flow: error: {_disk_full_line(exc)}{_log_hint(exc)}", file=sys.stderr)
            return 2
        print(f"dllm-flow: error: {type(exc).__name__}: {exc}{_log_hint(exc)}{resume_hint(exc, args)}", file=sys.stderr)
        # exit 2 when every failure is one the user changes: a config, a file, a full disk
        return 2 if causes and all(isinstance(e, USER_ERRORS) or is_disk_full(e) for e in causes) else 1
    except Interrupted as exc:  # a signal outside the pipeline (while its services start or stop)
        print(f"dllm-flow: {exc}", file=sys.stderr)
        return exc.exit_code


def _disk_full_line(exc: BaseException) -> str:
    """The disk-full line (docs/operations.md, "Faults") where the error that reached the command is a library's
    over an ENOSPC: what the nearest `DiskFullError` of its chain says, else the generic line."""
    todo = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, DiskFullError):
            return str(e)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None and c is not e]
        todo += list(getattr(e, "errors", {}).values())
    return (
        f"no space left on the device ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
        "nothing half-written was published: free space (or point --workdir at a larger disk) and rerun"
    )


def _resumable(exc: BaseException) -> bool:
    """Whether resuming the run can fix `exc`: a stage that failed or was cut short mid-way (a crash, a lost
    server, a diverged step `--set train.skip_nonfinite_steps` skips), not what the user must change first (a
    config, a missing or damaged file, a read-only or full disk, a refused login)."""
    errors = getattr(exc, "errors", None)
    if isinstance(errors, dict) and errors:  # several strategies failed: any one a resume can fix
        return any(_resumable(e) for e in errors.values())
    if isinstance(exc, TrainingDiverged):
        return True
    read_only = isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    if isinstance(exc, USER_ERRORS) or is_disk_full(exc) or read_only:
        return False
    text = str(exc)
    return not any(word in text for word in ("401", "403", "Unauthorized", "Forbidden", "credentials"))


def resume_hint(exc: BaseException, args) -> str:
    """A pipeline run that failed where a resume can fix it: the command that resumes it (what completed is
    reused). None under errors the user must fix first: resuming would fail the same way."""
    run_id = getattr(exc, "run_id", None)
    if not run_id or f"dllm-flow resume {run_id}" in str(exc) or not _resumable(exc):
        return ""
    return f"\n  resume with: dllm-flow resume {run_id} --workdir {args.workdir}"


def _log_hint(exc: BaseException) -> str:
    """Where the full traceback is: the command's log file (written there now), or `--debug`."""
    import traceback

    if Session.log_file is None:
        return "" if isinstance(exc, USER_ERRORS) else " (rerun with --debug for the traceback)"
    try:
        with open(Session.log_file, "a", encoding="utf-8") as log:
            log.write("dllm-flow: error:\n" + "".join(traceback.format_exception(exc)))
    except OSError:  # the disk that is full holds the log too
        return " (rerun with --debug for the traceback)"
    return f" (details: {Session.log_file})"
