"""A local cache sent to object storage (`dflash-cache upload`), and a remote cache checked
where it lies (`dflash-cache verify s3://...`): the files, their sizes and crc32c against the
cache's file index. Training from a remote cache is remote.py's.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google_crc32c
from dflash.runtime.findings import Finding

from .errors import CacheError
from .eviction import refuse_evicted
from .identity import Purpose
from .manifest import HEADER_FILE, LOG_FILE, PARTS_DIR, identity_differences, read_manifest
from .plan import unfinished_extraction
from .remote_store import (
    FILES_INDEX,
    FilesIndex,
    ForeignPrefixError,
    ObjectInfo,
    RemoteFile,
    RemoteStore,
    cache_digest,
    check_stop,
    describe_cache,
    file_crc32c,
    run_parallel,
    staged_manifest,
)


def part_files(part_dir: Path) -> list[RemoteFile]:
    return [RemoteFile(p.relative_to(part_dir).as_posix(), p.stat().st_size, file_crc32c(p))
            for p in sorted(part_dir.rglob("*")) if p.is_file()]


# -- upload and verify -------------------------------------------------------------------------

def upload_cache(local: str | os.PathLike, url: str, *, threads: int = 8, replace: bool = False,
                 on_part: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Copy a local cache to `url`: parts, then the file index, the commit log, the header last.

    Objects are compared by content: each is written with its crc32c and the cache's identity
    as metadata, and an object is kept only where both (and its size) are those of the local
    file, so a rerun resumes an interrupted upload and rewrites whatever differs (a corrupt or
    replaced object). A prefix holding another cache (another identity, or objects of no upload
    of this cache) is refused before anything is written, unless `replace`: then its objects
    are rewritten or deleted, and the prefix ends as a fresh upload would leave it. Objects of
    this cache that the local one no longer has are deleted.

    A cache whose extraction has not committed every planned part is refused: the extraction
    plan stays behind, so a trainer of the remote copy could not tell the parts there from the
    whole data. So is one with parts evicted under a disk budget: their files are gone."""
    local = Path(local)
    m = read_manifest(local)
    refuse_evicted(local, "upload")
    if (left := unfinished_extraction(local, m.header, {p.name for p in m.parts})) is not None:
        raise CacheError(Finding("cache.upload-unfinished", cache=str(local), **left.fields()))
    store = RemoteStore(url)
    digest = cache_digest(m.header)
    names = [p.name for p in m.parts]
    local_files = dict(zip(names, run_parallel(lambda n, _: part_files(local / PARTS_DIR / n), names, threads),
                           strict=True))
    wanted = {f"{PARTS_DIR}/{n}/{f.path}" for n in names for f in local_files[n]} | set(TOP_FILES)
    found = _survey(store, threads)
    foreign = _foreign(store, found, m.header, local)
    if foreign is not None and not replace:
        raise foreign
    if foreign is not None and HEADER_FILE in found:
        store.delete([HEADER_FILE])  # the prefix is no cache while it is replaced

    def one(name: str, stop: threading.Event) -> tuple[int, int]:
        up = kept = 0
        for f in local_files[name]:
            check_stop(stop)
            key = f"{PARTS_DIR}/{name}/{f.path}"
            have = found.get(key)
            if have is not None and (have.size, have.crc32c, have.cache) == (f.size, f.crc32c, digest):
                kept += 1
                continue
            store.put(key, local / PARTS_DIR / name / f.path, crc32c=f.crc32c, cache=digest)
            up += 1
        if on_part is not None:
            on_part(name)
        return up, kept

    counts = run_parallel(one, names, threads)
    # Leftovers: objects of this cache it no longer holds, and with `replace` everything else.
    stale = sorted(k for k, info in found.items() if k not in wanted and (replace or info.cache == digest))
    if stale:
        store.delete(stale)
    index = FilesIndex({n: local_files[n] for n in names})  # commit order
    for key, data in ((FILES_INDEX, index.to_bytes()), (LOG_FILE, (local / LOG_FILE).read_bytes()),
                      (HEADER_FILE, (local / HEADER_FILE).read_bytes())):
        store.put(key, data, crc32c=google_crc32c.value(data), cache=digest)
    return {"parts": len(m.parts), "files_uploaded": sum(c[0] for c in counts),
            "files_kept": sum(c[1] for c in counts), "files_removed": len(stale),
            "replaced": None if foreign is None else foreign.found or "other objects",
            "bytes": sum(f.size for files in index.parts.values() for f in files)}


TOP_FILES = (FILES_INDEX, LOG_FILE, HEADER_FILE)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _survey(store: RemoteStore, threads: int) -> dict[str, ObjectInfo]:
    """Every object under the prefix with its size and upload metadata (one HEAD each)."""
    keys = store.keys()

    def look(key: str, stop: threading.Event) -> ObjectInfo | None:
        check_stop(stop)
        return store.info(key)

    return {k: info for k, info in zip(keys, run_parallel(look, keys, threads), strict=True) if info is not None}


def _foreign(store: RemoteStore, found: dict[str, ObjectInfo], header: dict[str, Any],
             local: Path) -> ForeignPrefixError | None:
    """The refusal of a prefix that holds another cache than `header`'s, None if it holds none.
    With a header there, its identity decides; without one (an unfinished upload), the objects'
    metadata does: each must be of this cache."""
    digest = cache_digest(header)
    if HEADER_FILE in found:
        try:
            theirs = json.loads(store.get(HEADER_FILE))
            their_digest = cache_digest(theirs)
        except (ValueError, TypeError, AttributeError):
            theirs, their_digest = None, None
        if their_digest == digest:
            return None
        differs = [] if theirs is None else identity_differences(header, theirs, Purpose.RESUME)
        return ForeignPrefixError(Finding(
            "cache.upload-prefix-other-cache", url=store.url, local=str(local), uploading=describe_cache(header),
            there=None if theirs is None else describe_cache(theirs), header=HEADER_FILE,
            differences=[[k, _brief(b), _brief(a)] for k, a, b in differs[:2]]),
            url=store.url, found=their_digest, uploading=digest)
    others = sorted(k for k, info in found.items() if info.cache != digest)
    if not others:
        return None
    caches = sorted({found[k].cache for k in others if found[k].cache})
    return ForeignPrefixError(Finding(
        "cache.upload-prefix-foreign-objects", url=store.url, objects=len(others), first=others[0],
        caches=caches[:2], local=str(local), uploading=describe_cache(header)),
        url=store.url, found=caches[0] if caches else None, uploading=digest)


@dataclass
class RemoteVerifyReport:
    url: str
    parts: int = 0
    files: int = 0
    problems: list[Finding] = field(default_factory=list)  # cache.verify-remote-*, with the part and object

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_remote(url: str, *, fast: bool = False, threads: int = 8) -> RemoteVerifyReport:
    """Every committed part is in the file index and every indexed file is stored with its
    size (fast) and its crc32c (downloaded and checked; nothing is written locally)."""
    store = RemoteStore(url)
    report = RemoteVerifyReport(url)
    with staged_manifest(store) as (m, index):
        missing = [p.name for p in m.parts if p.name not in index.parts]
        report.problems += [Finding("cache.verify-remote-not-indexed", part=n, index=FILES_INDEX) for n in missing]

        def check(job: tuple[str, RemoteFile], stop: threading.Event) -> Finding | None:
            check_stop(stop)
            name, f = job
            key = f"{PARTS_DIR}/{name}/{f.path}"
            size = store.size(key)
            if size is None:
                return Finding("cache.verify-remote-missing", part=name, object=key)
            if size != f.size:
                return Finding("cache.verify-remote-size", part=name, object=key, size=size, indexed_size=f.size)
            if not fast:
                crc = 0
                for block in store.stream(key):
                    crc = google_crc32c.extend(crc, block)
                if crc != f.crc32c:
                    return Finding("cache.verify-remote-crc", part=name, object=key)
            return None

        jobs = [(p.name, f) for p in m.parts if p.name in index.parts for f in index.parts[p.name]]
        report.problems += [r for r in run_parallel(check, jobs, threads) if r]
        report.parts, report.files = len(m.parts), len(jobs)
        for p in m.parts:
            indexed = sum(f.size for f in index.parts.get(p.name, []))
            if p.name in index.parts and indexed != p.nbytes:
                report.problems.append(Finding("cache.verify-remote-part-size", part=p.name, indexed=indexed,
                                               nbytes=p.nbytes))
    return report
