"""The host's shared memory (/dev/shm), which the extraction's part buffers and the trainer's loader
batches live in: how much of it is free. A tmpfs written past its size kills the writer with SIGBUS,
so both stages size what they put there from this before they start."""

from __future__ import annotations

import os

SHM_DIR = "/dev/shm"


def shm_free_bytes() -> int | None:
    """Free bytes of the shared-memory file system (None where there is none to ask)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
