"""Durable file-system helpers: atomic files and directories, fsync, advisory locks.

One place for the commit protocol's primitives so that manifests, cache parts, checkpoints
and exports all get the same guarantees: a reader sees either the old file (or directory) or
the new one, never a torn one; what was renamed into place survives a power cut; what a
killed process left half-written has a temporary name (`temp_name`) that `sweep_stale_temps`
recognises and removes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .signals import signals_deferred


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry (a rename or a new file) to stable storage."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory below `root` (zarr writes without fsync)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


TEMP_PREFIX = ".tmp-"
LOCK_SUFFIX = ".lock"


def temp_name(path: Path) -> Path:
    """A sibling name unique to this process and call, recognisable as temporary."""
    return path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old or the new file, never a mix."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, *, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive advisory lock (flock) on `path` for the duration of the block.

    Yields True when the lock is held; with blocking=False yields False instead of waiting.
    The lock dies with the process, so a killed holder never leaves the cache locked.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and not blocking:
                yield False
                return
            raise
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# -- directories ----------------------------------------------------------------------------


def remove_dir(path: str | os.PathLike) -> None:
    """Delete a directory so that it never looks complete while half deleted: renamed to a
    temporary name first (`sweep_stale_temps` finishes the job if this process dies)."""
    path = Path(path)
    doomed = temp_name(path)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def publish_dir(stage: str | os.PathLike, final: str | os.PathLike, *, synced: bool = False,
                check_old: Callable[[Path], None] | None = None) -> None:
    """Move the finished directory `stage` to `final` atomically and durably.

    Every file below `stage` is fsynced first (unless the caller did: `synced`); an existing
    `final` is renamed aside (then deleted) only once the new one is complete, so `final` never
    holds a mix of old and new files. A directory cannot be swapped in one rename: a crash in
    the instant between the two renames leaves no `final`, with the old directory complete
    under its temporary name beside it (`temp_name`) and the new one complete at `stage`.

    Whatever is at `final` is deleted: a caller whose `final` may hold someone else's files
    passes `check_old`, called with `final` right before it is renamed aside, which raises to
    keep it (nothing is moved then, and `stage` is left to the caller).
    """
    stage, final = Path(stage), Path(final)
    if not synced:
        fsync_tree(stage)
    old = None
    with signals_deferred():  # a stop signal between the two renames would leave no `final`
        if final.exists():
            if check_old is not None:
                check_old(final)
            old = temp_name(final)
            os.replace(final, old)
        os.replace(stage, final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(final: str | os.PathLike, *, check_old: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A new temporary directory beside `final` to fill: published to `final` when the block
    ends cleanly (`publish_dir`, which calls `check_old` on an existing `final`), deleted when
    it or the publishing raises."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    stage = temp_name(final)
    stage.mkdir()
    try:
        yield stage
        publish_dir(stage, final, check_old=check_old)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def stale_temps(directory: str | os.PathLike) -> list[Path]:
    """The temporary entries (`temp_name`) in `directory` whose writer is gone, sorted.

    A writer that may live long holds a liveness lock `<temporary name>.lock` (`file_lock`)
    while it works; its entry and lock are kept. Every other temporary entry is stale, and so
    is a lock that nobody holds. Call it where no writer starts meanwhile (under the
    directory's own lock, or on the one process that writes there).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    entries = sorted(p for p in directory.iterdir() if p.name.startswith(TEMP_PREFIX))
    live, stale = set(), []
    for lock in (p for p in entries if p.name.endswith(LOCK_SUFFIX)):
        with file_lock(lock, blocking=False) as held:
            if held:
                stale.append(lock)
            else:  # a live writer owns it
                live.add(lock.name[: -len(LOCK_SUFFIX)])
    stale += [p for p in entries if not p.name.endswith(LOCK_SUFFIX) and p.name not in live]
    return sorted(stale)


def sweep_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Delete what `stale_temps` finds in `directory`; returns the entries removed."""
    removed = stale_temps(directory)
    for p in removed:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
    if removed:
        fsync_dir(directory)
    return removed
