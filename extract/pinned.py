"""Page-locked shared memory: part segments that device-to-host copies reach by DMA.

Registering memory with CUDA (`cudaHostRegister`) lets the GPU copy a batch's rows straight
into the shared segment a writer process will compress, with no host-side copy at all; it
takes a while per GB and holds the driver's lock, so the writer pool registers a fixed set of
segments once, before the first forward (extract/writers.py).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch


class SegmentPinner:
    """Registers shared-memory segments with CUDA (page-locked), so that device-to-host
    copies land in them by DMA; a registration the driver refuses leaves the segment
    unpinned (the engine then goes through its own pinned buffers)."""

    PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context, whichever thread registers

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ptrs: dict[str, int] = {}
        self.failures = 0
        self.registered = 0
        self.seconds = 0.0  # spent registering

    def register(self, shm: SharedMemory) -> bool:
        view = np.frombuffer(shm.buf, dtype=np.uint8)
        ptr, size = view.ctypes.data, view.nbytes
        del view  # no lasting export of shm.buf: the segment must stay closable
        # This process's GPU, not the thread's default GPU 0 (a stray context there).
        start = time.perf_counter()
        with torch.cuda.device(self.device):
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, self.PORTABLE))
        self.seconds += time.perf_counter() - start
        self.registered += 1
        if err != 0:
            self.failures += 1
            return False
        self._ptrs[shm.name] = ptr
        return True

    def is_pinned(self, shm: SharedMemory) -> bool:
        return shm.name in self._ptrs

    def unregister(self, shm: SharedMemory) -> None:
        ptr = self._ptrs.pop(shm.name, None)
        if ptr is not None:
            with torch.cuda.device(self.device):
                torch.cuda.cudart().cudaHostUnregister(ptr)


def unlink_segment(shm: SharedMemory, pinner: SegmentPinner | None = None, *, unmap: bool = True) -> None:
    """Remove a segment (unpinning it first when `pinner` pinned it); without `unmap`, only
    its name (the process is about to exit)."""
    if unmap:
        if pinner is not None:
            pinner.unregister(shm)
        shm.close()
    shm.unlink()


def pinnable_bytes() -> int:
    """Page-locked memory this process may take: a quarter of the host's, shared by its ranks."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // 4 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def touched_segments(count: int, size: int) -> list[SharedMemory]:
    """`count` shared segments of `size` bytes with every page already faulted in (on
    several threads), so that page-locking them only has to pin resident pages."""
    segments = [SharedMemory(create=True, size=max(size, 1)) for _ in range(count)]

    def touch(shm: SharedMemory) -> None:
        view = np.frombuffer(shm.buf, dtype=np.uint8)
        step = 64 << 20
        for lo in range(0, view.size, step):
            np.copyto(view[lo:lo + step], 0)
        del view

    with ThreadPoolExecutor(min(8, count)) as ex:
        list(ex.map(touch, segments))
    return segments
