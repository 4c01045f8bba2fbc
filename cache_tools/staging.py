"""Disk budgets: how many bytes a local cache or staging directory may hold, and waiting for room.

One accounting, shared by every stage that fills local disk under `--disk-budget` (an
extraction waiting for the trainer to free parts, a remote cache's parts fetched ahead into a
staging directory): the bytes in use are what the directory's files hold on disk, read from
the filesystem each time, so any number of processes (loader workers, extraction ranks) see
the same figure without talking to each other. A budget admits one more part while the
directory holds less than the budget, so a directory never holds more than the budget plus
one part, and a part larger than the whole budget still goes through alone. What is never
evicted counts too (a remote cache's small arrays, staged for every part at open): where it
alone exceeds the budget, the directory holds it plus one part.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash.runtime.findings import Finding

from .errors import InputError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str | int) -> int:
    """'200G' / '1.5TiB' / '500MB' / '4096' -> bytes (K, M, G, T and KiB.. are binary; KB.. decimal)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise InputError(Finding("cache.size-invalid", value=str(text)))
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(nbytes: float) -> str:
    for unit, step in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= step:
            return f"{nbytes / step:.1f} {unit}"
    return f"{int(nbytes)} B"


def disk_usage(root: str | os.PathLike, *, allocated: bool = False) -> int:
    """Bytes the files under `root` occupy (their sizes; a missing directory holds none).

    `allocated`: what the file system spends on them instead, the blocks of every file and
    directory (at least each file's size: a compressing file system is not counted below it). A
    part's dozen small metadata files take a 4 KiB block each: on a small part that is most of its
    room on disk, and ENOSPC is decided on blocks."""
    total = 0
    for dirpath, dirs, files in os.walk(root):
        for name, is_file in [*((n, True) for n in files), *((n, False) for n in dirs if allocated)]:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:  # removed meanwhile (an eviction in another process)
                continue
            size = st.st_size if is_file else 0
            total += max(size, st.st_blocks * 512) if allocated else size
    return total


@dataclass(frozen=True)
class StagingBudget:
    """A byte budget for the files under `root`; None as the limit means unlimited."""

    root: Path
    limit: int | None

    def used(self) -> int:
        return disk_usage(self.root)

    def has_room(self, nbytes: int, *, used: int | None = None) -> bool:
        """Whether one more item of `nbytes` may be written now: always when nothing is held
        (so one item larger than the budget still passes), else while it fits."""
        if self.limit is None:
            return True
        used = self.used() if used is None else used
        return used == 0 or used + nbytes <= self.limit

    def wait_for_room(self, nbytes: int, *, make_room: Callable[[int], bool] | None = None,
                      poll_s: float = 0.5, timeout_s: float | None = None,
                      should_stop: Callable[[], bool] | None = None) -> bool:
        """Block until `nbytes` fit. `make_room(needed)` may free space (evict) and returns
        whether it freed any; otherwise this polls (another process may free it). Returns False
        when `should_stop()` turns true or `timeout_s` passes, True once there is room."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            used = self.used()
            if self.has_room(nbytes, used=used):
                return True
            if make_room is not None and make_room(used + nbytes - (self.limit or 0)):
                continue
            if (should_stop is not None and should_stop()) or (deadline is not None and time.monotonic() > deadline):
                return False
            time.sleep(poll_s)
