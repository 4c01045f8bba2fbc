"""One writer per directory (or output file): a lock file that names its holder.

Every command that writes a cache, a run directory or an output file holds a `WriterLock`
for as long as it writes. The lock is an flock on a small file that holds the holder's pid
and host, so a second writer is refused with a finding that names who holds it, and the
lock dies with its process: kill -9 leaves nothing stale to clean up.

Two kinds: `exclusive` (a training run, an output file, a cache being wiped by --force) and
`shared` (the ranks and writer processes of one extraction, which each commit their own parts
of one cache; the cache's identity check keeps a run of other settings out). A shared taker
refuses while an exclusive holder lives, and an exclusive taker while anyone holds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
import time
import weakref
from pathlib import Path

from .errors import EnvironmentFault, UsageError
from .findings import Finding


class LockedError(EnvironmentFault):
    """Another live process writes the directory or file."""


class OutputIsInputError(UsageError):
    """An output path names one of the command's inputs."""


def _me() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def holders(path: str | os.PathLike) -> list[str]:
    """Who the lock file says holds it ("pid N on HOST"), most recent last."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


def is_held(path: str | os.PathLike) -> bool | None:
    """Whether some process holds a lock on `path` now (Linux: /proc/locks, nothing opened or
    taken); None where that cannot be told."""
    try:
        st = os.stat(path)
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(key in line.split() and "->" not in line for line in table.splitlines())


def _flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


# What a lock guards, which names the thing written and what the refused user can do
# (the words: runtime/messages.py, runtime.locked).
PURPOSES = ("run", "export", "prepare", "generate", "quarantine", "extract", "extract-force", "import",
            "recompress", "merge")


def _locked(purpose: str, output: Path, holder: str | None, lock_file: Path) -> Finding:
    """The `purpose`'s `output` (a cache, a run directory, an output file) is held by `holder`
    ("pid N on HOST", None: unknown)."""
    return Finding("runtime.locked", purpose=purpose, output=str(output), holder=holder, lock_file=str(lock_file))


_HELD: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _close_in_child() -> None:
    """A forked child (a DataLoader worker, a writer process) closes its copies of the held
    locks' descriptors: a lock is its taker's and must end with the taker's death, even while
    children it forked live on. Closing a copy leaves the parent's lock as it is."""
    for lock in list(_HELD):
        if lock._fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock._fd)
            lock._fd = None


os.register_at_fork(after_in_child=_close_in_child)


class WriterLock:
    """A held lock on `path` (released by `release()`, by the context's end, or by the
    process's death; forked children do not hold it)."""

    _fd: int | None = None
    """The lock file's descriptor while held. A class default too: a stop signal may raise before
    __init__'s first line runs, and __del__ runs on the half-made object then."""

    def __init__(self, path: str | os.PathLike, *, purpose: str, output: str | os.PathLike, shared: bool = False):
        """`output` is the thing written (a cache, a run directory, a file), `purpose` (one of
        PURPOSES) what writes it: a refusal names both and what to do."""
        self._fd = None  # (set first: __del__ runs even when the checks or the open below fail)
        if purpose not in PURPOSES:
            raise ValueError(f"lock purpose {purpose!r} is not one of {PURPOSES}")
        self.path = Path(path)
        self.purpose, self.output = purpose, Path(output)
        self.shared = shared
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not self._take_retrying():
                held_by = holders(self.path)
                raise LockedError(_locked(purpose, self.output, held_by[-1] if held_by else None, self.path))
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise
        _HELD.add(self)

    def _take_retrying(self) -> bool:
        """`_take`, retried for a moment when shared: another taker of the same run holds the
        lock exclusively for the instant it converts to shared, which must not refuse this one."""
        attempts = 50 if self.shared else 1
        for attempt in range(attempts):
            if self._take():
                return True
            if attempt + 1 < attempts:
                time.sleep(0.02 + random.random() * 0.02)
        return False

    def _take(self) -> bool:
        fd = self._fd
        if _flock(fd, fcntl.LOCK_EX):  # alone: the file names only this holder
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{_me()}\n".encode(), 0)
            # Converting to shared is not atomic: an exclusive taker may come in between,
            # and then this one is refused, which is right (it wanted the directory alone).
            return _flock(fd, fcntl.LOCK_SH) if self.shared else True
        if self.shared and _flock(fd, fcntl.LOCK_SH):  # beside other holders of one run
            with open(self.path, "a") as f:
                f.write(f"{_me()}\n")
            return True
        return False

    def exclusive(self, *, purpose: str | None = None) -> None:
        """Make a shared hold exclusive (for --force's wipe), refusing while another holds it
        (the refusal says `purpose`'s words; None: the lock's own)."""
        if not self.shared:
            return
        if not _flock(self._fd, fcntl.LOCK_EX):
            others = [h for h in holders(self.path) if h != _me()]
            raise LockedError(_locked(purpose or self.purpose, self.output, others[-1] if others else None, self.path))
        self.shared = False

    def share(self) -> None:
        """Back to a shared hold after an exclusive step (the wipe is done)."""
        if self._fd is not None and not self.shared and _flock(self._fd, fcntl.LOCK_SH):
            self.shared = True

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # a dropped holder lets go, as its process's death would
        self.release()

    def __enter__(self) -> WriterLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def output_lock(path: str | os.PathLike, *, purpose: str, shared: bool = False) -> WriterLock:
    """A lock for one output file (or directory) `path`: `.<name>.lock` beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return WriterLock(path.with_name(f".{path.name}.lock"), purpose=purpose, output=path, shared=shared)


def same_path(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether `a` and `b` are (or resolve to, through links) the same file or directory."""
    a, b = Path(a), Path(b)
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def inside(path: str | os.PathLike, directory: str | os.PathLike) -> bool:
    """Whether `path` is `directory` or lies below it (links resolved)."""
    p, d = Path(path).resolve(), Path(directory).resolve()
    return p == d or d in p.parents


def refuse_output_among_inputs(output: str | os.PathLike, inputs, *, output_flag: str = "--output",
                               input_flag: str = "--data") -> None:
    """An output that is (or resolves to, through links) one of the files read is refused:
    writing it would destroy the input while it is read."""
    for path in inputs:
        if same_path(output, path):
            raise OutputIsInputError(Finding("runtime.output-is-input", flag=output_flag, output=str(output),
                                             input=None if Path(path) == Path(output) else str(path),
                                             input_flag=input_flag))
