"""A local cache sent to object storage (`dflash-cache upload`), and a remote cache checked
where it lies (`dflash-cache verify s3://...`): the files, their sizes and crc32c against the
cache's file index. Training from a remote cache is remote.py's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import google_crc32c

from .errors import CacheError
from .eviction import refuse_evicted
from .manifest import HEADER_FILE, LOG_FILE, PARTS_DIR, read_manifest
from .plan import unfinished_extraction
from .remote_store import (
    FILES_INDEX,
    FilesIndex,
    RemoteFile,
    RemoteStore,
    file_crc32c,
    staged_manifest,
)


def part_files(part_dir: Path) -> list[RemoteFile]:
    return [RemoteFile(p.relative_to(part_dir).as_posix(), p.stat().st_size, file_crc32c(p))
            for p in sorted(part_dir.rglob("*")) if p.is_file()]


# -- upload and verify -------------------------------------------------------------------------

def upload_cache(local: str | os.PathLike, url: str, *, threads: int = 8,
                 on_part: Callable[[str], None] | None = None) -> dict[str, int]:
    """Copy a local cache to `url`: parts (files already there with the same size are kept, so
    an interrupted upload resumes), then the file index, the commit log, the header last. A cache
    whose extraction has not committed every planned part is refused: the extraction plan stays
    behind, so a trainer of the remote copy could not tell the parts there from the whole data.
    So is one with parts evicted under a disk budget: their files are gone."""
    local = Path(local)
    m = read_manifest(local)
    refuse_evicted(local, "upload")
    if (left := unfinished_extraction(local, m.header, {p.name for p in m.parts})) is not None:
        raise CacheError(
            f"Cannot upload {local}: it is not a finished cache ({left.describe()}): its extraction was stopped "
            "before its end, is still running, or lost a rank, and a trainer of the remote copy would take the "
            "parts there for the whole data. Rerun the same dflash-extract command to finish it, then upload.")
    store = RemoteStore(url)
    index = FilesIndex()
    uploaded = skipped = 0

    def one(name: str) -> tuple[int, int]:
        files = part_files(local / PARTS_DIR / name)
        index.parts[name] = files
        up = sk = 0
        for f in files:
            key = f"{PARTS_DIR}/{name}/{f.path}"
            if store.size(key) == f.size:
                sk += 1
                continue
            store.put(key, local / PARTS_DIR / name / f.path)
            up += 1
        if on_part is not None:
            on_part(name)
        return up, sk

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for up, sk in pool.map(one, [p.name for p in m.parts]):
            uploaded, skipped = uploaded + up, skipped + sk
    index.parts = {p.name: index.parts[p.name] for p in m.parts}  # commit order
    store.put(FILES_INDEX, index.to_bytes())
    store.put(LOG_FILE, (local / LOG_FILE).read_bytes())
    store.put(HEADER_FILE, (local / HEADER_FILE).read_bytes())
    return {"parts": len(m.parts), "files_uploaded": uploaded, "files_kept": skipped,
            "bytes": sum(f.size for files in index.parts.values() for f in files)}


@dataclass
class RemoteVerifyReport:
    url: str
    parts: int = 0
    files: int = 0
    problems: list[str] = field(default_factory=list)

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
        report.problems += [f"part {n}: not in {FILES_INDEX} (an incomplete upload: upload again)" for n in missing]

        def check(name: str, f: RemoteFile) -> str | None:
            key = f"{PARTS_DIR}/{name}/{f.path}"
            size = store.size(key)
            if size is None:
                return f"part {name}: {key} is missing"
            if size != f.size:
                return f"part {name}: {key} has {size} bytes, the index says {f.size}"
            if not fast:
                crc = 0
                for block in store.stream(key):
                    crc = google_crc32c.extend(crc, block)
                if crc != f.crc32c:
                    return f"part {name}: {key} does not match its crc32c (the object is corrupt)"
            return None

        jobs = [(p.name, f) for p in m.parts if p.name in index.parts for f in index.parts[p.name]]
        with ThreadPoolExecutor(max(1, threads)) as pool:
            report.problems += [r for r in pool.map(lambda a: check(*a), jobs) if r]
        report.parts, report.files = len(m.parts), len(jobs)
        for p in m.parts:
            indexed = sum(f.size for f in index.parts.get(p.name, []))
            if p.name in index.parts and indexed != p.nbytes:
                report.problems.append(f"part {p.name}: its files hold {indexed} bytes, the commit log says {p.nbytes}")
    return report
