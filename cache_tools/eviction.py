"""Parts evicted under a disk budget, re-extracted bit for bit, and what the trainers have consumed.

`dflash-extract --disk-budget SIZE` keeps the cache's bytes within a budget while a trainer
follows it (`dflash-train --follow`): a part every training rank has trained on for the epoch it
was extracted for may be deleted (evicted) to make room, and, with `--follow-epochs N`, is
extracted again for the next epoch that reads it. Two kinds of small files carry this:

  manifest.evicted.jsonl        the eviction log: one checksummed line per event, appended under
                                the cache lock (as the commit log is), never rewritten:
                                  evicted   the part's files are deleted (the line is written
                                            first, then the files go); it records the epoch the
                                            part was trained in, its bytes and the sha256 of its
                                            files, which a re-extraction must reproduce
                                  restored  re-extracted and committed again (for epoch + 1)
                                  kept      a part still on disk kept for a later epoch
  manifest.budget.json          the --disk-budget the extraction runs under (written before its plan,
                                removed by one without a budget): a following trainer applies the
                                budget's checks even when it is not given --disk-budget itself; and
                                the estimated bytes of the parts its largest forward batch spans
  manifest.trained-rankNNNNN.json  one per training rank, written atomically after each of its
                                checkpoints: the epoch of that checkpoint's data position and the
                                parts this epoch's consumed batches cover. A resume from the last
                                checkpoint therefore never needs an evicted part.

The commit log keeps one record per part; a part's state is its commit record plus the last
event of the eviction log: present (serving an epoch: 0 when first committed) or evicted.
Readers of a cache without the eviction log see every committed part as present, as before.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.runtime.findings import Finding
from dflash.runtime.fsio import TEMP_PREFIX, atomic_write_bytes, file_lock, fsync_dir, publish_dir

from .checksum import crc32c
from .errors import CacheCorruptError, CacheError
from .manifest import LOCK_FILE, PARTS_DIR, PartRecord

EVICTION_FILE = "manifest.evicted.jsonl"
BUDGET_FILE = "manifest.budget.json"
TRAINED_PREFIX = "manifest.trained-rank"
EVICTED, RESTORED, KEPT = "evicted", "restored", "kept"


class ReextractionMismatchError(CacheCorruptError):
    """A re-extracted part's bytes differ from those of the copy that was evicted."""


@dataclass(frozen=True)
class PartState:
    """A committed part's state by the eviction log."""

    evicted: bool
    epoch: int  # present: the epoch the copy on disk serves; evicted: the epoch it was trained in
    nbytes: int = 0
    sha256: str = ""
    reextract: bool = True  # evicted: whether the extraction that evicted it extracts it again


PRESENT = PartState(evicted=False, epoch=0)


class EvictionLog:
    """Incremental reader of manifest.evicted.jsonl (reads only what was appended since)."""

    def __init__(self, cache_dir: str | os.PathLike):
        self.path = Path(cache_dir) / EVICTION_FILE
        self.states: dict[str, PartState] = {}
        self.evictions = 0  # evicted events read so far
        self._offset = 0
        self._line_no = 0

    def refresh(self) -> EvictionLog:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self
        end = data.rfind(b"\n") + 1  # a torn last line (a writer killed mid-append) never happened
        for line in data[:end].splitlines():
            self._line_no += 1
            self._apply(decode_event(line, f"{self.path}, line {self._line_no}"))
        self._offset += end
        return self

    def _apply(self, e: dict[str, Any]) -> None:
        name, event = e["part"], e["event"]
        if event == EVICTED:
            self.evictions += 1
            self.states[name] = PartState(True, int(e["epoch"]), int(e["bytes"]), str(e["sha256"]),
                                          bool(e.get("reextract", True)))
        elif event == RESTORED:
            self.states[name] = PartState(False, int(e["epoch"]))
        elif event == KEPT:
            self.states[name] = PartState(False, int(e["epoch"]))

    def state(self, name: str) -> PartState:
        return self.states.get(name, PRESENT)

    def is_evicted(self, name: str) -> bool:
        return self.state(name).evicted

    def evicted(self) -> dict[str, PartState]:
        return {n: s for n, s in self.states.items() if s.evicted}


def refuse_evicted(cache_dir: str | os.PathLike, command: str) -> None:
    """`command` (recompress, merge, stats, upload, train: an offline training run) reads every
    part: refused, naming the parts, where some are evicted under a disk budget (their files are
    gone, which is no damage)."""
    gone = sorted(EvictionLog(cache_dir).refresh().evicted())
    if gone:
        raise CacheError(Finding("cache.parts-evicted", cache=str(cache_dir), parts=len(gone), first=gone[0],
                                 file=EVICTION_FILE, command=command))


def encode_event(event: dict[str, Any]) -> bytes:
    body = json.dumps(event, sort_keys=True, separators=(",", ":"))
    return f"{body} {crc32c(body.encode()):08x}\n".encode()


def decode_event(line: bytes, where: str) -> dict[str, Any]:
    try:
        body, crc = line.rsplit(b" ", 1)
        if int(crc, 16) == crc32c(body):
            return json.loads(body)
    except ValueError:
        pass
    raise CacheCorruptError(Finding("cache.eviction-record-damaged", where=where))


def append_event(cache_dir: Path, event: dict[str, Any]) -> None:
    """Append one event durably. Caller holds the cache lock (so a torn tail is only at the end)."""
    path = cache_dir / EVICTION_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = keep = os.fstat(fd).st_size
        if size:  # drop a torn tail left by a process killed mid-append
            tail = os.pread(fd, min(size, 1 << 16), max(0, size - (1 << 16)))
            keep = size - len(tail) + tail.rfind(b"\n") + 1
            if keep != size:
                os.ftruncate(fd, keep)
        line = encode_event(event)
        if os.write(fd, line) != len(line):  # a full disk: leave no torn line behind either
            os.ftruncate(fd, keep)
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a short write of an eviction record)", str(path))
        os.fsync(fd)
    finally:
        os.close(fd)


def files_digest(part_dir: Path) -> str:
    """sha256 over a part's files (relative path, size and bytes, in path order)."""
    h = hashlib.sha256()
    for f in sorted(p for p in part_dir.rglob("*") if p.is_file()):
        rel = f.relative_to(part_dir).as_posix().encode()
        h.update(len(rel).to_bytes(8, "little") + rel + f.stat().st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def evict_part(cache_dir: str | os.PathLike, record: PartRecord, trained_epoch: int, *,
               reextract: bool = True) -> int:
    """Delete a committed part's files after recording why (under the cache lock). Returns the
    bytes freed (0 when it was evicted already, by another extraction rank). `reextract`: whether
    this extraction will extract it again for the next epoch (what a waiting trainer is told)."""
    cache_dir = Path(cache_dir)
    part_dir = cache_dir / PARTS_DIR / record.name
    with file_lock(cache_dir / LOCK_FILE):
        if EvictionLog(cache_dir).refresh().is_evicted(record.name):
            remove_evicted_dir(part_dir)  # a crash between the line and the delete left it
            return 0
        nbytes = sum(f.stat().st_size for f in part_dir.rglob("*") if f.is_file())
        append_event(cache_dir, {"part": record.name, "event": EVICTED, "epoch": int(trained_epoch),
                                 "bytes": nbytes, "sha256": files_digest(part_dir), "reextract": reextract})
        remove_evicted_dir(part_dir)
    return nbytes


def remove_evicted_dir(part_dir: Path) -> None:
    if part_dir.exists():
        shutil.rmtree(part_dir, ignore_errors=True)
        fsync_dir(part_dir.parent)


def restore_part(cache_dir: Path, tmp_dir: Path, record: PartRecord, committed: PartRecord,
                 state: PartState) -> None:
    """Commit a re-extraction of an evicted part (caller holds the cache lock): its files must
    be the evicted copy's, byte for byte, else nothing is published."""
    digest = files_digest(tmp_dir)
    if record.lengths != committed.lengths or digest != state.sha256:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise ReextractionMismatchError(Finding(
            "cache.reextraction-differs", part=record.name, cache=str(cache_dir), epoch=state.epoch, sha256=digest,
            nbytes=record.nbytes, evicted_sha256=state.sha256, evicted_nbytes=state.nbytes))
    publish_dir(tmp_dir, cache_dir / PARTS_DIR / record.name, synced=True)
    append_event(cache_dir, {"part": record.name, "event": RESTORED, "epoch": state.epoch + 1})


def keep_part(cache_dir: str | os.PathLike, name: str, epoch: int) -> bool:
    """Keep a part on disk for `epoch` (it is not evicted before a trainer has read it then).
    Returns False when it is evicted (it must be extracted again)."""
    cache_dir = Path(cache_dir)
    with file_lock(cache_dir / LOCK_FILE):
        state = EvictionLog(cache_dir).refresh().state(name)
        if state.evicted:
            return False
        if state.epoch < epoch:
            append_event(cache_dir, {"part": name, "event": KEPT, "epoch": int(epoch)})
    return True


def record_budget(cache_dir: str | os.PathLike, limit: int | None, batch_bytes: int | None = None) -> None:
    """Record the extraction's --disk-budget in the cache (None: it has none; an earlier record goes),
    with `batch_bytes`, the estimated bytes of the parts its largest forward batch spans (what it holds
    open at once beside a trainer's group: recorded_batch_bytes)."""
    path = Path(cache_dir) / BUDGET_FILE
    body = {"disk_budget": int(limit or 0), **({} if batch_bytes is None else {"batch_bytes": int(batch_bytes)})}
    # Under the cache lock: a writer opening the cache removes temporary files there (orphans).
    with file_lock(Path(cache_dir) / LOCK_FILE):
        if limit is None:
            path.unlink(missing_ok=True)
        else:
            atomic_write_bytes(path, json.dumps(body).encode())


def recorded_budget(cache_dir: str | os.PathLike) -> int | None:
    """The --disk-budget in bytes an extraction of the cache runs under, or None."""
    return _budget_field(cache_dir, "disk_budget")


def recorded_batch_bytes(cache_dir: str | os.PathLike) -> int | None:
    """The estimated bytes of the parts one forward batch of the budgeted extraction spans at most
    (None: no budget, or recorded before this was): a trainer's group of parts needs room beside them."""
    return _budget_field(cache_dir, "batch_bytes", optional=True)


def _budget_field(cache_dir: str | os.PathLike, key: str, optional: bool = False) -> int | None:
    try:
        body = json.loads((Path(cache_dir) / BUDGET_FILE).read_bytes())
        return None if optional and key not in body else int(body[key])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CacheCorruptError(Finding("cache.budget-file-damaged", file=str(Path(cache_dir) / BUDGET_FILE),
                                        error=str(e))) from None


# -- what the trainers consumed ----------------------------------------------------------------


@dataclass(frozen=True)
class TrainedReport:
    """One training rank's position at its last checkpoint."""

    rank: int
    world_size: int
    epoch: int
    parts: frozenset[str]  # trained on in `epoch` (every planned part when the epoch is done)

    def trained_in(self, name: str, epoch: int) -> bool:
        """Whether this rank has read every training sample of `name` for `epoch`."""
        return self.epoch > epoch or (self.epoch == epoch and name in self.parts)


def trained_path(cache_dir: str | os.PathLike, rank: int) -> Path:
    return Path(cache_dir) / f"{TRAINED_PREFIX}{rank:05d}.json"


def write_trained(cache_dir: str | os.PathLike, *, rank: int, world_size: int, epoch: int,
                  parts: Iterable[str]) -> None:
    """Record a rank's consumption (atomically; the trainer calls it after each checkpoint). The
    temporary files of this rank's earlier records that a killed trainer left go first: a rank
    writes its record from one process, one at a time, and no cache writer removes them
    (orphans.find_orphans), since they are written without the cache lock."""
    path = trained_path(cache_dir, rank)
    for leftover in path.parent.glob(f"{TEMP_PREFIX}{path.name}.*"):
        leftover.unlink(missing_ok=True)
    body = {"rank": rank, "world_size": world_size, "epoch": epoch, "parts": sorted(parts)}
    atomic_write_bytes(path, json.dumps(body, separators=(",", ":")).encode())


def read_trained(cache_dir: str | os.PathLike) -> list[TrainedReport] | None:
    """Every training rank's report, or None until all ranks of the run have written one."""
    reports = []
    for path in sorted(Path(cache_dir).glob(f"{TRAINED_PREFIX}*.json")):
        try:
            body = json.loads(path.read_bytes())
            reports.append(TrainedReport(int(body["rank"]), int(body["world_size"]), int(body["epoch"]),
                                         frozenset(body["parts"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # replaced meanwhile or foreign: the next look reads it
    if not reports:
        return None
    world = max(r.world_size for r in reports)
    mine = {r.rank: r for r in reports if r.world_size == world}
    return [mine[r] for r in range(world)] if len(mine) == world else None


def trained_by_all(reports: list[TrainedReport] | None, name: str, epoch: int) -> bool:
    return bool(reports) and all(r.trained_in(name, epoch) for r in reports)
