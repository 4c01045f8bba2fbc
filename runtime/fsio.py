"""Durable file-system helpers: atomic writes, fsync of trees, advisory locks.

One place for the commit protocol's primitives so that manifests, parts and checkpoints
all get the same guarantees: a reader sees either the old file or the new one, never a torn
one, and a file that was renamed into place survives a power cut.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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


def temp_name(path: Path) -> Path:
    """A sibling name unique to this process and call, recognisable as temporary."""
    return path.with_name(f".tmp-{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")


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
