"""A cache that dflash-extract is still filling, read as a sample source (`dflash-train --follow`).

The batches of a run are planned before any sample is read, from the sample ids and lengths. On
a cache still being extracted those come from the extraction plan (plan.py), which the
extractor writes at its start: `FollowCacheSet` is the list of samples that plan promises, in
sample id order, and reading one waits until the part that holds it is committed (and, under a
disk budget, until a part evicted is extracted again). It reads with a `CacheReader` whose part
list grows as parts are committed, so it imports no torch, like the rest of cache_tools.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from dflash.runtime.findings import Finding, emit
from dflash.runtime.locks import is_held
from dflash.runtime.signals import check_stop

from .errors import CacheCorruptError, CacheError, CacheNotFoundError
from .eviction import TRAINED_PREFIX, EvictionLog, PartState, write_trained
from .manifest import (
    HEADER_FILE,
    PARTS_DIR,
    WRITER_LOCK_FILE,
    CommitLog,
    Manifest,
    header_identity,
    read_header,
)
from .plan import PLAN_FILE, ExtractionPlan, ExtractionProgress, extraction_progress, read_plan
from .quarantine import QUARANTINE_DIR
from .reader import CacheReader
from .schema import SAMPLE_IDS, sample_offsets
from .sources import part_number

START_SECONDS = 600.0  # a path where no extraction has begun is waited on this long (an extractor loading its target)
POLL_SECONDS = 0.05  # first wait between looks at the commit log; doubles up to MAX_POLL_SECONDS
MAX_POLL_SECONDS = 0.5
TRAINED_GLOB = f"{TRAINED_PREFIX}*.json"
NOTICE_SECONDS = 30.0  # a waiting trainer says what it waits for this often


def announce_wait(finding: Finding) -> None:
    """Say a wait notice on stdout, where the trainer's lines go (the default `announce`)."""
    emit(finding, prefix="", stream=sys.stdout)


def wait_for_plan(cache_dir: Path, announce: Callable[[Finding], None], *,
                  start_seconds: float = START_SECONDS) -> tuple[dict[str, Any], ExtractionPlan]:
    """The header and extraction plan of a cache, waiting until dflash-extract has written them.

    Waits only where the plan can come: a path where no extraction has begun (no such directory,
    or an empty one) is waited on for `start_seconds` (an extraction started beside this run
    creates it once its target is loaded), then refused; one that cannot become a followed cache
    (a file, another directory's files, a cache with parts but no plan and no extraction writing
    it) is refused at once. Every look checks the stop request (runtime.signals.check_stop)."""
    start, noticed, since = time.monotonic(), -NOTICE_SECONDS, time.strftime("%H:%M:%S")
    while True:
        header = None
        try:
            header = read_header(cache_dir)
        except CacheNotFoundError:
            pass
        plan = read_plan(cache_dir, header) if header is not None else None
        if plan is not None:
            return header, plan
        waited = time.monotonic() - start
        state = _plan_wait_state(cache_dir, header, waited, start_seconds)
        if waited - noticed >= NOTICE_SECONDS:
            noticed = waited
            announce(Finding("cache.follow-waiting-for-plan", cache=str(cache_dir), plan=PLAN_FILE, since=since,
                             waited=round(waited), state=state, header=HEADER_FILE, limit=round(start_seconds)))
        check_stop(f"the extraction plan of {cache_dir}")
        time.sleep(MAX_POLL_SECONDS)


def _plan_wait_state(cache_dir: Path, header: dict[str, Any] | None, waited: float, start_seconds: float) -> str:
    """What a wait for the plan of `cache_dir` waits on (which ends it: cache.follow-waiting-for-plan's
    state): "no-directory" or "no-header" (no cache there yet), "stopped" (no extraction writes it),
    "starting"; refuses (CacheError, exit 2) where the plan cannot come."""
    if cache_dir.exists() and not cache_dir.is_dir():
        raise CacheError(Finding("cache.follow-not-a-directory", cache=str(cache_dir)))
    if header is None:
        present = sorted(p.name for p in cache_dir.iterdir()) if cache_dir.is_dir() else []
        foreign = [n for n in present if not n.startswith(".") and n not in (PARTS_DIR, PLAN_FILE, QUARANTINE_DIR)]
        if foreign:
            raise CacheError(Finding("cache.follow-foreign-directory", cache=str(cache_dir), files=foreign[:3],
                                     header=HEADER_FILE))
        if waited >= start_seconds:
            raise CacheError(Finding("cache.follow-no-extraction", cache=str(cache_dir), seconds=round(waited),
                                     missing=HEADER_FILE if present else None))
        return "no-header" if present else "no-directory"
    running = extraction_running(cache_dir)
    log = CommitLog(cache_dir)
    log.refresh()
    if log.records and running is False:
        raise CacheError(Finding("cache.follow-no-plan", cache=str(cache_dir), parts=len(log.records),
                                 plan=PLAN_FILE))
    return "stopped" if running is False else "starting"


def extraction_running(cache_dir: Path) -> bool | None:
    """Whether a process on this host writes `cache_dir` (holds its writer lock); None where that
    cannot be told (runtime.locks.is_held)."""
    lock = cache_dir / WRITER_LOCK_FILE
    return is_held(lock) if lock.exists() else False


class FollowCacheSet:
    """The samples an extraction plan promises, in sample id order; reading one waits until its
    part is committed. A `sources.SampleSource` of one cache."""

    follows = True

    def __init__(self, cache_dir: str, *, max_seq_len: int, verify_checksums: bool = True,
                 announce: Callable[[Finding], None] = announce_wait):
        self.cache_dir = Path(cache_dir)
        header, self.plan = wait_for_plan(self.cache_dir, announce)
        # One reader whose part list grows as parts are committed (each process its own copy).
        self.reader = CacheReader(self.cache_dir, verify_checksums=verify_checksums,
                                  manifest=Manifest(self.cache_dir, header, []))
        self.readers = [self.reader]
        self.manifest = self.reader.manifest
        parts = self.plan.parts
        ids = np.array([i for p in parts for i in p.sample_ids], dtype=np.int64)
        full = np.array([n for p in parts for n in p.lengths], dtype=np.int64)
        part = np.concatenate([np.full(len(p.sample_ids), k, np.int64) for k, p in enumerate(parts)])
        local = np.concatenate([np.arange(len(p.sample_ids), dtype=np.int64) for p in parts])
        order = np.argsort(ids, kind="stable")
        self._ids, self._part, self._local = ids[order], part[order], local[order]
        # The split keys the commit records will list (a plan of before has none: the sample ids).
        keys = np.array([k for p in parts for k in (p.sample_ids if p.split_keys is None else p.split_keys)],
                        dtype=np.int64)
        self._split_keys = keys[order]
        self.full_lengths = full[order]
        self.lengths = np.minimum(self.full_lengths, max_seq_len)
        self.max_seq_len = max_seq_len
        self.truncated_samples = int((self.full_lengths > max_seq_len).sum())
        self.truncated_tokens = int((self.full_lengths - self.lengths).sum())
        self.starts = np.array([0, len(ids)], dtype=np.int64)
        self._numbers = np.array([part_number(p.name, k) for k, p in enumerate(parts)], np.int64)[self._part]
        self._log = CommitLog(self.cache_dir)
        self._evictions = EvictionLog(self.cache_dir)  # parts evicted under a disk budget
        self._in_reader: dict[int, int] = {}  # planned part -> its index in the reader's part list
        self._opened_as: dict[int, PartState] = {}  # planned part -> its state when last found present
        self._evictions_seen = 0  # evicted events whose maps were dropped (_drop_evicted)
        self._offsets: dict[int, np.ndarray] = {}
        self.announce = announce
        # The training epoch the batch being read is for (the loader sets it; None: an evaluation).
        self.reading_epoch: int | None = None

    def __len__(self) -> int:
        return len(self._ids)

    def sample_ids(self) -> np.ndarray:
        return self._ids

    def split_keys(self) -> np.ndarray:
        return self._split_keys

    def part_numbers(self) -> np.ndarray:
        return self._numbers

    def identity(self) -> list[dict[str, Any]]:
        """As CacheSet.identity() of the finished cache: a follow run resumes offline, and back."""
        return [{"identity": header_identity(self.manifest.header), "samples": len(self),
                 "tokens": int(self.full_lengths.sum())}]

    def part_names(self) -> list[str]:
        return [p.name for p in self.plan.parts]

    def sample_parts(self) -> np.ndarray:
        return self._part

    def grouped(self) -> None:
        return None  # (the plan does not say which samples' keys are their group's)

    def progress(self) -> ExtractionProgress:
        return extraction_progress(self.plan, self._log)

    def committed_records(self) -> list[Any]:
        """The commit records of the parts committed so far (a disk budget's bytes per token)."""
        self._log.refresh()
        return list(self._log.records.values())

    def report_trained(self, parts: list[str], *, epoch: int, rank: int, world_size: int) -> None:
        """Close the maps of `parts` (release), then record that this rank trained on them in
        `epoch` (eviction.write_trained): an extraction under a disk budget may evict them."""
        self.release(parts)
        write_trained(self.cache_dir, rank=rank, world_size=world_size, epoch=epoch, parts=parts)

    def read(self, index: int, out: dict[str, Any] | None = None,
             dequantize: bool = True) -> dict[str, Any]:
        planned, local = int(self._part[index]), int(self._local[index])
        part_idx = self._committed(planned)
        off = self._offsets.get(planned)
        if off is None:
            off = self._offsets[planned] = sample_offsets(self.plan.parts[planned].lengths)
        start = int(off[local])
        stop = min(int(off[local + 1]), start + self.max_seq_len)
        result = self.reader.read_tokens(part_idx, start, stop, out=out, dequantize=dequantize)
        stored = int(self.reader.part_arrays(part_idx).small_array(SAMPLE_IDS)[local])
        if stored != self._ids[index]:
            raise CacheCorruptError(Finding("cache.follow-sample-id", part=self.plan.parts[planned].name,
                                            cache=str(self.cache_dir), sample=local, stored=stored,
                                            planned=int(self._ids[index])))
        result["sample_id"] = stored
        if "top1_ids" in result:  # (as CacheReader.read_sample: --top1-share leaves some without one)
            result["top1_known"] = self.reader.top1_known(part_idx, local, stored)
        return result

    def _committed(self, planned: int) -> int:
        """The reader's index of a planned part, waiting until it is committed and on disk (a part
        evicted under a disk budget is waited for until it is extracted again; the maps of the
        evicted copy are dropped, so its disk space is freed)."""
        want = self.plan.parts[planned]
        self._drop_evicted()
        idx = self._in_reader.get(planned)
        if idx is not None:
            if self._evictions.state(want.name) == self._opened_as[planned]:
                return idx
            self.reader.close_part(idx)
        start, poll, noticed = time.monotonic(), POLL_SECONDS, 0.0
        while True:
            self._log.refresh()
            record = self._log.records.get(want.name)
            state = self._evictions.state(want.name)
            if record is not None and not state.evicted:
                break
            if record is not None and self.reading_epoch is not None and state.epoch >= self.reading_epoch:
                # A part evicted after epoch k is never read again before epoch k + 1 by the run whose
                # consumption reports let it go: a reader of an earlier epoch is another run, which would
                # wait for it forever (it comes back, if at all, for the epochs of the run that evicted it).
                raise CacheError(Finding("cache.follow-evicted-for-another-run", part=want.name,
                                         cache=str(self.cache_dir), epoch=state.epoch, reading=self.reading_epoch,
                                         reports=TRAINED_GLOB))
            waited = time.monotonic() - start
            if waited - noticed >= NOTICE_SECONDS:
                noticed = waited
                self.announce(self._wait_notice(want.name, waited, state if record is not None else None))
            check_stop(f"part {want.name} of {self.cache_dir}")  # a stop ends the wait: the trainer saves and exits
            time.sleep(poll)
            poll = min(poll * 2, MAX_POLL_SECONDS)
            self._drop_evicted()
        self._opened_as[planned] = state
        if idx is not None:
            return idx
        if record.lengths != want.lengths or record.sample_ids not in (None, want.sample_ids) or (
                record.split_keys != want.split_keys and want.split_keys is not None):
            raise CacheCorruptError(Finding("cache.follow-part-not-planned", part=want.name, cache=str(self.cache_dir),
                                            plan=PLAN_FILE))
        self.reader.parts.append(record)
        idx = self._in_reader[planned] = len(self.reader.parts) - 1
        return idx

    def release(self, names: list[str]) -> None:
        """Close this process's maps of the named parts (those it has trained on for its current
        epoch, which it reads no more this epoch). Called before it reports them trained: an
        extraction under a disk budget may evict them from then on, and a part still mapped keeps
        its blocks after its files are deleted, so until the next read the disk held both it and
        the part written in its place (the budget plus two parts)."""
        wanted = set(names)
        self._close_parts(lambda planned: self.plan.parts[planned].name in wanted)

    def _drop_evicted(self) -> None:
        """Read the eviction log; close the maps of every opened part evicted since. A deleted
        file's blocks stay allocated while it is mapped: kept until the part was next read, the
        evicted parts still filled the disk the extraction counted as freed (ENOSPC under a budget)."""
        self._evictions.refresh()
        if self._evictions.evictions == self._evictions_seen:
            return
        self._evictions_seen = self._evictions.evictions
        self._close_parts(lambda planned: self._evictions.state(self.plan.parts[planned].name)
                          != self._opened_as[planned])

    def _close_parts(self, which: Callable[[int], bool]) -> None:
        """Close the reader's maps of the opened planned parts that `which` picks (a read reopens them)."""
        for planned, idx in self._in_reader.items():
            if which(planned):
                self.reader.close_part(idx)

    def _wait_notice(self, name: str, waited: float, evicted: PartState | None) -> Finding:
        where = dict(part=name, cache=str(self.cache_dir), waited=round(waited))
        if evicted is None:
            done = extraction_progress(self.plan, self._log)
            return Finding("cache.follow-waiting-for-part", **where, committed=done.committed, planned=done.planned,
                           running=extraction_running(self.cache_dir) is not False)
        return Finding("cache.follow-waiting-for-evicted", **where, epoch=evicted.epoch, reextract=evicted.reextract)
