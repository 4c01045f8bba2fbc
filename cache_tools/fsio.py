"""Moved to `dflash.runtime.fsio` (kept so that existing imports keep working)."""

from dflash.runtime.fsio import (  # noqa: F401
    atomic_write_bytes,
    atomic_write_json,
    file_lock,
    fsync_dir,
    fsync_tree,
    temp_name,
)
