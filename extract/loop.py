"""The main loop of one rank: its windows' batches through the engine into part buffers.

`ExtractionLoop.run(stop)` launches batches on the device, hands each launched batch to a
copier thread that places its rows in the part buffers, and submits every completed part to
the writer pool, until the data ends or `stop.requested`. Its state is explicit: the parts
committed before (`committed`), the buffers being filled (`open_buffers`), the batches
launched and not yet finished (`in_flight`), and the counters of `summary`.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .batching import Batch, make_batches
from .buffers import PartBuffer, PartGroup
from .data import PartPlan, PartRules, plan_windows
from .engine import ExtractionEngine, Pending
from .writers import WriterPool


class StageTimer:
    """Wall time of the main loop's stages, printed at the end with DFLASH_PROFILE_EXTRACT=1."""

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("DFLASH_PROFILE_EXTRACT"))
        self.totals: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.totals[name] = timer.totals.get(name, 0.0) + time.perf_counter() - self.t

        return _Span()

    def report(self) -> None:
        if self.enabled:
            print("main-loop stages (s): " + ", ".join(f"{k} {v:.2f}" for k, v in self.totals.items()),
                  file=sys.stderr, flush=True)


class ExtractionLoop:
    """One rank's share of the windows, batched, computed and handed to the writers.

    `direct`: rows go from the device straight into the (page-locked) part buffers; else
    through the engine's pinned slots and a host-side copy (DFLASH_EXTRACT_STAGED_COPY).
    """

    def __init__(self, *, files: list, rules: PartRules, rank: int, world_size: int, token_budget: int,
                 committed: set[str], engine: ExtractionEngine, pool: WriterPool, progress: Any,
                 summary: Any, direct: bool, budget: Any = None, follow_epochs: int = 1,
                 evicted: set[str] = frozenset()):
        """`budget`: an extract.budget.ExtractionBudget (--disk-budget), with which the loop extracts
        again, for each of `follow_epochs` - 1 later epochs, the parts evicted after the one before.
        `evicted`: committed parts whose files an earlier run under a budget deleted; without a
        budget they are extracted again (restored, checked against the evicted copies)."""
        self.files, self.rules = files, rules
        self.budget, self.follow_epochs = budget, follow_epochs if budget is not None else 1
        self.rank, self.world_size, self.token_budget = rank, world_size, token_budget
        self.committed = committed
        self.restore = set(evicted) if budget is None else set()
        self.extracted: set[str] = set()  # parts this run extracted (a second time: a re-extraction)
        self.engine, self.pool, self.progress, self.summary = engine, pool, progress, summary
        self.direct = direct
        self.timer = StageTimer()
        self.open_buffers: list[PartBuffer] = []  # parts being filled
        self.in_flight: deque[tuple[PartGroup, Pending, Future]] = deque()  # launched, not finished
        self._slab_copiers: ThreadPoolExecutor | None = None

    # -- what this rank does -------------------------------------------------------------------
    def own_groups(self) -> Iterator[PartGroup]:
        """The parts of each sort window this rank takes (whole windows), less committed ones."""
        for plans in plan_windows(self.files, self.rules):
            self.summary.parts_total += len(plans)
            if plans[0].window % self.world_size != self.rank:
                for plan in plans:
                    self.progress.skip(plan)
                continue
            todo = []
            for plan in plans:
                self.summary.parts_this_rank += 1
                todo.append(plan.name not in self.committed or plan.name in self.restore)
                if not todo[-1]:
                    self.summary.parts_done_before += 1
                    self.progress.skip(plan)
            if any(todo):
                yield PartGroup(plans, todo)
        for epoch in range(1, self.follow_epochs):  # --disk-budget: what the next epoch reads again
            # The parts of the pass before are committed first: one still being written would read
            # as missing and be extracted twice.
            self._finish_all()
            for plans in plan_windows(self.files, self.rules):
                if plans[0].window % self.world_size != self.rank:
                    continue
                self.budget.refresh()
                if not any(self.budget.gone_for_epoch(plan.name, epoch) for plan in plans):
                    todo = [self.budget.todo_for_epoch(plan.name, epoch) for plan in plans]  # on disk: kept
                    if any(todo):  # (evicted meanwhile by another rank)
                        yield PartGroup(plans, todo)
                    continue
                # A part is kept for this epoch when the walk reaches it, in the order the trainer
                # reads them: until then it may still be evicted to make room for the parts
                # extracted again before it (kept all at once, they filled the budget: both sides waited).
                yield PartGroup(plans, [None] * len(plans),
                                decide=lambda plan, e=epoch: self.budget.todo_for_epoch(plan.name, e))

    def own_batches(self) -> Iterator[tuple[PartGroup, Batch]]:
        for group in self.own_groups():
            for batch in make_batches(group.samples, self.token_budget):
                yield group, batch

    # -- the loop ------------------------------------------------------------------------------
    def run(self, stop: Any) -> None:
        """Until the data ends or `stop.requested`; then drops the unfinished parts (they are
        redone on resume) and records the signal in the summary."""
        engine = self.engine
        if os.environ.get("DFLASH_SYNC_DEBUG") and engine.cuda:
            # Warn (once per code location) wherever the loop makes the host wait for the GPU.
            torch.cuda.set_sync_debug_mode("warn")
        # The copier waits on CUDA events: its thread uses this process's GPU (not a stray GPU 0 context).
        on_device = dict(initializer=torch.cuda.set_device, initargs=(engine.device,)) if engine.cuda else {}
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-copy", **on_device) as copier, \
                ThreadPoolExecutor(max_workers=4, thread_name_prefix="dflash-slab") as slab_copiers:
            self._slab_copiers = slab_copiers if engine.cuda else None
            self._stop = stop
            for group, batch in self.own_batches():
                if stop.requested:
                    break
                group.open(batch.members, self._new_buffer)
                if stop.requested:  # (it came while waiting for room under --disk-budget)
                    break
                with self.timer("launch"):
                    handle = engine.launch(batch, group if self.direct else None)
                self.in_flight.append((group, handle, copier.submit(self._copy_rows, group, handle)))
                # The next launch reuses the host slot of the batch launched NUM_SLOTS ago.
                while len(self.in_flight) >= engine.NUM_SLOTS - 1:
                    self._finish(*self.in_flight.popleft())
            while self.in_flight:
                self._finish(*self.in_flight.popleft())
        for buf in self.open_buffers:  # stopped midway: the unfinished part is redone on resume
            self.pool.discard(buf)
        self.open_buffers.clear()
        self.summary.interrupted_by = stop.signum or None
        self.timer.report()

    def _finish_all(self) -> None:
        """Finish the batches in flight and commit their complete parts."""
        while self.in_flight:
            self._finish(*self.in_flight.popleft())
        self.pool.drain()

    def _admit(self, plan: PartPlan) -> None:
        """Room under --disk-budget for a part about to be started. Before waiting for it, the
        batches in flight are finished and their parts committed (a trainer may wait for them);
        a part still open then needs this batch to finish, so the new one goes in over the budget
        (the bound's "plus one part") rather than wait for a trainer that may be waiting for it."""
        with self.timer("disk_budget"):
            self.budget.admit([(plan.name, plan.num_tokens)], should_stop=lambda: self._stop.requested,
                              before_wait=self._finish_all, poll=self.pool.poll,
                              may_exceed=lambda: bool(self.open_buffers))

    def _new_buffer(self, plan: PartPlan) -> PartBuffer:
        if self.budget is not None:
            self._admit(plan)  # (a stop request while waiting: the loop stops before the launch)
        with self.timer("new_buffer"):
            buf = self.pool.new_buffer(plan)
        self.open_buffers.append(buf)
        return buf

    def _copy_rows(self, group: PartGroup, handle: Pending) -> None:
        # Runs on the copier thread: waiting on the batch's event and numpy's copy both
        # release the GIL, so the main thread keeps launching while rows move to the part.
        with self.timer("wait"):
            rows = self.engine.wait(handle)
        if handle.direct:
            return
        with self.timer("put"):
            group.put(handle.batch.members, rows, self._slab_copiers)

    def _finish(self, group: PartGroup, handle: Pending, copied: Future) -> None:
        copied.result()
        self.summary.padded_tokens += handle.batch.padded_tokens
        for buf in group.mark_filled(handle.batch.members):
            self._submit(buf)

    def _submit(self, buf: PartBuffer) -> None:
        self.open_buffers.remove(buf)
        plan, summary = buf.plan, self.summary
        with self.timer("submit"):
            self.pool.submit(buf)
            self.pool.poll()
        if plan.name in self.committed or plan.name in self.extracted:  # evicted, extracted again
            summary.parts_reextracted += 1
            summary.tokens_reextracted += plan.num_tokens
            return
        self.extracted.add(plan.name)
        summary.parts_written += 1
        summary.samples += len(plan.samples)
        summary.tokens += plan.num_tokens
        for key in ("skipped_bad", "skipped_long", "truncated"):
            setattr(summary, key, getattr(summary, key) + plan.stats[key])
        summary.skips += plan.stats["skips"]
        self.progress.advance(plan, self.pool.nbytes)
