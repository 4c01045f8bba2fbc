"""Ctrl-C and SIGTERM: the first one asks the trainer to stop after its step (and checkpoint),
a second one exits at once."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from types import FrameType

EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StopRequest:
    """Installs SIGINT/SIGTERM handlers for the duration of a `with` block."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            sys.stderr.write(f"\nSecond {signal.Signals(signum).name}: exiting now without a checkpoint.\n")
            sys.stderr.flush()
            try:
                # torch's DataLoader watches its workers through SIGCHLD and raises when one dies;
                # that handler would run inside this one and turn the exit into a traceback.
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for child in multiprocessing.active_children():  # DataLoader workers ignore signals
                    child.kill()
            finally:
                os._exit(EXIT_STATUS.get(signum, 128 + signum))
        self.signum = signum
        sys.stderr.write(f"\n{signal.Signals(signum).name} received: finishing this step, writing a "
                         "checkpoint, then exiting (send it again to exit at once).\n")
        sys.stderr.flush()

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.signum, 128 + self.signum) if self.signum else 0

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in EXIT_STATUS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()


class Interrupted(BaseException):
    """SIGINT/SIGTERM outside the training loop (startup, the final save, export)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def stop_at_once_outside_the_loop() -> None:
    """Until StopRequest takes over (and after it), a signal stops the run at once: outside the
    loop there is no step to finish, and a checkpoint being saved is discarded whole."""
    if threading.current_thread() is threading.main_thread():
        for s in EXIT_STATUS:
            signal.signal(s, _raise_interrupted)
