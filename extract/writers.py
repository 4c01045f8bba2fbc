"""Part buffers and the writer pool: compression and commits off the main thread.

The main process fills one `PartBuffer` per part (rows in input order) from the batches'
host copies; a finished buffer goes to the pool, which compresses and commits it through
`CacheWriter`/`PartWriter` (the cache's commit protocol). With `num_writers` > 0 the pool is
that many processes, the buffers live in shared memory, and at most num_writers + 1 buffers
exist at once: the main process blocks for a free one (back-pressure, bounded memory).
With num_writers == 0 parts are written in the main process (CPU runs, tests).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dflash.cache_tools.errors import DflashError
from dflash.cache_tools.writer import CacheWriter

from .data import PartPlan


class WriteError(DflashError):
    """A part could not be compressed or committed."""


@dataclass(frozen=True)
class Field:
    """One per-token array of a part: its row shape and dtype."""

    name: str
    width: int
    dtype: str


def part_fields(*, width: int, hidden_size: int, num_layers: int, storage_dtype: str,
                has_scale: bool, last_hidden: bool, topk: int) -> list[Field]:
    fields = [Field("hidden", width, storage_dtype)]
    if has_scale:
        fields.append(Field("hidden_scale", num_layers, "float32"))
    if last_hidden:
        fields.append(Field("last_hidden", hidden_size, storage_dtype))
        if has_scale:
            fields.append(Field("last_hidden_scale", 1, "float32"))
    if topk:
        fields += [Field("topk_ids", topk, "int32"), Field("topk_logprobs", topk, "float32")]
    return fields


def _layout(fields: list[Field], tokens: int) -> tuple[dict[str, tuple[int, tuple, str]], int]:
    """{name: (byte offset, shape, dtype)} of the arrays packed in one buffer, and its size."""
    out, pos = {}, 0
    for f in fields:
        pos = (pos + 63) // 64 * 64
        out[f.name] = (pos, (tokens, f.width), f.dtype)
        pos += tokens * f.width * np.dtype(f.dtype).itemsize
    return out, max(pos, 1)


def _views(buf, layout: dict[str, tuple[int, tuple, str]]) -> dict[str, np.ndarray]:
    return {
        name: np.ndarray(shape, dtype=dtype, buffer=buf, offset=off)
        for name, (off, shape, dtype) in layout.items()
    }


class PartBuffer:
    """The host-side rows of one part, filled batch by batch in any sample order.

    The rows live in `segment` (shared memory the writer processes map) or, without one, in
    process memory. `pinned` says the segment is registered with CUDA: the device then copies
    rows straight into it (`put_tensors`), with no host-side copy at all.
    """

    def __init__(self, plan: PartPlan, fields: list[Field], segment: SharedMemory | None = None,
                 *, pinned: bool = False):
        self.plan = plan
        lengths = np.array([s.length for s in plan.samples], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.layout, size = _layout(fields, int(self.offsets[-1]))
        if segment is not None and segment.size < size:
            raise ValueError(f"segment of {segment.size} bytes is too small for part {plan.name} ({size})")
        self.shm = segment
        self.pinned = pinned and segment is not None
        self._local = None if segment is not None else bytearray(size)
        self.arrays = _views(segment.buf if segment is not None else self._local, self.layout)
        self._tensors: dict[str, torch.Tensor] | None = None
        self.filled = 0

    @staticmethod
    def nbytes_for(plan: PartPlan, fields: list[Field]) -> int:
        return _layout(fields, plan.num_tokens)[1]

    def row_jobs(self, i: int, pos: int, rows: dict[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(destination, source) pairs placing sample i, found at rows[pos:], in the part."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return [(arr[lo:hi], rows[name][pos:pos + hi - lo]) for name, arr in self.arrays.items()]

    def copy_sample(self, i: int, pos: int, packed: dict[str, torch.Tensor]) -> None:
        """Copy sample i, found at packed[pos:] (device tensors), to its place in the part:
        asynchronous on the current stream when the segment is pinned (a DMA straight into
        shared memory), synchronous otherwise."""
        if self._tensors is None:
            self._tensors = {name: torch.from_numpy(_signed(arr)) for name, arr in self.arrays.items()}
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        for name, dst in self._tensors.items():
            dst[lo:hi].copy_(packed[name][pos:pos + hi - lo], non_blocking=self.pinned)

    def put(self, members: list[int], rows: dict[str, np.ndarray], copiers: Executor | None = None) -> None:
        """Copy one batch's packed rows (members in batch order) to their places in the part."""
        PartGroup.of(self).put(members, rows, copiers)

    def put_tensors(self, members: list[int], packed: dict[str, torch.Tensor]) -> None:
        """Copy one batch's packed rows from (device) tensors to their places in the part."""
        PartGroup.of(self).put_tensors(members, packed)

    def mark_filled(self, count: int) -> None:
        """Count samples whose rows are in place (called by the loop, in batch order)."""
        self.filled += count

    @property
    def complete(self) -> bool:
        return self.filled == len(self.plan.samples)

    def release(self) -> SharedMemory | None:
        """Drop the views; returns the shared segment for reuse (or None)."""
        self.arrays, self._tensors = {}, None
        shm, self.shm, self._local = self.shm, None, None
        return shm


class PartGroup:
    """The parts of one sort window, batched together. The window's samples are sorted by
    length and cut into parts in that order (data.plan_windows), so batches move through the
    parts one after the other: a part's buffer is taken when the first batch touches it
    (`open`), and at most the parts of the batches in flight are open at once. Windows are
    cut from the data alone, so the batches, and with them every value, are the same on any
    number of ranks and after any resume. A part already committed by an earlier run gets
    no buffer: its samples are still computed (their batch mates must see the same batches)
    but their rows are dropped.

    Sample j of the window is sample `where[j][1]` of part `where[j][0]`; a batch's members
    are window indices."""

    def __init__(self, plans: list[PartPlan], todo: list[bool],
                 buffers: list[PartBuffer | None] | None = None):
        self.plans = plans
        self.todo = list(todo)
        self.buffers: list[PartBuffer | None] = list(buffers) if buffers is not None else [None] * len(plans)
        self.where = [(p, i) for p, plan in enumerate(plans) for i in range(len(plan.samples))]
        self.samples = [s for plan in plans for s in plan.samples]

    @classmethod
    def of(cls, buffer: PartBuffer) -> PartGroup:
        return cls([buffer.plan], [True], [buffer])

    def open(self, members: list[int], new_buffer) -> list[PartBuffer]:
        """Buffers (from `new_buffer(plan)`) for the parts to do that this batch touches
        first; returns the new ones."""
        opened = []
        for m in members:
            p = self.where[m][0]
            if self.todo[p] and self.buffers[p] is None:
                self.buffers[p] = new_buffer(self.plans[p])
                opened.append(self.buffers[p])
        return opened

    def _buffer(self, member: int) -> tuple[PartBuffer | None, int]:
        p, i = self.where[member]
        buf = self.buffers[p]
        if buf is None and self.todo[p]:
            raise RuntimeError(f"{self.plans[p].name}: rows placed before its buffer was opened")
        return buf, i

    def pinned_for(self, members: list[int]) -> bool:
        """Whether every part this batch writes to is page-locked (rows can go by DMA)."""
        bufs = [self._buffer(m)[0] for m in members]
        return all(b.pinned for b in bufs if b is not None)

    def put(self, members: list[int], rows: dict[str, np.ndarray], copiers: Executor | None = None) -> None:
        """Place one batch's packed host rows (members in batch order) in their parts.

        With `copiers`, the per-sample copies run on several threads (numpy releases the GIL
        while copying): one thread moves only a few GB/s, a batch of the 8B shape is ~1.3 GB.
        """
        jobs, pos = [], 0
        for m in members:
            buf, i = self._buffer(m)
            if buf is not None:
                jobs += buf.row_jobs(i, pos, rows)
            pos += self.samples[m].length
        if copiers is None:
            for dst, src in jobs:
                dst[...] = src
            return
        for future in [copiers.submit(np.copyto, dst, src) for dst, src in jobs]:
            future.result()

    def put_tensors(self, members: list[int], packed: dict[str, torch.Tensor]) -> None:
        """Place one batch's packed rows from (device) tensors in their parts, one copy per
        sample and array, queued on the current stream."""
        pos = 0
        for m in members:
            buf, i = self._buffer(m)
            if buf is not None:
                buf.copy_sample(i, pos, packed)
            pos += self.samples[m].length

    def mark_filled(self, members: list[int]) -> list[PartBuffer]:
        """Count the batch's samples as in place; returns the parts this completed."""
        done = []
        for m in members:
            buf, _i = self._buffer(m)
            if buf is not None:
                buf.mark_filled(1)
                if buf.complete:
                    done.append(buf)
        return done


def _signed(arr: np.ndarray) -> np.ndarray:
    """torch has no uint16 copies: bf16 bits travel as int16 (same bytes)."""
    return arr.view(np.int16) if arr.dtype == np.uint16 else arr


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


def _unlink(shm: SharedMemory, pinner: SegmentPinner | None = None, *, unmap: bool = True) -> None:
    """Remove a segment (unpinning it first when `pinner` pinned it); without `unmap`, only
    its name (the process is about to exit)."""
    if unmap:
        if pinner is not None:
            pinner.unregister(shm)
        shm.close()
    shm.unlink()


@dataclass(frozen=True)
class PartTask:
    """What a writer needs to commit one part (small; the rows stay in shared memory)."""

    name: str
    shm_name: str | None
    layout: dict[str, tuple[int, tuple, str]]
    sample_ids: list[int]
    offsets: np.ndarray
    input_ids: np.ndarray
    loss_mask: np.ndarray
    stats: dict[str, Any]


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
        layout=buf.layout, sample_ids=[s.sample_id for s in samples], offsets=buf.offsets,
        input_ids=np.concatenate([s.input_ids for s in samples]),
        loss_mask=np.concatenate([s.loss_mask for s in samples]), stats=buf.plan.stats,
    )


def write_part(cache: CacheWriter, task: PartTask, arrays: dict[str, np.ndarray]) -> PartResult:
    """Commit one part through the cache's PartWriter (all-or-nothing)."""
    off = task.offsets
    start = time.perf_counter()
    with cache.part_writer(task.name) as pw:
        pw.stats.update(task.stats)
        extras = {name: arr for name, arr in arrays.items() if name != "hidden"}
        pw.add_samples(task.sample_ids, np.diff(off), task.input_ids, task.loss_mask,
                       arrays["hidden"], **extras)
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
    (seconds each, 12 at once: ~15 s). Never a plain fork: the main process holds CUDA state."""
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
            result = write_part(cache, task, _views(shm.buf, task.layout))
            results.put(("ok", task.name, result))
        except BaseException as e:  # noqa: BLE001 - reported to the main process
            results.put(("error", task.name, _portable(e)))


class WriterPool:
    """Writes finished parts: inline (num_writers == 0) or in worker processes."""

    def __init__(self, cache: CacheWriter, fields: list[Field], num_writers: int, *,
                 pinner: SegmentPinner | None = None, segment_tokens: int = 0, pinned_segments: int = 0,
                 open_parts: int = 1):
        """`segment_tokens`: tokens of a full part; `open_parts`: parts filled at once (those of
        the batches in flight), on top of the ones in the writers' hands; `pinned_segments`: how many
        page-locked segments to make (fewer when shared or host memory is short)."""
        self.cache = cache
        self.fields = fields
        self.num_writers = num_writers
        self.results: list[PartResult] = []
        self.nbytes = 0  # stored bytes of the committed parts in `results`
        self._buffers: dict[str, PartBuffer] = {}
        self._free: list[SharedMemory] = []  # segments of committed parts, kept for reuse
        self._procs: list[mp.Process] = []
        self._max_buffers = num_writers + 1
        if num_writers and segment_tokens:
            # Part buffers live in shared memory (a tmpfs): filling one past its free space
            # kills the process with SIGBUS, so size everything to what is there, up front.
            part_bytes = _layout(fields, segment_tokens)[1]
            fit = _shm_capacity(part_bytes, open_parts, segment_tokens)
            self._max_buffers = max(1, min(self._max_buffers, fit - open_parts))
            pinned_segments = min(pinned_segments, fit, max(1, _pinnable_bytes() // part_bytes))
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
        # with CUDA takes ~0.5 s/GB and holds the driver's lock, which would stall every
        # kernel launch of a running loop. Parts then cycle through this fixed set.
        self.pinner = pinner if num_writers else None
        self._fixed = False  # parts cycle through a fixed set of page-locked segments
        self.setup_seconds = 0.0
        self._ready = 0
        start = time.perf_counter()
        if self.pinner is not None and pinned_segments:
            try:
                self._free = _touched_segments(pinned_segments, _layout(fields, segment_tokens)[1])
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
            return PartBuffer(plan, self.fields)
        need = PartBuffer.nbytes_for(plan, self.fields)
        shm = self._take_segment(need)
        return PartBuffer(plan, self.fields, shm, pinned=self._is_pinned(shm))

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
            return SharedMemory(create=True, size=need)
        while self._free:
            shm = self._free.pop()
            if shm.size >= need:
                return shm
            _unlink(shm)  # a larger part than before: make a larger segment
        return SharedMemory(create=True, size=need + need // 8)

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
            _unlink(shm)  # an extra plain segment: not kept
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
                raise WriteError(
                    "All writer processes died (out of memory?) with parts still to write. "
                    "Rerun the same command to resume; lower --num-writers or --part-tokens if "
                    "memory is short."
                ) from None
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
        stop_fork_server()
        for buf in self._buffers.values():
            self._recycle(buf)
        self._buffers.clear()
        self.free_segments()

    def free_segments(self) -> None:
        for shm in self._free:
            _unlink(shm, self.pinner)
        self._free.clear()

    def kill(self) -> None:
        """Second signal: end the workers at once (uncommitted parts are lost, as after kill -9)."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        stop_fork_server()
        # The process exits right after: only remove the names (a copy may still be landing).
        for buf in self._buffers.values():
            shm = buf.release()
            if shm is not None:
                _unlink(shm, unmap=False)
        self._buffers.clear()
        for shm in self._free:
            _unlink(shm, unmap=False)
        self._free.clear()


SHM_DIR = "/dev/shm"


def shm_free_bytes() -> int | None:
    """Free bytes of the shared-memory file system (None where there is none to ask)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _shm_capacity(part_bytes: int, open_parts: int, part_tokens: int) -> int:
    """How many part buffers fit in shared memory (90 % of its free space); a clear error
    when not even the parts filled at once plus one for a writer do."""
    free = shm_free_bytes()
    if free is None:
        return 1 << 30
    fit = int(free * 0.9) // max(part_bytes, 1)
    if fit < open_parts + 1:
        raise WriteError(
            f"Shared memory ({SHM_DIR}) has {free / 1e9:.2f} GB free, but extraction needs "
            f"{open_parts + 1} part buffers of {part_bytes / 1e9:.2f} GB there ({open_parts} filled "
            f"at once by the batches in flight, one for a writer process; --part-tokens {part_tokens}). "
            "Enlarge it (docker: --shm-size), lower --part-tokens or --token-budget, or write "
            "from the main process with --num-writers 0."
        )
    return fit


def _pinnable_bytes() -> int:
    """Page-locked memory this process may take: a quarter of the host's, shared by its ranks."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // 4 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _touched_segments(count: int, size: int) -> list[SharedMemory]:
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


def _write_error(name: str | None, cache_dir: Path, exc: BaseException) -> WriteError:
    return WriteError(
        f"Writing part {name} into {cache_dir} failed: {exc}. Free space or fix the cause, "
        "then rerun the same command: committed parts are kept and the rest is redone."
    )
