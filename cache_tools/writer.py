"""Writing a cache: one `CacheWriter` per process, one `PartWriter` per part.

Commit protocol of a part:
  1. take a liveness lock `parts/.tmp-<name>.<pid>.<rand>.lock` (flock, dies with the process)
  2. write the zarr group into `parts/.tmp-<name>.<pid>.<rand>/`, fsync every file
  3. under the cache lock: rename it to `parts/<name>`, fsync `parts/`, append the commit
     record to `manifest.parts.jsonl` and fsync it
  4. drop the liveness lock
A part exists for readers only once step 3 finished; a crash anywhere leaves a temporary
directory whose liveness lock nobody holds, which the next writer's open removes.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from dflash.runtime.findings import Finding
from dflash.runtime.fsio import (
    LOCK_SUFFIX,
    TEMP_PREFIX,
    atomic_write_json,
    file_lock,
    fsync_dir,
    fsync_tree,
    publish_dir,
    temp_name,
)
from dflash.runtime.locks import LockedError, WriterLock

from .codecs import HiddenCodec, bf16_values
from .errors import CacheError, CacheStorageError
from .eviction import BUDGET_FILE, EVICTION_FILE, TRAINED_PREFIX, EvictionLog, restore_part
from .identity import Purpose
from .manifest import (
    HEADER_FILE,
    LOCK_FILE,
    LOG_FILE,
    PARTS_DIR,
    WRITER_LOCK_FILE,
    CommitLog,
    Manifest,
    PartRecord,
    append_log_line,
    check_identity,
    identity_differences,
    read_manifest,
)
from .orphans import remove_orphans
from .part_layout import write_part_group
from .plan import PLAN_FILE
from .quarantine import QUARANTINE_DIR
from .schema import (
    HIDDEN,
    INPUT_IDS,
    LAST_HIDDEN,
    LOSS_MASK,
    TOP1_IDS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    PartSchema,
    scale_of,
)

TMP_PREFIX = TEMP_PREFIX  # what runtime.fsio.temp_name starts with

def _as_numpy(x: Any, dtype: np.dtype) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (this module imports no torch)
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x), dtype=dtype)


def _host_values(x: Any) -> np.ndarray:
    """Hidden values to encode, as float32 numpy: a float array, a float/bf16 torch tensor, or
    uint16 bf16 bits (what a reader decodes to) convert exactly."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().float().numpy()
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return bf16_values(x)
    return np.ascontiguousarray(x, dtype=np.float32)


class CacheWriter:
    """Create a cache, or reopen one whose identity matches `header`, for committing parts."""

    def __init__(self, cache_dir: str | os.PathLike, header: dict[str, Any], *, force: bool = False,
                 wait_for_force: float = 0.0, sole_writer: str = "", purpose: str = "extraction"):
        """`force` starts the cache anew; the other ranks of a forced run wait up to `wait_for_force`
        s for rank 0's new header (`_forced_for_this_run`) instead of refusing or joining the old.
        `sole_writer`: this process writes the cache alone (recompress, merge: the writer lock is
        held exclusively), the command's lock purpose ("import", "recompress", "merge": runtime.locks).
        `purpose`: what writes the cache, named when an existing one has other settings
        (manifest.IDENTITY_CHECK_PURPOSES)."""
        self.cache_dir = Path(cache_dir)
        self.purpose = purpose
        self.sole_writer = sole_writer
        self.header = header
        self.codec = HiddenCodec.from_dict(header["hidden"]["codec"])
        self.schema = PartSchema.from_header(header)
        self.num_layers = self.schema.num_layers
        self.hidden_size = self.schema.hidden_size
        self.parts_dir = self.cache_dir / PARTS_DIR
        self.removed_orphans: list[str] = []  # leftovers of dead writers removed by this open
        self._writer_lock: WriterLock | None = None
        self._open(force, wait_for_force)
        self._log = CommitLog(self.cache_dir)
        self._log.refresh()

    def _open(self, force: bool, wait_for_force: float = 0.0) -> None:
        deadline = time.monotonic() + wait_for_force
        while not self._open_once(force, waiting=time.monotonic() < deadline if wait_for_force else False):
            time.sleep(0.2)

    def _forced_for_this_run(self) -> bool:
        """Whether the cache's header is the one rank 0 of this forced run wrote."""
        try:
            manifest = read_manifest(self.cache_dir)
        except FileNotFoundError:
            return False
        run = self.header.get("provenance", {}).get("forced_run")
        if run is not None:
            return manifest.header.get("provenance", {}).get("forced_run") == run
        return not identity_differences(self.header, manifest.header, Purpose.RESUME)

    def _open_once(self, force: bool, waiting: bool) -> bool:
        """One attempt to open the cache; False: wait for rank 0 of a forced run and try again."""
        # (A waiting rank may look while rank 0 wipes: rank 0 refuses a foreign directory.)
        if not waiting and self._holds_foreign_files():
            raise CacheError(Finding("cache.dir-not-a-cache", cache=str(self.cache_dir)))
        try:
            self.parts_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheStorageError(Finding("cache.dir-not-creatable", cache=str(self.cache_dir),
                                            error=str(e.strerror or e))) from e
        if waiting and not self._forced_for_this_run():
            return False  # rank 0 has not started the cache anew yet (nothing held meanwhile)
        try:
            try:
                self._writer_lock = self._take_writer_lock(exclusive=force or bool(self.sole_writer))
            except LockedError:
                if waiting:  # rank 0 still wipes or writes the new header
                    return False
                raise
            with file_lock(self.cache_dir / LOCK_FILE):
                if waiting and not self._forced_for_this_run():
                    self.close()
                    return False
                if (self.cache_dir / HEADER_FILE).exists():
                    if force and self._other_settings():
                        self._wipe()
                    elif force:  # the same settings: kept and resumed, with this run's mark for its ranks
                        atomic_write_json(self.cache_dir / HEADER_FILE, self.header)
                    else:
                        manifest = read_manifest(self.cache_dir)
                        check_identity(manifest, self.header, purpose=self.purpose)
                if not (self.cache_dir / HEADER_FILE).exists():
                    atomic_write_json(self.cache_dir / HEADER_FILE, self.header)
                self.removed_orphans = self._remove_orphans_locked()
            if not self.sole_writer:
                self._writer_lock.share()  # after a wipe: the ranks and writers of this run join
        except OSError as e:
            self.close()
            raise CacheStorageError(Finding("cache.dir-not-writable", cache=str(self.cache_dir),
                                            error=str(e.strerror or e), file=e.filename and str(e.filename))) from e
        except BaseException:
            self.close()
            raise
        return True

    def _take_writer_lock(self, *, exclusive: bool) -> WriterLock:
        """Shared with the other writers of this cache (ranks, writer processes: each commits
        its own parts); exclusive for --force, which must not wipe a cache someone writes."""
        path = self.cache_dir / WRITER_LOCK_FILE
        if not exclusive:
            return WriterLock(path, purpose="extract", output=self.cache_dir, shared=True)
        purpose = self.sole_writer or "extract-force"
        deadline = time.monotonic() + 2.0  # a waiting rank of this run may hold it for a moment
        while True:
            try:
                return WriterLock(path, purpose=purpose, output=self.cache_dir)
            except LockedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def close(self) -> None:
        """Let go of the cache (the writer lock); also done when the process ends."""
        lock, self._writer_lock = getattr(self, "_writer_lock", None), None
        if lock is not None:
            lock.release()

    def _other_settings(self) -> bool:
        """--force: whether the cache there was written with other settings than this run's (or
        its manifest cannot be read): only then is it deleted. The same settings resume."""
        try:
            manifest = read_manifest(self.cache_dir)
        except (CacheError, OSError, ValueError):
            return True
        return bool(identity_differences(self.header, manifest.header, Purpose.RESUME))

    def _holds_foreign_files(self) -> bool:
        """Whether cache_dir holds files but no cache manifest.

        Another writer may be creating this cache right now: its lock file, parts/ and the
        manifest's temporary file are ours. The manifest is the first of its other files to
        appear, so it is looked for again after the listing: a listing that caught the new
        manifest (or the commit log after it) is of a cache, not of somebody else's data. So
        are what a --force stopped while it deleted the old cache leaves (its plan, parts/ and
        quarantine/: _wipe removes the commit log, which would name old parts, first).
        """
        if not self.cache_dir.is_dir():
            return False
        others = [p.name for p in self.cache_dir.iterdir()
                  if p.name not in (PARTS_DIR, LOCK_FILE, WRITER_LOCK_FILE, PLAN_FILE, QUARANTINE_DIR)
                  and not p.name.startswith(TMP_PREFIX)]
        return bool(others) and not (self.cache_dir / HEADER_FILE).exists()

    def _wipe(self) -> None:
        """--force: remove the old cache's manifest and parts (only cache files). The records
        that name parts go first and the parts last, so that a wipe stopped halfway leaves
        nothing a new cache would take for its own (the plan is checked against the header;
        parts no commit names are orphans)."""
        for name in (LOG_FILE, EVICTION_FILE, BUDGET_FILE):
            (self.cache_dir / name).unlink(missing_ok=True)
        for path in self.cache_dir.glob(f"{TRAINED_PREFIX}*"):
            path.unlink(missing_ok=True)
        (self.cache_dir / HEADER_FILE).unlink(missing_ok=True)
        fsync_dir(self.cache_dir)
        if self.parts_dir.is_symlink():  # parts/ on another disk: emptied, the link kept
            for child in self.parts_dir.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink()
        else:
            shutil.rmtree(self.parts_dir, ignore_errors=True)
        self.parts_dir.mkdir(exist_ok=True)
        fsync_dir(self.cache_dir)

    def _remove_orphans_locked(self) -> list[str]:
        """Remove what no live writer owns and no commit names. Caller holds the cache lock."""
        return remove_orphans(self.cache_dir)

    # -- queries ---------------------------------------------------------------------------
    def committed(self) -> dict[str, PartRecord]:
        """Parts committed so far, by any writer (re-reads only the appended log lines)."""
        self._log.refresh()
        return dict(self._log.records)

    def manifest(self) -> Manifest:
        return read_manifest(self.cache_dir)

    # -- writing ---------------------------------------------------------------------------
    def part_writer(self, name: str) -> PartWriter:
        if not name or "/" in name or name.startswith("."):
            raise CacheError(Finding("cache.part-name-invalid", part=name))
        return PartWriter(self, name)

    def commit(self, tmp_dir: Path, record: PartRecord) -> bool:
        """Move a finished, fsynced temporary part into place and record it.

        Returns False (and discards the temporary part) when another writer committed a part
        of that name first: one writer per part wins, the other's work is dropped whole. A part
        evicted under a disk budget (cache_tools/eviction.py) is committed again, once its files
        are checked to be the evicted copy's.
        """
        final = self.parts_dir / record.name
        with file_lock(self.cache_dir / LOCK_FILE):
            self._log.refresh()
            if record.name in self._log.records:
                state = EvictionLog(self.cache_dir).refresh().state(record.name)
                if state.evicted:  # evicted under a disk budget: its re-extraction comes back
                    restore_part(self.cache_dir, tmp_dir, record, self._log.records[record.name], state)
                    return True
                shutil.rmtree(tmp_dir, ignore_errors=True)
                return False
            # A `final` already there was renamed by a writer that died before recording it:
            # replaced. The part writer fsynced the part (outside this lock).
            publish_dir(tmp_dir, final, synced=True)
            append_log_line(self.cache_dir, record)
            self._log.refresh()
        return True


def _where(where: dict[str, Any]) -> dict[str, Any]:
    """The sample or the part a write is about, as both fields (one of them None)."""
    return {"sample": where.get("sample"), "part": where.get("part")}


class PartWriter:
    """Collects the samples of one part and commits them atomically on a clean exit.

    Use as a context manager; an exception inside the block discards the temporary part.
    """

    def __init__(self, cache: CacheWriter, name: str):
        self.cache = cache
        self.name = name
        self.stats: dict[str, Any] = {}
        self._cols: dict[str, list[np.ndarray]] = {}
        self._sample_ids: list[int] = []
        self._split_keys: list[int | None] = []  # None: a sample given without one
        self._grouped: list[int] = []  # positions of the samples keyed by their record's group
        self._lengths: list[int] = []
        self._tmp: Path | None = None
        self._lock_ctx = None
        self.committed = False

    def __enter__(self) -> PartWriter:
        tmp = temp_name(self.cache.parts_dir / self.name)
        # Taken under the cache lock so that an orphan sweep never sees the lock file
        # between its creation and its flock.
        with file_lock(self.cache.cache_dir / LOCK_FILE):
            self._lock_ctx = file_lock(tmp.with_name(tmp.name + LOCK_SUFFIX))
            self._lock_ctx.__enter__()
        self._tmp = tmp
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._finish()
        finally:
            if self._tmp is not None and self._tmp.exists():
                shutil.rmtree(self._tmp, ignore_errors=True)
            lock = self._tmp.with_name(self._tmp.name + ".lock")
            lock.unlink(missing_ok=True)
            self._lock_ctx.__exit__(None, None, None)

    def add_sample(
        self,
        sample_id: int,
        input_ids: Any,
        loss_mask: Any,
        hidden: Any,
        *,
        hidden_scale: np.ndarray | None = None,
        last_hidden: Any = None,
        last_hidden_scale: np.ndarray | None = None,
        topk_ids: Any = None,
        topk_logprobs: Any = None,
        top1_ids: Any = None,
        split_key: int | None = None,
        grouped: bool = False,
    ) -> None:
        """Add one sample. `hidden` is [T, K*D]: float values, a numpy array or a float/bf16
        torch tensor (encoded here by the codec, on the host), or an array already in the
        codec's storage dtype (with `hidden_scale` [T, K] where the codec keeps scales).
        `split_key`: its prompt's key (sample_scores.prompt_split_key), or with `grouped` its
        record group's (group_split_key); a part records keys when every sample has one, none
        when none has."""
        ids = _as_numpy(input_ids, np.int32)
        if ids.shape[0] == 0:
            raise CacheError(Finding("cache.write-sample-empty", sample=int(sample_id)))
        cols = {INPUT_IDS: ids, LOSS_MASK: _as_numpy(loss_mask, np.uint8)}
        for name, x, scale in ((HIDDEN, hidden, hidden_scale), (LAST_HIDDEN, last_hidden, last_hidden_scale)):
            if x is not None:
                cols[name], scale = self._encode(name, x, scale)
                if scale is not None:
                    cols[scale_of(name)] = scale
        if topk_ids is not None:
            cols[TOPK_IDS] = _as_numpy(topk_ids, np.int32)
            cols[TOPK_LOGPROBS] = _as_numpy(topk_logprobs, np.float32)
        if top1_ids is not None:  # (a cache that does not store them refuses them in _add)
            dtype = self.cache.schema[TOP1_IDS].dtype if TOP1_IDS in self.cache.schema else np.int32
            cols[TOP1_IDS] = _as_numpy(top1_ids, dtype).reshape(-1, 1)
        self._add({"sample": int(sample_id)}, cols, [int(sample_id)], [ids.shape[0]], [split_key], [0] if grouped else [])

    def add_samples(
        self,
        sample_ids: Any,
        lengths: Any,
        input_ids: Any,
        loss_mask: Any,
        hidden: np.ndarray,
        split_keys: Any = None,
        grouped: Any = (),
        **extras: np.ndarray,
    ) -> None:
        """Add many consecutive samples at once from arrays already in storage form.

        `hidden` (and each of `extras`: hidden_scale, last_hidden, ...) holds the rows of all
        samples back to back, `lengths` their token counts. No per-sample copies are made:
        this is the path that extraction's writer processes use for whole parts. `split_keys`:
        one per sample (see add_sample), or None; `grouped`: the indices (into these samples) of
        those whose key is their record group's.
        """
        lengths = [int(n) for n in lengths]
        sample_ids = [int(i) for i in sample_ids]
        if len(lengths) != len(sample_ids) or any(n <= 0 for n in lengths):
            raise CacheError(Finding("cache.write-lengths", part=self.name, samples=len(sample_ids),
                                     lengths=len(lengths)))
        cols = {INPUT_IDS: _as_numpy(input_ids, np.int32), LOSS_MASK: _as_numpy(loss_mask, np.uint8),
                HIDDEN: hidden, **extras}
        keys = [None] * len(sample_ids) if split_keys is None else [int(k) for k in split_keys]
        if len(keys) != len(sample_ids):
            raise CacheError(Finding("cache.write-split-keys-count", part=self.name, keys=len(keys),
                                     samples=len(sample_ids)))
        grouped = [int(j) for j in grouped]
        if any(not 0 <= j < len(sample_ids) for j in grouped):
            raise CacheError(Finding("cache.write-grouped-outside", part=self.name, samples=len(sample_ids)))
        self._add({"part": self.name}, cols, sample_ids, lengths, keys, grouped)

    def _add(self, where: dict[str, Any], cols: dict[str, np.ndarray], sample_ids: list[int], lengths: list[int],
             split_keys: list[int | None], grouped: list[int]) -> None:
        """Check per-token rows against the part schema, then keep them for the commit."""
        schema, tokens = self.cache.schema, sum(lengths)
        wanted = [spec for spec in schema if spec.per == "token"]
        missing = [spec.name for spec in wanted if spec.name not in cols]
        unknown = [name for name in cols if name not in schema or schema[name].per != "token"]
        if missing or unknown:
            raise CacheError(Finding("cache.write-arrays", **_where(where), stored=[spec.name for spec in wanted],
                                     missing=missing, unknown=unknown))
        for spec in wanted:
            arr = cols[spec.name]
            if arr.shape[0] != tokens:
                raise CacheError(Finding("cache.write-rows", **_where(where), array=spec.name, rows=int(arr.shape[0]),
                                         tokens=tokens))
            if tuple(arr.shape[1:]) != spec.row_shape:
                raise CacheError(Finding("cache.write-width", **_where(where), array=spec.name,
                                         shape=[int(x) for x in arr.shape[1:]], width=spec.width,
                                         layers=schema.num_layers if spec.name == HIDDEN else None,
                                         hidden_size=schema.hidden_size))
            if arr.dtype != spec.dtype:
                raise CacheError(Finding("cache.write-dtype", **_where(where), array=spec.name, dtype=str(spec.dtype),
                                         got=str(arr.dtype)))
        for key, arr in cols.items():
            self._cols.setdefault(key, []).append(arr)
        self._grouped += [len(self._sample_ids) + j for j in grouped]
        self._sample_ids += sample_ids
        self._split_keys += split_keys
        self._lengths += lengths

    def _encode(self, name: str, x: Any, scale: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows of hidden array `name` in stored form (and their scales, where the codec keeps them)."""
        codec, schema = self.cache.codec, self.cache.schema
        if isinstance(x, np.ndarray) and x.dtype == codec.storage_dtype:
            if scale is None and scale_of(name) in schema:
                raise CacheError(Finding("cache.write-scales-missing", codec=codec.name, array=scale_of(name)))
            return np.ascontiguousarray(x), (None if scale is None else _as_numpy(scale, np.float32))
        return codec.encode(_host_values(x), schema.scale_width(name))

    @property
    def num_samples(self) -> int:
        return len(self._sample_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self._lengths)

    def _finish(self) -> None:
        if not self._sample_ids:
            raise CacheError(Finding("cache.write-part-empty", part=self.name))
        given = sum(k is not None for k in self._split_keys)
        if given not in (0, len(self._split_keys)):
            raise CacheError(Finding("cache.write-split-keys-some", part=self.name, given=given,
                                     samples=len(self._split_keys)))
        write_part_group(self._tmp, self.cache, self._cols, self._sample_ids, self._lengths, self.name)
        fsync_tree(self._tmp)
        nbytes = sum(f.stat().st_size for f in self._tmp.rglob("*") if f.is_file())
        record = PartRecord(
            name=self.name, samples=len(self._sample_ids), tokens=self.num_tokens,
            lengths=tuple(self._lengths), nbytes=nbytes, stats=dict(self.stats),
            sample_ids=tuple(int(i) for i in self._sample_ids),
            split_keys=tuple(self._split_keys) if given else None,
            grouped=tuple(self._grouped) if given and self._grouped else None,
        )
        self.committed = self.cache.commit(self._tmp, record)
