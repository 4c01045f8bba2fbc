"""`dflash-cache verify --quarantine`: the parts verify rejects leave the cache, so that the
command that wrote them writes exactly those parts again.

A part is one of the cache's only while the commit log names it; extraction (and recompress,
merge) write every planned part the log does not name. Quarantine therefore takes the rejected
parts out of the log and keeps them aside, under `quarantine/<when>-<pid>/`:

  parts/<name>/          the part's files as they were (moved, not copied)
  manifest.parts.jsonl   the commit records taken out of the log, byte for byte (a damaged
                         line too: it named a part that cannot be trusted)
  problems.txt           what verify found

The rest of the commit log is kept byte for byte. The cache's writer lock is held exclusively
meanwhile (no extraction may commit while the log is rewritten), and the order is crash-safe:
the part directories move first (a log that still names one verify reports missing, and a
second quarantine takes it out), then the log is replaced in one rename.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash.runtime.findings import Finding
from dflash.runtime.fsio import atomic_write_bytes, file_lock, fsync_dir
from dflash.runtime.locks import WriterLock

from .errors import CacheCorruptError
from .maintenance import VerifyReport
from .manifest import LOCK_FILE, LOG_FILE, PARTS_DIR, WRITER_LOCK_FILE, decode_log_line

QUARANTINE_DIR = "quarantine"


@dataclass
class QuarantineReport:
    """What quarantine took out of the cache."""

    directory: Path  # quarantine/<when>-<pid>/
    parts: list[str] = field(default_factory=list)  # commit records taken out of the log
    moved: list[str] = field(default_factory=list)  # part directories moved aside
    damaged_lines: list[int] = field(default_factory=list)  # commit-log lines that failed their checksum


def _named_part(line: bytes) -> str | None:
    """The part a damaged commit record names, if its JSON still says."""
    try:
        body = json.loads(line.rstrip(b"\n").rsplit(b" ", 1)[0])
        name = body.get("part") if isinstance(body, dict) else None
    except (ValueError, UnicodeDecodeError):
        return None
    return name if isinstance(name, str) and name and "/" not in name and not name.startswith(".") else None


def quarantine_damaged(cache_dir: str | os.PathLike, report: VerifyReport) -> QuarantineReport:
    """Take the parts `report` rejects (and the commit records that fail their checksum) out of
    the commit log, moving their files under quarantine/. Refused while another process writes
    the cache."""
    cache_dir = Path(cache_dir)
    bad = set(report.bad_parts)
    if report.parts >= 2 and len(bad) >= report.parts:
        first = next(p for p in report.problems if p.part)
        raise CacheCorruptError(Finding("cache.quarantine-every-part", cache=str(cache_dir), parts=report.parts,
                                        part=first.part, array=first.array, problem=first.finding))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = QuarantineReport(cache_dir / QUARANTINE_DIR / f"{stamp}-{os.getpid()}")
    with WriterLock(cache_dir / WRITER_LOCK_FILE, purpose="quarantine", output=cache_dir), \
            file_lock(cache_dir / LOCK_FILE):
        try:
            data = (cache_dir / LOG_FILE).read_bytes()
        except FileNotFoundError:
            data = b""
        end = data.rfind(b"\n") + 1  # a torn last line is no commit: dropped with the rewrite
        lines = data[:end].splitlines(keepends=True)
        names: list[str | None] = []
        for number, line in enumerate(lines, 1):
            try:
                names.append(decode_log_line(line, f"{LOG_FILE}, line {number}").name)
            except (CacheCorruptError, ValueError, KeyError, TypeError):
                out.damaged_lines.append(number)
                names.append(None)
                if (named := _named_part(line)) is not None:
                    bad.add(named)
        kept = [line for line, name in zip(lines, names) if name is not None and name not in bad]
        removed = [line for line, name in zip(lines, names) if name is None or name in bad]
        out.parts = sorted({name for name in names if name in bad})
        if not removed:
            return out
        (out.directory / PARTS_DIR).mkdir(parents=True, exist_ok=True)
        for name in sorted(bad):
            source = cache_dir / PARTS_DIR / name
            if source.is_dir():
                os.replace(source, out.directory / PARTS_DIR / name)
                out.moved.append(name)
        atomic_write_bytes(out.directory / LOG_FILE, b"".join(removed))
        atomic_write_bytes(out.directory / "problems.txt",
                           "".join(f"{p}\n" for p in report.problems).encode())
        fsync_dir(cache_dir / PARTS_DIR)
        atomic_write_bytes(cache_dir / LOG_FILE, b"".join(kept))  # last: the cache without them
    return out
