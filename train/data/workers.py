"""The life of a DataLoader worker process: signals left to its trainer, its decode threads, and an end
with it."""

from __future__ import annotations

import os
import signal
import sys

import torch
from dflash.cache_tools.part_files import set_decode_threads

DECODE_THREADS_CAP = 4
"""The most threads a worker decodes a batch's chunks on."""


def decode_threads(workers: int, cores: int) -> int:
    """Threads each of `workers` loader workers decodes on: the cores its process may use beyond the
    trainer's own, shared among the workers, at most DECODE_THREADS_CAP. A worker reads one long
    sample's chunks that many times as fast (bench/bench_loader.py), where the default of at most 4
    workers would leave the other cores idle."""
    return max(1, min(DECODE_THREADS_CAP, (cores - 1) // max(1, workers)))


def worker_init(_: int, trainer_pid: int, threads: int = 1) -> None:
    # Ctrl-C reaches the whole process group: workers leave signals to the trainer, which
    # finishes its step (needing their batches) before it stops them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    set_decode_threads(threads)
    # torch's worker notices its trainer's death by its parent pid changing from the one it reads
    # after this function: a trainer killed before that read leaves a worker that never ends.
    # The kernel ends it with the trainer instead; a trainer already gone ends it here.
    _exit_with_parent()
    if os.getppid() != trainer_pid:
        os._exit(0)


def _exit_with_parent() -> None:
    """SIGKILL this process when its parent ends (Linux; elsewhere torch's watchdog alone)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
