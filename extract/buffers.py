"""Part buffers: the host-side rows of the parts being filled, and the window they belong to.

The main process fills one `PartBuffer` per part (rows in input order) from the batches'
copies; its arrays are those of the part schema that the target computes
(`PartSchema.from_target`), packed in one block of memory: shared memory that the writer
processes map (extract/writers.py), page-locked for DMA where possible (extract/pinned.py),
or process memory when parts are written in the main process.
"""

from __future__ import annotations

from concurrent.futures import Executor
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch
from dflash.cache_tools.schema import ArraySpec, sample_offsets

from .data import PartPlan


def part_layout(specs: list[ArraySpec], tokens: int) -> tuple[dict[str, tuple[int, tuple, str]], int]:
    """{name: (byte offset, shape, dtype)} of the arrays packed in one buffer (64-byte aligned),
    and its size."""
    out, pos = {}, 0
    for spec in specs:
        pos = (pos + 63) // 64 * 64
        out[spec.name] = (pos, (tokens, spec.width), spec.dtype.str)
        pos += tokens * spec.width * spec.dtype.itemsize
    return out, max(pos, 1)


def part_views(buf, layout: dict[str, tuple[int, tuple, str]]) -> dict[str, np.ndarray]:
    return {
        name: np.ndarray(shape, dtype=dtype, buffer=buf, offset=off)
        for name, (off, shape, dtype) in layout.items()
    }


class PartBuffer:
    """The host-side rows of one part, filled batch by batch in any sample order.

    The rows live in `segment` (shared memory the writer processes map) or, without one, in
    process memory. `pinned` says the segment is registered with CUDA: the device then copies
    rows straight into it (`PartGroup.put_tensors`), with no host-side copy at all.
    """

    def __init__(self, plan: PartPlan, specs: list[ArraySpec], segment: SharedMemory | None = None,
                 *, pinned: bool = False):
        self.plan = plan
        self.offsets = sample_offsets([s.length for s in plan.samples])
        self.layout, size = part_layout(specs, int(self.offsets[-1]))
        if segment is not None and segment.size < size:
            raise ValueError(f"segment of {segment.size} bytes is too small for part {plan.name} ({size})")
        self.shm = segment
        self.pinned = pinned and segment is not None
        self._local = None if segment is not None else bytearray(size)
        self.arrays = part_views(segment.buf if segment is not None else self._local, self.layout)
        self._tensors: dict[str, torch.Tensor] | None = None
        self.filled = 0

    @staticmethod
    def nbytes_for(plan: PartPlan, specs: list[ArraySpec]) -> int:
        return part_layout(specs, plan.num_tokens)[1]

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
    are window indices. A part's `todo` may be left undecided (None) until the first batch
    touches it: `decide(plan)` says then whether it is done (a later epoch under a disk budget
    keeps a part on disk only when the walk reaches it, extract/loop.py)."""

    def __init__(self, plans: list[PartPlan], todo: list[bool | None],
                 buffers: list[PartBuffer | None] | None = None, decide=None):
        self.plans = plans
        self.todo = list(todo)
        self.decide = decide
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
            if self.todo[p] is None:
                self.todo[p] = bool(self.decide(self.plans[p]))
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
        while copying): one thread alone would hold the loop back on a large batch.
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
