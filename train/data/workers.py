"""The life of a DataLoader worker process: signals left to its trainer, and an end with it."""

from __future__ import annotations

import os
import signal
import sys

import torch


def worker_init(_: int, trainer_pid: int) -> None:
    # Ctrl-C reaches the whole process group: workers leave signals to the trainer, which
    # finishes its step (needing their batches) before it stops them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
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
