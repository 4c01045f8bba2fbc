"""SIGINT and SIGTERM, the same way in every command.

Outside a unit of work that can be finished (startup, a final save, an export), a signal stops
the command at once: `stop_at_once()` turns it into `Interrupted`, which the CLI reports with
the signal's exit status (130 / 143). Inside one (a training step, the parts of an extraction
in progress), `StopRequest` records the first signal so that the loop can finish its unit,
save, and return; a second signal exits at once, stopping the worker processes first.

A loop that waits for something another process makes (a part of a cache being extracted, a
plan) cannot finish its unit until that comes, which may be never: it calls `check_stop(what)`
between its looks (at least once a second), which raises `StopWaiting` once a stop was requested,
in the process that received the signal and in the worker processes it forked since (DataLoader
workers ignore the signals and wait for parts themselves); the loop that started the wait turns
it into a stop after its last completed unit.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from .errors import Interrupted

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(signum: int) -> int:
    """The status a command stopped by `signum` exits with: 128 + signum (130 SIGINT, 143 SIGTERM)."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


_undelivered: list[int] = []
"""The stop signal `stop_at_once` turned into `Interrupted`, until the command ends: where that
exception is raised inside a finalizer (a `__del__` the garbage collector runs mid-startup),
Python drops it and goes on (its "Exception ignored" report is held back), and the next unit of
work (`StopRequest`, `stop_if_signalled`) raises it again instead of starting."""


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    if not _undelivered:
        _undelivered.append(signum)
    raise Interrupted(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def stop_if_signalled() -> None:
    """Raise `Interrupted` for a stop signal whose first one was lost (see `_undelivered`): where a
    command starts a unit of work, or a loop without one (dflash-eval's batches) goes on."""
    if _undelivered and _in_main_thread():
        raise Interrupted(_undelivered[0])


@contextlib.contextmanager
def stop_at_once() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM raise `Interrupted`; the previous handlers come back after."""
    if not _in_main_thread():
        yield
        return
    previous: dict[int, object] = {}
    previous_hook = sys.unraisablehook

    def unraisable(info):  # an Interrupted a finalizer swallowed: kept, raised again, not printed
        if not isinstance(info.exc_value, Interrupted):
            previous_hook(info)

    try:
        # set inside the try: a signal that lands between two of them still restores the first
        for s in STOP_SIGNALS:
            previous[s] = signal.getsignal(s)  # (before: a signal inside signal.signal still finds it)
            signal.signal(s, _raise_interrupted)
        sys.unraisablehook = unraisable
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.unraisablehook = previous_hook
        _undelivered.clear()  # the command is over: its signal, delivered or not, ends with it


@contextlib.contextmanager
def signals_polled() -> Iterator[None]:
    """Within the block, where `stop_at_once` is in place, a stop signal is only recorded: threads
    see it at once (`stop_requested`), and the main thread raises its `Interrupted` where the block
    asks (`stop_if_signalled`) or as the block ends, never from inside the code it is running. For
    a loop that waits on a thread pool: an `Interrupted` raised between two of the lock acquisitions
    of `concurrent.futures.wait` left a future's lock held, so the thread finishing that future
    blocked on it and the pool's shutdown waited for that thread forever. Elsewhere (not the main
    thread, or under a `StopRequest`, whose handler only records), a no-op."""
    if not _in_main_thread() or any(signal.getsignal(s) is not _raise_interrupted for s in STOP_SIGNALS):
        yield
        return

    def record(signum: int, frame: FrameType | None) -> None:
        if not _undelivered:
            _undelivered.append(signum)

    previous: dict[int, object] = {}
    try:
        for s in STOP_SIGNALS:
            previous[s] = signal.signal(s, record)
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
    stop_if_signalled()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM wait: a signal that arrives is handed to the handler that
    was in place once the block ends (a step of a few instructions that must not be cut in two,
    such as the two renames that swap a directory). Elsewhere than the main thread, a no-op."""
    if not _in_main_thread():
        yield
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if received:
            handler = previous[received[0]]
            if callable(handler):
                handler(received[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(received[0])


class StopWaiting(Exception):
    """A wait given up because a stop was requested (`check_stop`). An Exception, not a
    BaseException, so that a DataLoader worker hands it to its trainer (torch re-raises it there
    from its message, the one argument it takes)."""


_stop_signal: Any = None
"""The first stop signal of this process's running `StopRequest` (0: none), in memory shared with
the worker processes it forks meanwhile, which see it too. Made by each process that enters one
(a process forked before shares nothing with it: two runs forked from one parent stop apart)."""
_stop_signal_pid = 0


def _shared_stop_signal() -> Any:
    global _stop_signal, _stop_signal_pid
    if _stop_signal is None or _stop_signal_pid != os.getpid():
        _stop_signal, _stop_signal_pid = multiprocessing.RawValue(ctypes.c_int, 0), os.getpid()
    return _stop_signal


def stop_requested() -> int:
    """The stop signal asked for (this process's `StopRequest`, or the one of the trainer that
    forked this worker; under `stop_at_once`, the signal whose `Interrupted` the main thread may
    not have raised yet: a worker thread's wait ends on it too), or 0."""
    if _undelivered:
        return _undelivered[0]
    return int(_stop_signal.value) if _stop_signal is not None else 0


def check_stop(what: str) -> None:
    """For a loop that waits for `what` (another process's work): raise `StopWaiting` once a stop
    was requested. Call it between looks, at least once a second."""
    if signum := stop_requested():
        raise StopWaiting(f"stopped by {signal_name(signum)} while waiting for {what}")


def kill_worker_processes() -> None:
    """Kill this process's multiprocessing children (e.g. DataLoader workers, which ignore signals)."""
    for child in multiprocessing.active_children():
        child.kill()


class StopRequest:
    """Within a `with` block, the first SIGINT/SIGTERM asks the loop to stop (`requested`);
    a second one calls `on_second` (default: kill the worker processes) and exits at once.

    `finishing` says what the loop does before it stops, `abandoning` what a second signal
    loses; both are printed to stderr when the signal arrives.
    """

    def __init__(self, *, finishing: str = "finishing the work in progress, then exiting",
                 abandoning: str = "exiting now",
                 on_second: Callable[[], None] | None = kill_worker_processes) -> None:
        self.signum = 0  # the first stop signal received; 0: none yet
        self.finishing = finishing
        self.abandoning = abandoning
        self.on_second = on_second
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def exit_status(self) -> int:
        """0 when no stop was requested, else the signal's exit status."""
        return exit_status(self.signum) if self.signum else 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            sys.stderr.write(f"\nSecond {signal_name(signum)}: {self.abandoning}.\n")
            sys.stderr.flush()
            try:
                # torch's DataLoader watches its workers through SIGCHLD and raises when one dies;
                # that handler would run inside this one and turn the exit into a traceback.
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                if self.on_second is not None:
                    self.on_second()
            finally:  # whatever stopping the workers raised, exit with the signal's status
                os._exit(exit_status(signum))
        self.signum = signum
        _shared_stop_signal().value = signum  # what the waits of this process and its workers look at (check_stop)
        sys.stderr.write(f"\n{signal_name(signum)} received: {self.finishing} "
                         "(send it again to exit at once).\n")
        sys.stderr.flush()

    def __enter__(self) -> StopRequest:
        stop_if_signalled()  # a signal came before the work and its stop was lost
        _shared_stop_signal().value = 0  # (made before the work forks its workers)
        if _in_main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()
        _shared_stop_signal().value = 0
