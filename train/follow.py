"""Training on a cache that dflash-extract is still filling (`dflash-train --follow`).

The batches of a run are planned before any sample is read (plans.py), from the sample ids
and lengths. On a cache still being extracted those come from the extraction plan
(cache_tools/plan.py), which the extractor writes at its start: `FollowCacheSet` is the list
of samples that plan promises, in sample id order, and reading one waits until the part that
holds it is committed. Offline runs put their samples in the same order (`canonical_order`),
so a follow run and an offline run on the finished cache with the same settings read the same
batches in the same order and end with the same weights, whenever the parts arrived.

With `--shuffle-parts N` an epoch is planned group by group: consecutive groups of N planned
parts (by part number, the extraction's order), each shuffled, length-sorted and packed on its
own (`plan_epoch`). Training then follows the extraction closely and needs at most a group's
parts at once, which is what training while extracting, and a disk budget, need; the default
(0) shuffles the whole data, so the first step waits for most of the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from dflash.cache_tools.errors import CacheCorruptError, CacheError, CacheNotFoundError
from dflash.cache_tools.eviction import TRAINED_PREFIX, EvictionLog, PartState, write_trained
from dflash.cache_tools.manifest import (
    HEADER_FILE,
    PARTS_DIR,
    WRITER_LOCK_FILE,
    CommitLog,
    Manifest,
    header_identity,
    read_header,
)
from dflash.cache_tools.plan import PLAN_FILE, ExtractionPlan, extraction_progress, read_plan
from dflash.cache_tools.quarantine import QUARANTINE_DIR
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.schema import SAMPLE_IDS, sample_offsets
from dflash.runtime.locks import is_held
from dflash.runtime.signals import check_stop

if TYPE_CHECKING:
    from dflash.cache_tools.cache_set import CacheSet

START_SECONDS = 600.0  # a path where no extraction has begun is waited on this long (an extractor loading its target)
POLL_SECONDS = 0.05  # first wait between looks at the commit log; doubles up to MAX_POLL_SECONDS
MAX_POLL_SECONDS = 0.5
TRAINED_GLOB = f"{TRAINED_PREFIX}*.json"
NOTICE_SECONDS = 30.0  # a waiting trainer says what it waits for this often


def part_number(name: str, fallback: int) -> int:
    """12 for 'part-000012' (the extraction's order); `fallback` for another name (a merged cache)."""
    head, _, digits = name.rpartition("-")
    return int(digits) if head == "part" and digits.isdigit() else fallback


def canonical_order(caches: Any, indices: np.ndarray) -> np.ndarray:
    """`indices` sorted by (cache, sample id): the order batch plans start from, so that they do
    not depend on the order parts were committed in (several ranks, writer processes) or arrive."""
    if len(indices) == 0:
        return indices
    ids = caches.sample_ids()[indices]
    cache_of = np.searchsorted(caches.starts, indices, side="right") - 1
    return indices[np.lexsort((indices, ids, cache_of))]


def part_groups(caches: Any, shuffle_parts: int) -> np.ndarray:
    """The plan group of every sample: its part's number // shuffle_parts, per cache."""
    if shuffle_parts < 0:
        from .config import TrainConfigError

        raise TrainConfigError(f"--shuffle-parts must be 0 (shuffle the whole data) or more (got {shuffle_parts}).")
    numbers = caches.part_numbers() if isinstance(caches, FollowCacheSet) else cache_set_part_numbers(caches)
    cache_of = np.searchsorted(caches.starts, np.arange(len(caches)), side="right") - 1
    groups = numbers // shuffle_parts
    return cache_of * (int(groups.max(initial=0)) + 1) + groups


def cache_set_part_numbers(caches: CacheSet) -> np.ndarray:
    """The part number of every sample of an offline CacheSet (from its commit records)."""
    out = [np.full(p.samples, part_number(p.name, i), dtype=np.int64)
           for r in caches.readers for i, p in enumerate(r.parts)]
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def wait_for_plan(cache_dir: Path, announce: Callable[[str], None], *,
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
            announce(f"--follow: waiting for the extraction plan of {cache_dir} ({PLAN_FILE}) since {since} "
                     f"({waited:.0f} s): {state}")
        check_stop(f"the extraction plan of {cache_dir}")
        time.sleep(MAX_POLL_SECONDS)


def _plan_wait_state(cache_dir: Path, header: dict[str, Any] | None, waited: float, start_seconds: float) -> str:
    """What a wait for the plan of `cache_dir` waits on and what ends it; refuses (CacheError, exit 2)
    where the plan cannot come."""
    follow = f"dflash-train --follow --cache {cache_dir}"
    if cache_dir.exists() and not cache_dir.is_dir():
        raise CacheError(f"{follow}: {cache_dir} is a file, not a cache directory. Pass the directory that "
                         "dflash-extract --output names.")
    if header is None:
        present = sorted(p.name for p in cache_dir.iterdir()) if cache_dir.is_dir() else []
        foreign = [n for n in present if not n.startswith(".") and n not in (PARTS_DIR, PLAN_FILE, QUARANTINE_DIR)]
        if foreign:
            raise CacheError(f"{follow}: {cache_dir} holds files ({', '.join(foreign[:3])}) but no cache "
                             f"({HEADER_FILE}), and dflash-extract does not write a cache into such a directory. "
                             "Check the path: pass the directory that dflash-extract --output names.")
        if waited >= start_seconds:
            raise CacheError(f"{follow}: no extraction has begun at {cache_dir} in {waited:.0f} s "
                             f"({'no such directory' if not present else f'no {HEADER_FILE}'}). Check the path, "
                             "or start dflash-extract --output on it first, then this run.")
        return (f"no cache there yet ({'no such directory' if not present else f'no {HEADER_FILE}'}): "
                f"dflash-extract creates it once its target is loaded. Refused if no extraction has begun "
                f"there within {start_seconds:.0f} s (a mistyped path?)")
    running = extraction_running(cache_dir)
    log = CommitLog(cache_dir)
    log.refresh()
    if log.records and running is False:
        raise CacheError(f"{follow}: the cache holds {len(log.records)} committed part(s) but no extraction plan "
                         f"({PLAN_FILE}) and no extraction is writing it, so no plan will come: it was written by "
                         "an earlier version, or its extraction stopped at a bad record (no plan is written for "
                         "such input). Train on it without --follow.")
    if running is False:
        return ("no extraction is writing the cache now (it stopped before writing its plan): rerun the "
                "dflash-extract command that started it; it writes the plan first")
    return "dflash-extract is starting the cache and writes the plan before any part"


def extraction_running(cache_dir: Path) -> bool | None:
    """Whether a process on this host writes `cache_dir` (holds its writer lock); None where that
    cannot be told (runtime.locks.is_held)."""
    lock = cache_dir / WRITER_LOCK_FILE
    return is_held(lock) if lock.exists() else False


class FollowCacheSet:
    """The samples an extraction plan promises, in sample id order; reading one waits until its
    part is committed. Has what the loader uses of a CacheSet (one cache)."""

    def __init__(self, cache_dir: str, *, max_seq_len: int, verify_checksums: bool = True,
                 announce: Callable[[str], None] = print):
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

    def progress(self):
        return extraction_progress(self.plan, self._log)

    def read(self, index: int, out: dict[str, torch.Tensor] | None = None,
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
            raise CacheCorruptError(
                f"cache part {self.plan.parts[planned].name!r} at {self.cache_dir}: sample {local} has id {stored}, "
                f"the extraction plan says {int(self._ids[index])}. The part does not match the plan: run "
                "`dflash-cache verify` and re-extract it.")
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
                raise CacheError(self._evicted_for_another_run(want.name, state))
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
            raise CacheCorruptError(
                f"cache part {want.name!r} at {self.cache_dir}: its commit record lists other samples than the "
                "extraction plan (manifest.plan.json). The cache was written with another plan: start it anew "
                "with dflash-extract --force, or train on it without --follow.")
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

    def _evicted_for_another_run(self, name: str, evicted: PartState) -> str:
        """A part evicted after epoch k is never read again before epoch k + 1 by the run whose
        consumption reports let it go (a resume starts at its last report or later): a reader of an
        earlier epoch is another run, which would wait for it forever (it comes back, if at all, for
        the epochs of the run that evicted it)."""
        return (f"cache part {name!r} of {self.cache_dir} was evicted under the disk budget after epoch {evicted.epoch}, "
                f"once every consumption report ({TRAINED_GLOB}) said it had been trained on then, but this run reads it "
                f"for epoch {self.reading_epoch}: those reports are another training run's (a second run following the "
                "cache, or an earlier one; or this run's later checkpoints were deleted). The extraction evicts by the "
                "reports in the cache, one file per rank whichever run wrote it last, so only one training run can follow "
                "a cache extracted under --disk-budget. Resume the run that trained on it (its --output-dir), or give "
                "this run a cache of its own (dflash-extract --output NEW with the same settings).")

    def _wait_notice(self, name: str, waited: float, evicted: PartState | None) -> str:
        done = extraction_progress(self.plan, self._log)
        where = f"--follow: waiting {waited:.0f} s for part {name} of {self.cache_dir}"
        if evicted is None:
            ends = ("dflash-extract commits it" if extraction_running(self.cache_dir) is not False else
                    "no extraction on this host writes the cache now: rerun dflash-extract to resume it")
            return f"{where} ({done.committed} of {done.planned} planned parts committed so far; {ends})"
        again = ("dflash-extract extracts it again for this epoch" if evicted.reextract else
                 "the extraction that evicted it does not extract it again: rerun dflash-extract on the cache "
                 "with --disk-budget and --follow-epochs of at least this run's --epochs")
        return f"{where}: it was evicted under the disk budget after epoch {evicted.epoch}; {again}"


def open_follow(config: Any, announce: Callable[[str], None] = print) -> FollowCacheSet:
    """The --follow cache of a run (exactly one --cache)."""
    from .config import TrainConfigError  # (no torch; the config module is what every run has)

    if len(config.cache) != 1:
        raise TrainConfigError(f"--follow follows one cache, but {len(config.cache)} were given with --cache: "
                               "follow one, or train on finished caches without --follow.")
    if "://" in str(config.cache[0]):
        raise TrainConfigError(f"--follow reads a local cache while dflash-extract writes it; {config.cache[0]} is "
                               "a remote URL, which no extraction writes: train on it without --follow once it is "
                               "uploaded, or follow the local cache the extraction writes.")
    caches = FollowCacheSet(config.cache[0], max_seq_len=config.max_seq_len,
                            verify_checksums=config.verify_checksums, announce=announce)
    check_extraction_budget(config, caches.cache_dir)
    return caches


def check_extraction_budget(config: Any, cache_dir: Path) -> None:
    """A run not given --disk-budget follows a cache whose extraction has one: the budget's
    refusals (--shuffle-parts 0, a held-out split of the followed cache) hold for it too, as if it
    had been given the same --disk-budget. Without them the first evaluation, or the first batches,
    wait for parts the extraction has no room for while it waits for the trainer: neither moves."""
    import dataclasses

    from dflash.cache_tools.eviction import BUDGET_FILE, recorded_budget

    from .config import TrainConfigError

    budget = recorded_budget(cache_dir)
    if config.disk_budget is not None or budget is None:
        return
    try:
        dataclasses.replace(config, disk_budget=str(budget))
    except TrainConfigError as e:
        raise TrainConfigError(
            f"The extraction of {cache_dir} runs under --disk-budget {budget} ({BUDGET_FILE}), and this run follows "
            f"it without one: what that budget needs holds here too. {e}") from None


def refuse_group_over_budget(caches: FollowCacheSet, shuffle_parts: int, budget: int) -> None:
    """Refuse (TrainConfigError) a --disk-budget that cannot hold one --shuffle-parts group of
    planned parts beside the parts one forward batch of the extraction spans (recorded in the
    cache's budget file; 0 where it is not): the run reads a group's parts in shuffled order and
    reports a part trained only once the group's batches are past it, so the extraction would
    wait for room while the trainer waits for the group's other parts, both for ever. A group's
    bytes are its tokens times the bytes per token of the parts committed so far or, before any,
    of the arrays' raw size (above the compressed size)."""
    from dflash.cache_tools.eviction import recorded_batch_bytes
    from dflash.cache_tools.staging import format_size

    from .config import TrainConfigError

    caches._log.refresh()
    committed = list(caches._log.records.values())
    tokens = sum(r.tokens for r in committed)
    if tokens:
        per_token, how = sum(r.nbytes for r in committed) / tokens, f"measured on {len(committed)} committed part(s)"
    else:
        per_token = float(sum((spec.width or 1) * spec.dtype.itemsize for spec in caches.reader.schema
                              if spec.per == "token"))
        how = "the arrays' raw size: no part is committed yet"
    group_tokens: dict[int, int] = {}
    group_parts: dict[int, int] = {}
    for k, part in enumerate(caches.plan.parts):
        g = part_number(part.name, k) // shuffle_parts
        group_tokens[g] = group_tokens.get(g, 0) + part.tokens
        group_parts[g] = group_parts.get(g, 0) + 1
    if not group_tokens:
        return
    largest = max(group_tokens, key=group_tokens.__getitem__)
    batch = recorded_batch_bytes(caches.cache_dir) or 0
    need = group_tokens[largest] * per_token + batch
    if need <= budget:
        return
    part_bytes = group_tokens[largest] * per_token / group_parts[largest]
    fits = int((budget - batch) // part_bytes) - 1  # a group plus the bound's one part
    fix = f"raise --disk-budget to at least {format_size(need)} here and in dflash-extract"
    fix = f"Lower --shuffle-parts to {fits}, or {fix}" if fits >= 1 else fix[0].upper() + fix[1:]
    beside = f" and the {format_size(batch)} of parts one extraction batch spans" if batch else ""
    raise TrainConfigError(
        f"--disk-budget {format_size(budget)} cannot hold a group of --shuffle-parts {shuffle_parts} planned parts "
        f"(about {format_size(need - batch)}: {group_parts[largest]} parts, {group_tokens[largest]:,} tokens at "
        f"{per_token:,.0f} B/token, {how}){beside}: the run reads a group's parts in shuffled order and reports a "
        "part trained only once the group is past it, so the extraction would wait for room while the trainer "
        f"waits for the group's other parts, for ever. {fix} (docs/train.md, \"A disk budget\").")


def trained_parts(caches: Any, loader: Any) -> int:
    """Planned parts whose training samples all come in the batches this run has consumed in
    its current epoch (what progress shows, and what a disk budget may evict)."""
    return len(trained_part_names(caches, loader)[1])


def trained_part_names(caches: FollowCacheSet, loader: Any) -> tuple[int, list[str]]:
    """The epoch of the loader's position and the planned parts that none of its remaining
    batches reads (parts without training samples among them); an epoch whose usable batches are
    all consumed is done: (epoch + 1, []). (`loader` is the run's `loader.TrainLoader`.)"""
    epoch, consumed = loader.epoch, loader.consumed
    if consumed >= loader.usable(epoch):
        return epoch + 1, []
    batches = loader.epoch_batches(epoch)[:consumed]
    done = np.zeros(len(caches), dtype=bool)
    if batches:
        done[np.concatenate(batches)] = True
    needed = np.zeros(len(caches), dtype=bool)
    needed[loader.indices] = True
    open_parts = set(np.unique(caches._part[needed & ~done]).tolist())
    return epoch, [p.name for k, p in enumerate(caches.plan.parts) if k not in open_parts]


def report_consumption(data: Any, rank: int, world_size: int) -> None:
    """--follow: record in the cache what this rank has trained on as of its checkpoint just
    written (cache_tools/eviction.py), so that an extraction under a disk budget may evict it."""
    caches = data.caches
    if isinstance(caches, FollowCacheSet):
        epoch, parts = trained_part_names(caches, data.loader)
        caches.release(parts)
        write_trained(caches.cache_dir, rank=rank, world_size=world_size, epoch=epoch, parts=parts)


def follow_fields(data: Any) -> dict[str, float]:
    """Progress of both stages for the trainer's log: parts extracted and trained, data wait (s)."""
    caches = data.caches
    if not isinstance(caches, FollowCacheSet):
        return {}
    done = caches.progress()
    return {"parts_extracted": done.committed, "parts_planned": done.planned,
            "parts_trained": trained_parts(caches, data.loader), "data_wait_s": round(data.loader.wait_seconds, 2)}
