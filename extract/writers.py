"""The writer pool: compression and commits off the main thread.

A finished part buffer (extract/buffers.py) goes to the pool, which compresses and commits it
through `CacheWriter`/`PartWriter` (the cache's commit protocol). With `num_writers` > 0 the pool is
that many processes, the buffers live in shared memory, and at most num_writers + 1 buffers
exist at once: the main process blocks for a free one (back-pressure, bounded memory).
With num_writers == 0 parts are written in the main process (CPU runs, tests).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np
from dflash.cache_tools.schema import HIDDEN, ArraySpec
from dflash.cache_tools.writer import CacheWriter
from dflash.runtime.errors import DflashError, EnvironmentFault
from dflash.runtime.findings import Finding
from dflash.runtime.shared_memory import SHM_DIR, shm_free_bytes

from .buffers import PartBuffer, part_layout, part_views
from .data import PartPlan
from .pinned import SegmentPinner, pinnable_bytes, touched_segments, unlink_segment


class WriteError(EnvironmentFault):
    """A part could not be compressed or committed: no memory, no shared memory, no disk space."""


@dataclass(frozen=True)
class PartTask:
    """What a writer needs to commit one part (small; the rows stay in shared memory)."""

    name: str
    shm_name: str | None
    layout: dict[str, tuple[int, tuple, str]]
    sample_ids: list[int]
    split_keys: list[int]
    offsets: np.ndarray
    input_ids: np.ndarray
    loss_mask: np.ndarray
    stats: dict[str, Any]
    grouped: list[int] = field(default_factory=list)  # the samples keyed by their record's group


@dataclass(frozen=True)
class PartResult:
    name: str
    committed: bool  # False: another writer committed this part first
    samples: int
    tokens: int
    nbytes: int
    seconds: float = 0.0  # the writer's time on it: compression, files, fsync, commit


def make_task(buf: PartBuffer) -> PartTask:
    samples = buf.plan.samples
    return PartTask(
        name=buf.plan.name, shm_name=buf.shm.name if buf.shm is not None else None,
        layout=buf.layout, sample_ids=[s.sample_id for s in samples],
        split_keys=[s.split_key for s in samples], grouped=[j for j, s in enumerate(samples) if s.group is not None],
        offsets=buf.offsets,
        input_ids=np.concatenate([s.input_ids for s in samples]),
        loss_mask=np.concatenate([s.loss_mask for s in samples]), stats=buf.plan.stats,
    )


def write_part(cache: CacheWriter, task: PartTask, arrays: dict[str, np.ndarray]) -> PartResult:
    """Commit one part through the cache's PartWriter (all-or-nothing)."""
    off = task.offsets
    start = time.perf_counter()
    with cache.part_writer(task.name) as pw:
        pw.stats.update(task.stats)
        extras = {name: arr for name, arr in arrays.items() if name != HIDDEN}
        pw.add_samples(task.sample_ids, np.diff(off), task.input_ids, task.loss_mask,
                       arrays[HIDDEN], split_keys=task.split_keys, grouped=task.grouped, **extras)
    record = cache.committed().get(task.name)
    return PartResult(
        name=task.name, committed=pw.committed, samples=len(task.sample_ids),
        tokens=int(off[-1]), nbytes=record.nbytes if record is not None else 0,
        seconds=time.perf_counter() - start,
    )


def _portable(exc: BaseException) -> BaseException:
    """The exception itself when it pickles, else a RuntimeError carrying its traceback."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError("".join(traceback.format_exception(exc)))


def _writer_context():
    """Writers start from a fork server that has imported this module once: each writer is
    then a fork of it (milliseconds) instead of a fresh interpreter importing torch and zarr
    (seconds each, and a dozen of them start at once). Never a plain fork: the main process
    holds CUDA state."""
    ctx = mp.get_context("forkserver")
    # '__main__' too: otherwise every writer runs the main script's imports again (a script
    # importing transformers at the top: seconds per writer).
    ctx.set_forkserver_preload(["__main__", __name__])
    return ctx


def start_fork_server() -> None:
    """Start the writers' fork server now (it imports the writer code in the background), so
    that the writer pool, made later, only forks."""
    from multiprocessing import forkserver

    _writer_context()
    forkserver.ensure_running()


def stop_fork_server() -> None:
    """End the writers' fork server with the pool: left alone it lives until this process
    exits, and for a moment after (tearing torch down), outliving the run. The next pool
    starts a new one."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    stop = getattr(server, "_stop", None)  # closes its pipes, reaps it, forgets it
    if stop is not None:
        try:
            stop()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (writers are the fork server's children, not the
    main process's, so the parent pid says nothing about it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _writer_main(cache_dir: str, header: dict, tasks, results, parent_pid: int,
                 env: dict[str, str] | None = None) -> None:
    # The fork server started with the environment of its time: take this run's settings.
    for key in [k for k in os.environ if k.startswith("DFLASH_")]:
        os.environ.pop(key)
    os.environ.update(env or {})
    # Ctrl-C reaches the whole process group: writers finish the part they hold and let the
    # main process decide when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Compression must never starve the process that feeds the GPU.
    os.nice(10)
    attached: dict[str, SharedMemory] = {}  # segments are reused: keep them mapped
    try:
        cache = CacheWriter(cache_dir, header)
    except BaseException as e:  # noqa: BLE001 - reported to the main process
        results.put(("error", None, _portable(e)))
        return
    results.put(("ready", None, None))
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if not _alive(parent_pid):  # the main process died (kill -9): stop
                return
            continue
        if task is None:
            return
        shm = attached.pop(task.shm_name, None) or SharedMemory(name=task.shm_name)
        attached[task.shm_name] = shm
        while len(attached) > 4:  # segments the main process replaced: unmap them
            old = attached.pop(next(iter(attached)))
            try:
                old.close()
            except BufferError:  # a view survived in a traceback; freed at process exit
                pass
        try:
            result = write_part(cache, task, part_views(shm.buf, task.layout))
            results.put(("ok", task.name, result))
        except BaseException as e:  # noqa: BLE001 - reported to the main process
            results.put(("error", task.name, _portable(e)))


class WriterPool:
    """Writes finished parts: inline (num_writers == 0) or in worker processes."""

    def __init__(self, cache: CacheWriter, specs: list[ArraySpec], num_writers: int, *,
                 pinner: SegmentPinner | None = None, segment_tokens: int = 0, pinned_segments: int = 0,
                 open_parts: int = 1):
        """`segment_tokens`: tokens of a full part; `open_parts`: parts filled at once (those of
        the batches in flight), on top of the ones in the writers' hands; `pinned_segments`: how many
        page-locked segments to make (fewer when shared or host memory is short)."""
        self.cache = cache
        self.specs = specs
        self.num_writers = num_writers
        self.results: list[PartResult] = []
        self.nbytes = 0  # stored bytes of the committed parts in `results`
        self._buffers: dict[str, PartBuffer] = {}
        self._free: list[SharedMemory] = []  # segments of committed parts, kept for reuse
        # every segment this pool made, by name: an error may leave one in a part the loop still
        # fills (neither in a writer's hands nor free), which kill() must remove too
        self._created: dict[str, SharedMemory] = {}
        self._procs: list[mp.Process] = []
        self._max_buffers = num_writers + 1
        if num_writers and segment_tokens:
            # Part buffers live in shared memory (a tmpfs): filling one past its free space
            # kills the process with SIGBUS, so size everything to what is there, up front.
            part_bytes = part_layout(specs, segment_tokens)[1]
            fit = _shm_capacity(part_bytes, open_parts, segment_tokens)
            self._max_buffers = max(1, min(self._max_buffers, fit - open_parts))
            pinned_segments = min(pinned_segments, fit, max(1, pinnable_bytes() // part_bytes))
        if num_writers:
            ctx = _writer_context()
            self._tasks = ctx.Queue()
            self._results = ctx.Queue()
            for _ in range(num_writers):
                p = ctx.Process(
                    target=_writer_main, daemon=True,
                    args=(str(cache.cache_dir), cache.header, self._tasks, self._results, os.getpid(),
                          {k: v for k, v in os.environ.items() if k.startswith("DFLASH_")}),
                )
                p.start()
                self._procs.append(p)
        # Page-locked segments are made once, here, before any forward: registering memory
        # with CUDA takes a while per GB and holds the driver's lock, which would stall every
        # kernel launch of a running loop. Parts then cycle through this fixed set.
        self.pinner = pinner if num_writers else None
        self._fixed = False  # parts cycle through a fixed set of page-locked segments
        self.setup_seconds = 0.0
        self._ready = 0
        start = time.perf_counter()
        if self.pinner is not None and pinned_segments:
            try:
                self._free = touched_segments(pinned_segments, part_layout(specs, segment_tokens)[1])
                self._created.update((shm.name, shm) for shm in self._free)
                self._fixed = sum(self.pinner.register(shm) for shm in self._free) > 0
            except BaseException:
                self.close()
                raise
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        self.setup_seconds = time.perf_counter() - start

    def _wait_ready(self) -> None:
        """Until every writer has started (imports, cache opened): started later, inside the
        loop, their start-up would hold back the first parts' buffers while the GPU waits."""
        deadline = time.monotonic() + 300
        while self._ready < sum(p.is_alive() for p in self._procs) and time.monotonic() < deadline:
            self._collect(block=True)  # raises if a writer failed to start, or all died

    @property
    def max_buffers(self) -> int:
        """Parts in the writers' hands at most (num_writers + 1, fewer when shared memory is short)."""
        return self._max_buffers

    def new_buffer(self, plan: PartPlan) -> PartBuffer:
        """A buffer for the next part; blocks while num_writers + 1 buffers are in use, or
        (with page-locked segments) until one of them is free."""
        while self.num_writers and len(self._buffers) >= self.max_buffers:
            self._collect(block=True)
        if not self.num_writers:
            return PartBuffer(plan, self.specs)
        need = PartBuffer.nbytes_for(plan, self.specs)
        shm = self._take_segment(need)
        return PartBuffer(plan, self.specs, shm, pinned=self._is_pinned(shm))

    def _take_segment(self, need: int) -> SharedMemory:
        if self._fixed:
            fits = [s for s in self._free if s.size >= need]
            # Wait for a page-locked segment while parts are being written that will free one.
            while not fits and self._buffers and any(s.size >= need for s in self._pinned_segments()):
                self._collect(block=True)
                fits = [s for s in self._free if s.size >= need]
            if fits:
                self._free.remove(fits[0])
                return fits[0]
            # A part larger than the segments (one long sample), or every segment is still
            # being filled: a plain segment for this part (its rows go through host copies).
            return self._new_segment(need)
        while self._free:
            shm = self._free.pop()
            if shm.size >= need:
                return shm
            unlink_segment(shm)  # a larger part than before: make a larger segment
        return self._new_segment(need + need // 8)

    def _new_segment(self, size: int) -> SharedMemory:
        shm = SharedMemory(create=True, size=size)
        self._created[shm.name] = shm
        return shm

    def _is_pinned(self, shm: SharedMemory) -> bool:
        return self.pinner is not None and self.pinner.is_pinned(shm)

    def _pinned_segments(self) -> list[SharedMemory]:
        held = [b.shm for b in self._buffers.values() if b.shm is not None]
        return [s for s in self._free + held if self._is_pinned(s)]

    def _recycle(self, buf: PartBuffer) -> None:
        shm = buf.release()
        if shm is None:
            return
        if self._fixed and not self._is_pinned(shm):
            unlink_segment(shm)  # an extra plain segment: not kept
        else:
            self._free.append(shm)

    def submit(self, buf: PartBuffer) -> None:
        task = make_task(buf)
        if not self.num_writers:
            try:
                self._add_result(write_part(self.cache, task, buf.arrays))
            except DflashError:
                raise
            except OSError as e:
                raise _write_error(task.name, self.cache.cache_dir, e) from e
            finally:
                buf.release()
            return
        self._buffers[task.name] = buf
        self._tasks.put(task)

    def poll(self) -> None:
        """Collect finished writes without waiting (re-raises a writer's failure)."""
        while self.num_writers and self._collect(block=False):
            pass

    def drain(self) -> None:
        """Wait until every submitted part is committed."""
        while self._buffers:
            self._collect(block=True)

    def _collect(self, *, block: bool) -> bool:
        try:
            kind, name, payload = self._results.get(timeout=1.0) if block else self._results.get_nowait()
        except queue.Empty:
            if block and not any(p.is_alive() for p in self._procs):
                raise WriteError(Finding("extract.writers-died", parts=len(self._buffers))) from None
            return False
        if kind == "ready":
            self._ready += 1
            return True
        buf = self._buffers.pop(name, None) if name is not None else None
        if buf is not None:
            self._recycle(buf)
        if kind == "error":
            if isinstance(payload, DflashError):
                raise payload
            raise _write_error(name, self.cache.cache_dir, payload) from payload
        self._add_result(payload)
        return True

    def _add_result(self, result: PartResult) -> None:
        self.results.append(result)
        self.nbytes += result.nbytes

    def discard(self, buf: PartBuffer) -> None:
        """Drop a part that will not be finished (stop requested)."""
        self._recycle(buf)

    def close(self) -> None:
        """Stop the workers (after drain(), or abandoning queued parts on an error)."""
        if not self._procs:
            return
        for _ in self._procs:
            self._tasks.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._abandon_queues()
        stop_fork_server()
        for buf in self._buffers.values():
            self._recycle(buf)
        self._buffers.clear()
        self.free_segments()

    def _abandon_queues(self) -> None:
        """Never wait for what no writer will read. A task larger than the pipe's buffer (a
        part's input_ids) is written by the queue's feeder thread in pieces; once the writers
        are gone nobody reads the rest, and the exit (which joins that thread) would hang."""
        if self._procs:
            for q in (self._tasks, self._results):
                q.cancel_join_thread()
                q.close()

    def free_segments(self) -> None:
        for shm in self._free:
            unlink_segment(shm, self.pinner)
        self._free.clear()

    def stop_after_error(self, grace: float = 5.0) -> None:
        """An error ends the run: the writers are asked to stop and given `grace` s to exit on
        their own (a part a writer holds may still be committed), so that their exit handlers
        remove what they made (numcodecs' semaphore: a killed writer leaves it to the resource
        tracker, which warns after the error); the rest are killed, as by kill()."""
        if self._procs:
            with contextlib.suppress(OSError, ValueError):  # (a queue already closed)
                for p in self._procs:
                    if p.is_alive():
                        self._tasks.put(None)
            deadline = time.monotonic() + grace
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Second signal or an error: end the workers at once (uncommitted parts are lost, as
        after kill -9)."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        self._abandon_queues()
        stop_fork_server()
        # The process exits right after: only remove the names (a copy may still be landing).
        for buf in self._buffers.values():
            shm = buf.release()
            if shm is not None:
                unlink_segment(shm, unmap=False)
        self._buffers.clear()
        for shm in self._free:
            unlink_segment(shm, unmap=False)
        self._free.clear()
        for shm in self._created.values():  # the rest: a part the loop was filling
            with contextlib.suppress(FileNotFoundError):  # (removed already)
                unlink_segment(shm, unmap=False)
        self._created.clear()


def _shm_capacity(part_bytes: int, open_parts: int, part_tokens: int) -> int:
    """How many part buffers fit in shared memory (90 % of its free space); a clear error
    when not even the parts filled at once plus one for a writer do."""
    free = shm_free_bytes()
    if free is None:
        return 1 << 30
    fit = int(free * 0.9) // max(part_bytes, 1)
    if fit < open_parts + 1:
        raise WriteError(Finding("extract.shared-memory-short", dir=SHM_DIR, free=free, buffers=open_parts + 1,
                                 part_bytes=part_bytes, part_tokens=part_tokens))
    return fit


def _write_error(name: str | None, cache_dir: Path, exc: BaseException) -> WriteError:
    return WriteError(Finding("extract.part-write-failed", part=name, cache=str(cache_dir), error=str(exc)))
