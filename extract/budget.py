"""`dflash-extract --disk-budget SIZE`: the cache's parts stay within a byte budget while a
trainer follows it, evicting what every training rank has trained on (cache_tools/eviction.py).

Before a part is started, `admit` reserves its estimated bytes (its tokens times the mean bytes
per token of the parts committed so far, before any the arrays' raw size, plus the mean blocks a
part takes beyond its files' sizes): the part starts when the cache's bytes plus the reservations
of this process's parts not yet committed leave room for it, or when no part is held at all (a
part larger than the budget goes through alone). The bytes are what the file system allocates for
the whole cache directory (blocks; manifest files and temporary parts included), not the files'
sizes: a part's dozen metadata files take a block each, and ENOSPC is decided on blocks.
Otherwise it evicts, or waits for the trainer to consume more (it reports its consumption after
each checkpoint). A part that a batch shares with the part still open before it is admitted over
the budget rather than wait (the trainer may be waiting for the open one): with the estimate's
error, that is the "plus one part" of the bound.

Which part goes: the one a trainer will read furthest in the future (Belady's choice). A part
trained on in epoch e is read next in epoch e+1 at its place in the plan (a trainer with
--shuffle-parts reads an epoch's parts group by group in plan order); one never read again (the
last epoch) goes first. Evicting the oldest part instead would evict, in every epoch, each part
just before it is needed: a budget below the cache would re-extract all of it every epoch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash.cache_tools.eviction import (
    EvictionLog,
    evict_part,
    keep_part,
    read_trained,
    trained_by_all,
)
from dflash.cache_tools.manifest import PARTS_DIR, CommitLog
from dflash.cache_tools.plan import read_plan
from dflash.cache_tools.staging import disk_usage, format_size

NOTICE_SECONDS = 30.0  # a waiting extraction says why this often
POLL_SECONDS = 0.05
PART_OVERHEAD_BYTES = 128 << 10  # a part's metadata files and folders (blocks), until one is measured


class ExtractionBudget:
    """The disk budget of one extraction process (any number of them may share a cache)."""

    def __init__(self, cache_dir: str | Path, header: dict[str, Any], limit: int, *, follow_epochs: int = 1,
                 schema: Any, announce: Callable[[str], None] | None = None):
        self.cache_dir = Path(cache_dir)
        self.limit, self.follow_epochs = int(limit), int(follow_epochs)
        self.commits, self.evictions = CommitLog(self.cache_dir), EvictionLog(self.cache_dir)
        plan = read_plan(self.cache_dir, header)
        self.order = {name: i for i, name in enumerate(plan.names())} if plan is not None else {}
        raw = sum((spec.width or 1) * spec.dtype.itemsize for spec in schema if spec.per == "token")
        self.bytes_per_token, self.overhead = float(raw), PART_OVERHEAD_BYTES  # until parts are measured
        self.reserved: dict[str, int] = {}  # admitted parts of this process, not yet committed
        # committed part -> the blocks it takes beyond its files' sizes (metadata files, folders)
        self.overheads: dict[str, int] = {}
        self.evicted_here = 0
        self.announce = announce or (lambda msg: print(msg, file=sys.stderr, flush=True))

    # -- what is held ------------------------------------------------------------------------------
    def refresh(self) -> None:
        self.commits.refresh()
        self.evictions.refresh()
        tokens = sum(r.tokens for r in self.commits.records.values())
        if tokens:  # the mean of the committed parts: a short estimate is the bound's one part
            self.bytes_per_token = sum(r.nbytes for r in self.commits.records.values()) / tokens
        for name, record in self.commits.records.items():
            if name not in self.overheads and self.present(name):
                part_dir = self.cache_dir / PARTS_DIR / name
                allocated = disk_usage(part_dir, allocated=True)
                if part_dir.is_dir():  # (not evicted meanwhile by another rank)
                    self.overheads[name] = max(0, allocated - record.nbytes)
        if self.overheads:
            self.overhead = sum(self.overheads.values()) // len(self.overheads)
        for name in [n for n in self.reserved if self.present(n)]:
            del self.reserved[name]

    def present(self, name: str) -> bool:
        return name in self.commits.records and not self.evictions.is_evicted(name)

    def used(self) -> int:
        return disk_usage(self.cache_dir, allocated=True)

    def holds_no_part(self) -> bool:
        parts = self.cache_dir / PARTS_DIR
        return not parts.is_dir() or not any(parts.iterdir())

    def estimate(self, tokens: int) -> int:
        return int(tokens * self.bytes_per_token) + self.overhead

    # -- admission ---------------------------------------------------------------------------------
    def admit(self, parts: list[tuple[str, int]], *, should_stop: Callable[[], bool],
              before_wait: Callable[[], None] = lambda: None, poll: Callable[[], None] = lambda: None,
              may_exceed: Callable[[], bool] = lambda: False) -> bool:
        """Reserve room for `parts` ((name, tokens) each) before they are started; waits (after
        `before_wait`, which finishes the work in flight: a trainer may wait for those parts)
        until there is room, or until `may_exceed()` says a part of this process cannot be
        finished without these: they are admitted over the budget then, if what is held is below it
        and nothing may be evicted.
        False: `should_stop()` turned true while waiting."""
        start, noticed, waited_once = time.monotonic(), 0.0, False
        while True:
            self.refresh()
            need = sum(self.estimate(tokens) for _, tokens in parts)
            used, held = self.used(), sum(self.reserved.values())
            if used + held + need <= self.limit or (held == 0 and self.holds_no_part()):
                for name, tokens in parts:
                    self.reserved[name] = self.estimate(tokens)
                return True
            if not waited_once:
                before_wait()
                waited_once = True
                continue
            poll()
            if self.evict_one():
                continue
            if used + held <= self.limit and may_exceed():  # below the budget: at most one part over
                for name, tokens in parts:
                    self.reserved[name] = self.estimate(tokens)
                return True
            if should_stop():
                return False
            waited = time.monotonic() - start
            if waited - noticed >= NOTICE_SECONDS:
                noticed = waited
                self.announce(self._wait_notice(parts, used, need, waited))
            time.sleep(POLL_SECONDS)

    def _wait_notice(self, parts: list[tuple[str, int]], used: int, need: int, waited: float) -> str:
        reports = read_trained(self.cache_dir)
        trainer = ("no training run reports its consumption yet (dflash-train --follow writes "
                   "manifest.trained-rank*.json after each checkpoint)" if reports is None else
                   "the training ranks are at epoch " + ", ".join(str(r.epoch) for r in reports)
                   + f" and have trained {min(len(r.parts) for r in reports)} of this epoch's parts")
        return (f"--disk-budget: waiting {waited:.0f} s for room for {parts[0][0]}"
                f"{f' and {len(parts) - 1} more part(s)' if len(parts) > 1 else ''} ({format_size(need)}): "
                f"{format_size(used)} of {format_size(self.limit)} held and nothing may be evicted; {trainer}. "
                "A part may go once every rank has trained on it and checkpointed; if the trainer is waiting "
                "too, the budget is below what it reads at once (a group of --shuffle-parts plus the parts "
                "read since its last checkpoint): raise --disk-budget, lower --shuffle-parts or --save-interval.")

    # -- eviction ----------------------------------------------------------------------------------
    def evict_one(self) -> bool:
        """Evict the evictable part read furthest in the future; False when none may go."""
        reports = read_trained(self.cache_dir)
        if reports is None:
            return False
        best, best_key = None, None
        for name, record in self.commits.records.items():
            state = self.evictions.state(name)
            if state.evicted or not trained_by_all(reports, name, state.epoch):
                continue
            next_epoch = state.epoch + 1
            key = (next_epoch >= self.follow_epochs, next_epoch, self.order.get(name, len(self.order)))
            if best_key is None or key > best_key:
                best, best_key = (record, state), key
        if best is None:
            return False
        record, state = best
        freed = evict_part(self.cache_dir, record, state.epoch, reextract=state.epoch + 1 < self.follow_epochs)
        self.evicted_here += 1
        self.announce(f"--disk-budget: evicted {record.name} ({format_size(freed)}; trained on in epoch "
                      f"{state.epoch} by every training rank"
                      + (f", extracted again for epoch {state.epoch + 1})" if state.epoch + 1 < self.follow_epochs
                         else ", not read again)"))
        return True

    # -- later epochs ------------------------------------------------------------------------------
    def todo_for_epoch(self, name: str, epoch: int) -> bool:
        """Whether pass `epoch` (>= 1) must extract `name` again: it was evicted after an earlier
        epoch. A part still on disk is kept for `epoch` instead (not evicted before it is read then)."""
        self.refresh()
        if name not in self.commits.records:
            return True
        state = self.evictions.state(name)
        if state.evicted:
            return state.epoch + 1 <= epoch
        return not keep_part(self.cache_dir, name, epoch)
