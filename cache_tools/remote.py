"""Training from a cache on object storage (`s3://bucket/prefix`) through a local staging
directory. What a remote cache holds, and the store it is read from, are remote_store.py's.

A trainer opens a remote cache through `StagedCache`: the manifest, the index and each part's
small arrays (token ids, masks, sample index) are fetched at open into a staging directory that
is laid out as a local cache; the hidden-state files of a part are fetched when the reader
first touches the part (`ensure`), or ahead of it by `prefetch`. Every downloaded file is
checked against the index's size and crc32c before it is renamed into place, and a part is
marked staged only once all its files are; a failed or corrupt download is retried, then named.
Under a disk budget (`staging.StagingBudget`) the least recently used staged parts are evicted
to make room; the small arrays count against it but stay (where they alone exceed it, the
directory holds them plus one part). Everything is kept on disk (markers, per-part locks), so DataLoader workers and a
process restarted after a kill share one staging directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import google_crc32c
from dflash.runtime.errors import Interrupted
from dflash.runtime.findings import Finding
from dflash.runtime.signals import check_stop

from .errors import CacheCorruptError, CacheError, CacheNotFoundError
from .manifest import HEADER_FILE, LOG_FILE, PARTS_DIR, header_identity, read_header, read_manifest
from .remote_store import (
    FILES_INDEX,
    FilesIndex,
    RemoteCacheError,
    RemoteFile,
    RemoteStore,
    endpoint_name,
    file_crc32c,
    is_remote,
    local_disk_finding,
    obstore_usable,
    run_parallel,
    staged_manifest,
    stop_requested,
)
from .schema import DATA, INDEX, PartSchema
from .staging import StagingBudget, parse_size

STAGED_DIR = ".staged"  # one marker per fully staged part
LOCKS_DIR = ".locks"
PARTIAL = ".partial"  # a file being downloaded; renamed into place once checked
DEFAULT_RETRIES = 3


def default_staging_dir(url: str) -> Path:
    """Where a remote cache is staged unless a run says otherwise: one directory per URL under
    the user's cache directory, so a restarted run finds the parts it already fetched."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return base / "dflash" / "staging" / name


# -- staging -----------------------------------------------------------------------------------

class StagedCache:
    """A remote cache seen as a local cache directory (`path`), whose parts arrive on demand."""

    def __init__(self, url: str, staging_dir: str | os.PathLike | None = None, *,
                 disk_budget: int | str | None = None, retries: int = DEFAULT_RETRIES, threads: int = 8):
        self.url = url.rstrip("/")
        self.path = Path(staging_dir) if staging_dir is not None else default_staging_dir(self.url)
        self.budget = StagingBudget(self.path / PARTS_DIR, None if disk_budget is None else parse_size(disk_budget))
        self.retries = max(1, retries)
        self.threads = threads
        self._store: RemoteStore | None = None
        self._store_pid = 0
        self._index: FilesIndex | None = None
        self._small: set[str] | None = None
        self._prefetcher: threading.Thread | None = None
        self._stop = threading.Event()

    # Workers (fork or pickle) reopen the store: obstore clients do not cross a fork.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_store=None, _prefetcher=None, _stop=threading.Event())
        return state

    @property
    def store(self) -> RemoteStore:
        # A forked DataLoader worker makes its own client: the parent's (its runtime's threads)
        # does not survive a fork.
        if self._store is None or self._store_pid != os.getpid():
            self._store, self._store_pid = RemoteStore(self.url), os.getpid()
        return self._store

    @property
    def index(self) -> FilesIndex:
        if self._index is None:
            self._index = FilesIndex.from_bytes((self.path / FILES_INDEX).read_bytes(), str(self.path / FILES_INDEX))
        return self._index

    def open(self) -> StagedCache:
        """Fetch the manifest, the file index and every part's small arrays. A staging
        directory of another cache (or another version of this one) is cleared first."""
        self.path.mkdir(parents=True, exist_ok=True)
        with staged_manifest(self.store) as (m, index):
            header = m.header
            fresh = {n: self.store.get(n) for n in (HEADER_FILE, FILES_INDEX)}
            log = (m.cache_dir / LOG_FILE).read_bytes() if (m.cache_dir / LOG_FILE).exists() else b""
        old = self.path / HEADER_FILE
        if old.exists() and (old.read_bytes() != fresh[HEADER_FILE] or
                             not (self.path / FILES_INDEX).exists() or
                             (self.path / FILES_INDEX).read_bytes() != fresh[FILES_INDEX]):
            for name in (PARTS_DIR, STAGED_DIR):
                shutil.rmtree(self.path / name, ignore_errors=True)
        for d in (PARTS_DIR, STAGED_DIR, LOCKS_DIR):
            (self.path / d).mkdir(exist_ok=True)
        _remove_stale_partials(self.path)
        _write_atomic(self.path / FILES_INDEX, fresh[FILES_INDEX])
        _write_atomic(self.path / LOG_FILE, log)
        _write_atomic(self.path / HEADER_FILE, fresh[HEADER_FILE])
        self._index = index
        missing = [p.name for p in m.parts if p.name not in index.parts]
        if missing:
            raise CacheCorruptError(Finding("cache.parts-not-indexed", url=self.url, parts=missing[:5],
                                            index=FILES_INDEX))
        small = _small_arrays(header)
        jobs = [(p.name, f) for p in m.parts for f in index.parts[p.name] if _in_skeleton(f.path, small)]
        run_parallel(lambda job, _: self._fetch_checked(*job), jobs, self.threads)
        return self

    def identity(self) -> dict[str, Any]:
        return header_identity(read_manifest(self.path).header)

    @property
    def small_arrays(self) -> set[str]:
        if self._small is None:
            self._small = _small_arrays(read_header(self.path))
        return self._small

    def is_staged(self, name: str) -> bool:
        return (self.path / STAGED_DIR / name).exists()

    def part_bytes(self, name: str) -> int:
        return sum(f.size for f in self.index.parts[name])

    def ensure(self, name: str, array: str | None = None) -> None:
        """Make sure the part's data files are on local disk (a small array's are, since open);
        fetch them otherwise, evicting least recently used parts to make room. The reader calls
        this before it maps a data file of a part."""
        if array is not None and array in self.small_arrays:
            return
        marker = self.path / STAGED_DIR / name
        if marker.exists():
            _touch(marker)
            return
        with self._part_lock(name):
            if marker.exists():
                return
            need = self.part_bytes(name)
            while not self.budget.has_room(need):
                if self.evict_lru(need, keep={name}):
                    continue
                if not any(p.name != name for p in (self.path / STAGED_DIR).iterdir()):
                    break  # nothing left to evict: this part goes in alone (the budget plus one part)
                _sleep_unless_stopped(0.2)  # the staged parts are being fetched by other processes: wait for one
            self._fetch_part(name)

    def _fetch_part(self, name: str) -> None:
        if not obstore_usable():  # a forked DataLoader worker: the caller holds the part's lock
            self._fetch_part_in_new_process(name)
            return
        files = [f for f in self.index.parts[name] if not (self.path / PARTS_DIR / name / f.path).exists()
                 or (self.path / PARTS_DIR / name / f.path).stat().st_size != f.size]
        run_parallel(lambda f, _: self._fetch_checked(name, f), files, min(self.threads, len(files) or 1))
        marker = self.path / STAGED_DIR / name
        marker.write_bytes(b"")

    def _fetch_part_in_new_process(self, name: str) -> None:
        """`_fetch_part` run by a fresh interpreter (this module's __main__), its error re-raised
        here with the same finding; a few hundred milliseconds per part of hundreds of MB."""
        argv = [sys.executable, "-m", __name__, str(self.url), str(self.path), name, str(self.retries),
                str(self.threads)]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            message = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
            kind, _, text = message.partition(": ")
            try:
                sent = json.loads(text)
                text = Finding(sent["code"], **sent["fields"]) if sent.get("code") else sent["text"]
            except (ValueError, KeyError, TypeError, AttributeError):
                pass  # (not this module's line: the interpreter's own error)
            raise (CacheCorruptError if kind == "CacheCorruptError" else RemoteCacheError)(text or message)

    def _fetch_checked(self, name: str, f: RemoteFile) -> None:
        """Download one file to a temporary name, check its size and crc32c, rename it into place;
        retried `retries` times, then a CacheCorruptError (bytes wrong) or RemoteCacheError."""
        key = f"{PARTS_DIR}/{name}/{f.path}"
        dest = self.path / PARTS_DIR / name / f.path
        if dest.exists() and dest.stat().st_size == f.size and file_crc32c(dest) == f.crc32c:
            return  # staged before (a rerun, or a part evicted but for its small arrays)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}{PARTIAL}.{os.getpid()}.{threading.get_ident()}")
        last: Exception | None = None
        for attempt in range(self.retries):
            try:
                crc, size = 0, 0
                with open(tmp, "wb") as out:
                    for block in self.store.stream(key):
                        out.write(block)
                        crc, size = google_crc32c.extend(crc, block), size + len(block)
                if size != f.size or crc != f.crc32c:
                    last = CacheCorruptError(Finding(
                        "cache.download-corrupt", object=self.store.where(key), part=name, size=size,
                        indexed_size=f.size, attempts=self.retries, url=self.url))
                else:
                    os.replace(tmp, dest)
                    return
            except (CacheNotFoundError, RemoteCacheError) as e:
                last = e
            except OSError as e:  # the staging directory's disk: no retry mends it
                tmp.unlink(missing_ok=True)
                raise RemoteCacheError(local_disk_finding(e, self.store.where(key), part=name,
                                                          staging_dir=str(self.path))) from e
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            tmp.unlink(missing_ok=True)
            if attempt + 1 < self.retries:
                _sleep_unless_stopped(min(2.0, 0.1 * 2 ** attempt))
        if isinstance(last, CacheCorruptError):
            raise last
        why = {k: last.fields[k] for k in ("cause", "detail", "endpoint")} if (
            getattr(last, "code", None) == "cache.remote-request-failed") else dict(
            cause="missing" if isinstance(last, CacheNotFoundError) else "other", detail=str(last),
            endpoint=endpoint_name())
        raise RemoteCacheError(Finding("cache.fetch-failed-retries", object=self.store.where(key), part=name,
                                       attempts=self.retries, **why)) from last

    def evict_lru(self, needed: int, keep: set[str] = frozenset()) -> bool:
        """Remove the hidden-state files of least recently used staged parts until `needed`
        bytes are free (or none is left to evict); True when any was evicted."""
        markers = sorted((p for p in (self.path / STAGED_DIR).iterdir() if p.name not in keep),
                         key=lambda p: p.stat().st_mtime)
        freed = 0
        small = self.small_arrays
        for marker in markers:
            if freed >= needed:
                break
            name = marker.name
            lock = self._try_part_lock(name)
            if lock is None:
                continue  # being fetched by another process
            try:
                marker.unlink(missing_ok=True)
                for f in self.index.parts.get(name, []):
                    if not _in_skeleton(f.path, small):
                        p = self.path / PARTS_DIR / name / f.path
                        if p.exists():
                            freed += p.stat().st_size
                            p.unlink()
            finally:
                _unlock(lock)
        return freed > 0

    def prefetch(self, names: Iterable[str]) -> None:
        """Fetch parts in this order in a background thread, as far ahead as the budget allows
        without evicting (demand fetches evict); stops with `close`."""
        names = list(names)

        def run() -> None:
            for name in names:
                if self._stop.is_set():
                    return
                if self.is_staged(name):
                    continue
                if not self.budget.wait_for_room(self.part_bytes(name), poll_s=0.2, should_stop=self._stop.is_set):
                    return
                try:
                    self.ensure(name)
                except CacheError:
                    return  # the reader's own ensure raises it where the part is needed

        self._prefetcher = threading.Thread(target=run, name="dflash-prefetch", daemon=True)
        self._prefetcher.start()

    def close(self) -> None:
        self._stop.set()
        if self._prefetcher is not None:
            self._prefetcher.join(timeout=5)

    @contextmanager
    def _part_lock(self, name: str):
        fd = os.open(self.path / LOCKS_DIR / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _unlock(fd)

    def _try_part_lock(self, name: str) -> int | None:
        fd = os.open(self.path / LOCKS_DIR / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd


def _stop_if_requested() -> None:
    """A stop signal ends a fetch's wait (a retry's backoff, room being made by another
    process), where waiting on could last as long as the network is down (a download under way
    is finished): in a training run, in its process or a loader worker it forked, with
    `StopWaiting`, after which the run saves its last completed step; elsewhere with `Interrupted`."""
    check_stop("an object of the remote cache")
    if signum := stop_requested():
        raise Interrupted(signum)


def _sleep_unless_stopped(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        _stop_if_requested()
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.2))


def _small_arrays(header: dict[str, Any]) -> set[str]:
    """Arrays every part keeps staged: the data and the index (a few bytes a token)."""
    return {spec.name for spec in PartSchema.from_header(header) if spec.source in (DATA, INDEX)}


def _remove_stale_partials(root: Path) -> None:
    """Delete the half-written downloads of processes that are gone (killed mid-file)."""
    for p in root.rglob(f"*{PARTIAL}.*"):
        try:
            pid = int(p.name.split(f"{PARTIAL}.", 1)[1].split(".")[0])
            os.kill(pid, 0)
        except (ValueError, IndexError, ProcessLookupError):
            p.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, another user's


def _in_skeleton(path: str, small: set[str]) -> bool:
    """Staged at open and never evicted: metadata (zarr.json) and the small arrays' files."""
    return path.rsplit("/", 1)[-1] == "zarr.json" or path.split("/", 1)[0] in small


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}{PARTIAL}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        pass


def _unlock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def open_reader(path: str | os.PathLike, *, verify_checksums: bool = True, staging_dir: str | os.PathLike | None = None,
                disk_budget: int | None = None, prefetch: bool = True, **reader_kw: Any):
    """A CacheReader of a local cache directory, or of a remote cache through its staging
    directory (parts fetched ahead in commit order when `prefetch`, and on demand)."""
    from .reader import CacheReader

    if not is_remote(path):
        return CacheReader(path, verify_checksums=verify_checksums, **reader_kw)
    staging = Path(staging_dir) / default_staging_dir(str(path)).name if staging_dir is not None else None
    stage = StagedCache(str(path), staging, disk_budget=disk_budget).open()
    reader = CacheReader(stage.path, verify_checksums=verify_checksums, stage=stage, **reader_kw)
    if prefetch:
        stage.prefetch(p.name for p in reader.parts)
    return reader


def _fetch_part_main(argv: list[str]) -> int:
    """python -m dflash.cache_tools.remote URL STAGING_DIR PART RETRIES THREADS: fetch one part
    into a staging directory (`StagedCache._fetch_part_in_new_process`)."""
    url, path, name, retries, threads = argv
    try:
        StagedCache(url, path, retries=int(retries), threads=int(threads))._fetch_part(name)
    except (CacheError, CacheCorruptError) as e:  # (the last line: its kind and finding, raised again by the parent)
        sent = {"code": e.code, "fields": e.fields} if e.code else {"text": " ".join(str(e).split())}
        print(f"{type(e).__name__}: {json.dumps(sent, default=str)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(_fetch_part_main(sys.argv[1:]))
