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

import time
from collections.abc import Callable, Iterable
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
from dflash.cache_tools.staging import disk_usage
from dflash.runtime.findings import Finding, emit

from .batching import group_by_budget
from .config import ExtractConfigError

NOTICE_SECONDS = 30.0  # a waiting extraction says why this often
POLL_SECONDS = 0.05
PART_OVERHEAD_BYTES = 128 << 10  # a part's metadata files and folders (blocks), until one is measured


class ExtractionBudget:
    """The disk budget of one extraction process (any number of them may share a cache)."""

    def __init__(self, cache_dir: str | Path, header: dict[str, Any], limit: int, *, follow_epochs: int = 1,
                 schema: Any, announce: Callable[[Finding], None] | None = None):
        self.cache_dir = Path(cache_dir)
        self.limit, self.follow_epochs = int(limit), int(follow_epochs)
        self.commits, self.evictions = CommitLog(self.cache_dir), EvictionLog(self.cache_dir)
        self.header, self.order = header, {}  # plan order: read once the plan is written (evict_one)
        raw = sum((spec.width or 1) * spec.dtype.itemsize for spec in schema if spec.per == "token")
        self.bytes_per_token, self.overhead = float(raw), PART_OVERHEAD_BYTES  # until parts are measured
        self.reserved: dict[str, int] = {}  # admitted parts of this process, not yet committed
        # committed part -> the blocks it takes beyond its files' sizes (metadata files, folders)
        self.overheads: dict[str, int] = {}
        self.evicted_here = 0
        self.announce = announce or (lambda finding: emit(finding, prefix=""))

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

    # -- what a forward batch needs at once ----------------------------------------------------------
    def check_batches(self, windows: Iterable[list], token_budget: int, ranks: int = 1) -> int:
        """Refuse (BudgetTooSmallError) a budget that cannot hold the parts one forward batch spans:
        a batch's parts finish together, so all of them are reserved before any can be committed,
        and nothing this extraction holds open can be evicted. Waiting for room then never ends.
        `windows`: each sort window as its list of parts (data.PartPlan); each of `ranks` extraction
        ranks may hold its largest batch at once. Returns the estimated bytes of the largest batch's parts."""
        self.refresh()
        windows = [([len(p.samples) for p in plans], [s.length for p in plans for s in p.samples],
                    [p.num_tokens for p in plans]) for plans in windows]
        base = self.used() - disk_usage(self.cache_dir / PARTS_DIR, allocated=True)  # manifests, plan

        def need(budget: int) -> tuple[int, int]:
            """(bytes, parts) of the largest batch's parts at --token-budget `budget`."""
            most = (0, 0)
            for counts, lengths, tokens in windows:
                part_of = [k for k, n in enumerate(counts) for _ in range(n)]
                for members in group_by_budget(lengths, budget):
                    spanned = {part_of[m] for m in members}
                    most = max(most, (sum(self.estimate(tokens[k]) for k in spanned), len(spanned)))
            return most

        span, parts = need(token_budget)
        if base + ranks * span <= self.limit or not parts:
            return span
        low, high = 0, token_budget  # the largest --token-budget whose batches fit (0: none does)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if base + ranks * need(mid)[0] <= self.limit else (low, mid - 1)
        raise BudgetTooSmallError(self.limit, base + ranks * span, parts, token_budget, low)

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
                self.announce(self._wait_notice(parts, used, need, start))
            time.sleep(POLL_SECONDS)

    def _wait_notice(self, parts: list[tuple[str, int]], used: int, need: int, since: float) -> Finding:
        """What the wait is for, since when, what holds the room, and what would end it."""
        reports = read_trained(self.cache_dir)
        waited = time.monotonic() - since
        waiting = dict(waited=round(waited), since=time.strftime("%H:%M:%S", time.localtime(time.time() - waited)),
                       part=parts[0][0], more=len(parts) - 1, need=need, used=used, limit=self.limit)
        opened = sum(self.reserved.values())
        if opened + need > self.limit - (used - self.parts_bytes()):
            return Finding("extract.budget-wait-own-batch", **waiting, open_parts=len(self.reserved), reserved=opened)
        untrained = [n for n in self.commits.records if self.present(n)
                     and not trained_by_all(reports, n, self.evictions.state(n).epoch)]
        kept = sum(1 for n in untrained if self.evictions.state(n).epoch > 0)
        return Finding("extract.budget-wait-untrained", **waiting, untrained=len(untrained), kept=kept,
                       trainer_epochs=None if reports is None else [r.epoch for r in reports],
                       trained=None if reports is None else min(len(r.parts) for r in reports))

    def parts_bytes(self) -> int:
        return disk_usage(self.cache_dir / PARTS_DIR, allocated=True)

    # -- eviction ----------------------------------------------------------------------------------
    def evict_one(self) -> bool:
        """Evict the evictable part read furthest in the future; False when none may go."""
        reports = read_trained(self.cache_dir)
        if reports is None:
            return False
        if not self.order and (plan := read_plan(self.cache_dir, self.header)) is not None:
            self.order = {name: i for i, name in enumerate(plan.names())}
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
        self.announce(Finding("extract.budget-evicted", part=record.name, freed=freed, epoch=state.epoch,
                              again=state.epoch + 1 < self.follow_epochs))
        return True

    # -- later epochs ------------------------------------------------------------------------------
    def gone_for_epoch(self, name: str, epoch: int) -> bool:
        """Whether `name` is not on disk for pass `epoch` (>= 1): never committed, or evicted after an
        epoch before it. By the logs as last refreshed (todo_for_epoch keeps the part)."""
        state = self.evictions.state(name)
        return name not in self.commits.records or (state.evicted and state.epoch + 1 <= epoch)

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


class BudgetTooSmallError(ExtractConfigError):
    """--disk-budget cannot hold the parts of one forward batch (ExtractionBudget.check_batches)."""

    def __init__(self, budget: int, smallest: int, parts: int, token_budget: int, fitting_token_budget: int):
        self.budget, self.smallest, self.parts = budget, smallest, parts
        self.token_budget, self.fitting_token_budget = token_budget, fitting_token_budget
        super().__init__(Finding("extract.budget-too-small", budget=budget, smallest=smallest, parts=parts,
                                 token_budget=token_budget, fitting_token_budget=fitting_token_budget))
