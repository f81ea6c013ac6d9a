"""Content-addressed stage store: `store/<stage>/<key>/` with a `manifest.json`.

key = sha256(canonical JSON of {config slice, upstream keys, code version}). A stage writes into a
private temp dir and publishes it with one atomic rename after fsync, so a half-written stage is
never a cache hit. A stage that must survive a crash mid-way (training) keeps its resumable state
in `work_dir(stage, key)`, which is separate from the published entry.

Reuse is verified (docs/architecture.md, "The stage protocol"): an entry counts as published only
while its manifest parses and every file it lists is there with its recorded size (and, with
`DLLM_FLOW_VERIFY=full`, i.e. `dllm-flow run --verify`, its recorded sha256). A damaged entry is
reported in one line, moved aside to `<stage>/<key>.damaged-<time>` (never deleted) and rebuilt.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dllm_common import faults
from dllm_common.config import canonical_json

MANIFEST = "manifest.json"
VERIFY_ENV = "DLLM_FLOW_VERIFY"  # "full": re-hash every file of an entry on reuse; otherwise sizes only
log = logging.getLogger("dllm_flow.store")


def full_verification() -> bool:
    return os.environ.get(VERIFY_ENV, "").lower() == "full"


def stage_key(stage: str, config_slice: Any, upstream: dict[str, str], code_version: str) -> str:
    payload = canonical_json({"stage": stage, "config": config_slice, "upstream": upstream, "code": code_version})
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file so readers see either the old or the new content, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        faults.reached("record.save")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class DiskFullError(OSError):
    """ENOSPC while publishing: says what was being written and that nothing half-written is left."""

    def __str__(self) -> str:
        return str(self.strerror)


def refuse_read_only(folder: Path, what: str, fix: str) -> None:
    """Raise `PermissionError("<what> (<strerror>): <fix>")` where a file cannot be created in `folder` (a
    read-only mount, permissions): one probe file written and removed, so it holds for root too."""
    probe = Path(folder) / f".write-probe-{os.getpid()}"
    try:
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(f"{what} ({exc.strerror}): {fix}") from None


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# what a write that failed on a full disk says where a library's error dropped the OSError: torch's zip writer
# (`torch.save`, DCP's shards) finds its position short of what it wrote ("unexpected pos 704 vs 598"; a stream
# whose write raised leaves the OSError as its context, a file path only an iostream error), safetensors' Rust
# writer names the OS error, and an error sent from another rank or process keeps only its text
DISK_FULL_TEXTS = ("unexpected pos ", "(os error 28)", "(os error 122)", "[Errno 28]", "[Errno 122]")


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` is, wraps or was raised while handling a full disk (its `__cause__`/`__context__` chain, the
    per-rank errors of DCP's `CheckpointException`, and the texts of `DISK_FULL_TEXTS`)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, DiskFullError) or (isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS):
            return True
        if any(text in str(e) for text in DISK_FULL_TEXTS):
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # DCP: {rank: (error, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return False


@dataclass(frozen=True)
class StageEntry:
    stage: str
    key: str
    path: Path

    @property
    def manifest(self) -> dict:
        return json.loads((self.path / MANIFEST).read_text())


class Store:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def entry_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def work_dir(self, stage: str, key: str) -> Path:
        """Resumable scratch space of an unfinished stage (kept across crashes)."""
        return self.root / stage / f"{key}.work"

    @contextlib.contextmanager
    def lock(self, stage: str, key: str) -> Iterator[None]:
        """Exclusive cross-process lock on one entry (`fcntl.flock` on `<stage>/<key>.lock`), so two
        workers never compute the same expensive entry: the second waits, then finds it published.
        The kernel drops the lock when its holder dies, so a crashed worker never wedges the store."""
        path = self.root / stage / f"{key}.lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a")  # noqa: SIM115 (closed below, after the lock is released)
        except OSError as exc:  # a store made read-only while the run went on (`check_workdir` probes it first)
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise PermissionError(
                f"{path.parent} is not writable ({exc.strerror}): stage {stage} publishes there; make it writable "
                "(remount it read-write) or pass --workdir DIR with a writable path"
            ) from None
        with handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def lookup(self, stage: str, key: str) -> StageEntry | None:
        """The published entry if it is intact; a damaged one is set aside (under the entry's lock) and
        None returned, so the caller rebuilds it."""
        hit, problems = self._inspect(stage, key)
        if problems:
            with self.lock(stage, key):
                return self._intact_locked(stage, key)
        return hit

    def _intact_locked(self, stage: str, key: str) -> StageEntry | None:
        """`lookup` for a caller that holds the entry's lock: a damaged entry is set aside, None returned."""
        hit, problems = self._inspect(stage, key)
        if problems:
            self._set_aside(stage, key, problems)
        return hit

    def _inspect(self, stage: str, key: str) -> tuple[StageEntry | None, list[str]]:
        """(the entry if present and intact, what is wrong with it if present and damaged)."""
        path = self.entry_dir(stage, key)
        if not path.exists():
            return None, []
        entry = StageEntry(stage, key, path)
        problems = self.check(entry, full=full_verification())
        return (None, problems) if problems else (entry, [])

    def check(self, entry: StageEntry, full: bool = False) -> list[str]:
        """What is wrong with a published entry (empty: intact): an unreadable manifest, or a listed file
        missing, of another size, or (with `full`) of another sha256."""
        try:
            files = entry.manifest["files"]
            listed = [(rel, int(meta["bytes"]), meta["sha256"]) for rel, meta in files.items()]
        except FileNotFoundError:
            return [f"{MANIFEST} is missing"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return [f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})"]
        problems = []
        for rel, size, digest in listed:
            p = entry.path / rel
            if not p.is_file():
                problems.append(f"{rel} is missing")
            elif (actual := p.stat().st_size) != size:
                problems.append(f"{rel} has {actual} bytes, the manifest says {size}")
            elif full and sha256_file(p) != digest:
                problems.append(f"{rel} does not match its sha256")
        return problems

    def _set_aside(self, stage: str, key: str, problems: list[str]) -> Path:
        """Move a damaged entry to `<stage>/<key>.damaged-<time>` (kept for inspection) and say so in one line."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = self.root / stage / f"{key}.damaged-{stamp}-{uuid.uuid4().hex[:6]}"
        os.rename(self.entry_dir(stage, key), dest)
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        log.warning(
            "store entry %s/%s is damaged: %s%s; moved aside to %s and rebuilding", stage, key, problems[0], more, dest
        )
        return dest

    @contextlib.contextmanager
    def _publishing(self, stage: str, key: str) -> Iterator[tuple[Path, dict]]:
        """Yield (temp dir, manifest fields to fill); on success write the manifest with file digests,
        fsync and rename the dir into place."""
        manifest: dict = {}
        final = self.entry_dir(stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        started = time.time()
        try:
            yield tmp, manifest
            faults.reached(f"publish.{stage}.written")
            files = {
                str(p.relative_to(tmp)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            full = {
                **manifest,
                "stage": stage,
                "key": key,
                "files": files,
                "published_at": time.time(),
                "publish_seconds": time.time() - started,
            }
            (tmp / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=True, default=str))
            fsync_tree(tmp)
            faults.reached(f"publish.{stage}.renaming")
            if final.exists():  # a concurrent twin won the race; identical content by construction
                shutil.rmtree(tmp)
            else:
                os.rename(tmp, final)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            # one line that says what it was writing (also where torch's or safetensors' error wraps the ENOSPC)
            if not isinstance(exc, (DiskFullError, KeyboardInterrupt)) and is_disk_full(exc):
                raise DiskFullError(
                    errno.ENOSPC,
                    f"no space left on the device while writing {stage}/{key} under {self.root} "
                    f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); nothing "
                    "was published and its temp dir is removed: free space (or point --workdir at a larger disk) "
                    "and rerun",
                ) from None
            raise
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def reuse_or_build(self, stage: str, key: str, build: Callable[[Path], dict]) -> tuple[StageEntry, bool]:
        """The one stage protocol: reuse the published entry, or build and publish it exactly once.

        lookup → cross-process lock → lookup again (a concurrent worker may have published while we
        waited) → `build(tmp)` fills a private temp dir and returns the manifest fields → atomic publish.
        Returns `(entry, reused)`. `build` must not call `reuse_or_build` on the same key (the lock is
        not re-entrant across file handles)."""
        if (hit := self.lookup(stage, key)) is not None:
            return hit, True
        with self.lock(stage, key):
            if (hit := self._intact_locked(stage, key)) is not None:
                return hit, True
            for stale in self.entry_dir(stage, key).parent.glob(f".tmp-{key}-*"):  # a killed builder's leftovers
                shutil.rmtree(stale, ignore_errors=True)
            with self._publishing(stage, key) as (tmp, manifest):
                manifest.update(build(tmp))
        return StageEntry(stage, key, self.entry_dir(stage, key)), False

    @contextlib.contextmanager
    def publish(self, stage: str, key: str, manifest: dict) -> Iterator[Path]:
        """Yield a temp dir to fill; on success add the manifest (with file digests) and rename it in.
        Stages go through `reuse_or_build`; this is its publishing half, for tools and tests."""
        with self._publishing(stage, key) as (tmp, fields):
            fields.update(manifest)
            yield tmp

    def verify(self, entry: StageEntry) -> list[str]:
        """What is wrong with the entry, every file re-hashed (empty list = intact)."""
        return self.check(entry, full=True)


def refuse_published(out: str | Path, workdir: str | Path | None = None) -> None:
    """Published entries are immutable: refuse an output directory inside a published entry (a directory
    holding a manifest, or below one) or inside `workdir`'s store, before anything is written."""
    target = Path(out).resolve()
    inside = next((d for d in (target, *target.parents) if (d / MANIFEST).is_file()), None)
    store = (Path(workdir) / "store").resolve() if workdir is not None else None
    if inside is None and store is not None and (target == store or store in target.parents):
        inside = store
    if inside is not None:
        what = "the published store entry" if (inside / MANIFEST).is_file() else "the store"
        raise ValueError(f"{out} is inside {what} {inside}, which is never written to; choose another output directory")
