"""What dead writers leave in a cache: found and removed by the next writer's open
(`writer.CacheWriter`) and by `dflash-cache prune` (maintenance.py).

A writer's temporary part and its liveness lock, a temporary manifest file, or a part directory
renamed into place by a writer that died before its commit record was appended.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dflash.runtime.fsio import LOCK_SUFFIX, TEMP_PREFIX, fsync_dir, stale_temps

from .eviction import TRAINED_PREFIX
from .manifest import PARTS_DIR, CommitLog

TRAINER_TEMP_PREFIX = TEMP_PREFIX + TRAINED_PREFIX
"""A following trainer's consumption record in the making (eviction.write_trained): written beside
the manifest without the cache lock, so it is never a cache writer's orphan; each rank clears its
own leftovers."""


def find_orphans(cache_dir: Path) -> list[Path]:
    """What no live writer owns and no commit names. Caller holds the cache lock.

    A temporary manifest file (written only under that lock; not a trainer's consumption record,
    which a following trainer writes at any time), the liveness lock and the temporary directory
    of each dead writer, and part directories that no commit record names.
    """
    parts_dir = cache_dir / PARTS_DIR
    found = [p for p in stale_temps(cache_dir) if p.is_file() and not p.name.startswith(TRAINER_TEMP_PREFIX)]
    if not parts_dir.is_dir():
        return found
    log = CommitLog(cache_dir)
    log.refresh()
    found += stale_temps(parts_dir)  # a live writer holds its temporary part's liveness lock
    return found + [p for p in sorted(parts_dir.iterdir())
                    if not p.name.startswith(TEMP_PREFIX) and p.name not in log.records]


def orphan_name(path: Path) -> str:
    """How an orphan is reported: a dead writer's lock file stands for its temporary part."""
    name = path.name
    return name[: -len(LOCK_SUFFIX)] if name.startswith(TEMP_PREFIX) and name.endswith(LOCK_SUFFIX) else name


def remove_orphans(cache_dir: Path) -> list[str]:
    """Delete what `find_orphans` finds. Caller holds the cache lock. Returns the names removed."""
    removed: list[str] = []
    for p in find_orphans(cache_dir):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        if orphan_name(p) not in removed:
            removed.append(orphan_name(p))
    if removed and (cache_dir / PARTS_DIR).is_dir():
        fsync_dir(cache_dir / PARTS_DIR)
    return removed
