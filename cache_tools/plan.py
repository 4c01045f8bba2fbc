"""The extraction plan: every part a cache will hold, with its samples, known before any exists.

`dflash-extract` cuts parts from the input data alone (extract/data.py: the same data and
settings give the same parts whatever the number of ranks), so at its start it can write the
whole list: `manifest.plan.json`, each planned part's name, sample ids, token counts and split
keys (the hashes of the samples' prompts the held-out split groups by). A
trainer following a cache that is still being filled (`dflash-train --follow`) plans its
batches from this file, which is why its training order depends on the data and the seed and
never on when parts arrive; the extraction is complete when every planned part is committed.

The file is written atomically beside the header, after it, and carries a digest of the
header's identity: a plan written for other data or settings (a cache started anew with
--force) is stale, ignored by readers and rewritten by the next extraction. Caches without the
file (written before it existed) read as before; they just cannot be followed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.runtime.findings import Finding
from dflash.runtime.fsio import atomic_write_bytes, file_lock

from .errors import CacheCorruptError
from .manifest import LOCK_FILE, CommitLog, header_identity

PLAN_FILE = "manifest.plan.json"
PLAN_VERSION = 1


@dataclass(frozen=True)
class PlannedPart:
    """One part as the extraction will commit it: its samples in stored order."""

    name: str
    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    split_keys: tuple[int, ...] | None = None  # as its commit record will list them (None: a plan of before)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class ExtractionPlan:
    """The parts of a cache in plan order (part index order)."""

    parts: tuple[PlannedPart, ...]

    @property
    def num_samples(self) -> int:
        return sum(len(p.sample_ids) for p in self.parts)

    @property
    def num_tokens(self) -> int:
        return sum(p.tokens for p in self.parts)

    def names(self) -> list[str]:
        return [p.name for p in self.parts]


def identity_digest(header: dict[str, Any]) -> str:
    """sha256 of the header's identity: what the plan was computed from."""
    return hashlib.sha256(json.dumps(header_identity(header), sort_keys=True).encode()).hexdigest()


def write_plan(cache_dir: str | os.PathLike, header: dict[str, Any], parts: list[PlannedPart]) -> None:
    """Write the plan atomically unless a current one is there (several ranks may race: they
    compute the same plan, and os.replace makes the last identical copy win)."""
    cache_dir = Path(cache_dir)
    if read_plan(cache_dir, header) is not None:
        return
    body = {"plan_version": PLAN_VERSION, "identity_sha256": identity_digest(header),
            "parts": [{"part": p.name, "sample_ids": list(p.sample_ids), "lengths": list(p.lengths),
                       **({} if p.split_keys is None else {"split_keys": list(p.split_keys)})} for p in parts]}
    # Under the cache lock: a writer opening the cache removes temporary files there (orphans).
    with file_lock(cache_dir / LOCK_FILE):
        atomic_write_bytes(cache_dir / PLAN_FILE, json.dumps(body, separators=(",", ":")).encode())


def read_plan(cache_dir: str | os.PathLike, header: dict[str, Any]) -> ExtractionPlan | None:
    """The cache's plan, or None when it has none or one for another header (stale)."""
    path = Path(cache_dir) / PLAN_FILE
    try:
        body = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CacheCorruptError(Finding("cache.plan-not-json", file=str(path), error=str(e))) from e
    if body.get("identity_sha256") != identity_digest(header):
        return None
    try:
        parts = tuple(PlannedPart(str(p["part"]), tuple(int(x) for x in p["sample_ids"]),
                                  tuple(int(x) for x in p["lengths"]),
                                  None if p.get("split_keys") is None else tuple(int(x) for x in p["split_keys"]))
                      for p in body["parts"])
        if any(p.split_keys is not None and len(p.split_keys) != len(p.sample_ids) for p in parts):
            raise ValueError("split keys for every sample")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CacheCorruptError(Finding("cache.plan-damaged", file=str(path), lacks=str(e))) from e
    return ExtractionPlan(parts)


@dataclass(frozen=True)
class ExtractionProgress:
    """How far the extraction of a planned cache is."""

    planned: int
    committed: int
    planned_samples: int = 0
    committed_samples: int = 0

    @property
    def complete(self) -> bool:
        return self.committed >= self.planned

    def fields(self) -> dict[str, int]:
        """The counts, as a finding's fields (`messages.progress` renders them)."""
        return dict(committed=self.committed, planned=self.planned, committed_samples=self.committed_samples,
                    planned_samples=self.planned_samples)

    def describe(self) -> str:
        """"6 of its 46 planned parts are committed (24 of 300 samples)"."""
        from .messages import progress

        return progress(**self.fields())


def unfinished_extraction(cache_dir: str | os.PathLike, header: dict[str, Any],
                          committed: set[str]) -> ExtractionProgress | None:
    """The progress of a cache whose plan promises parts that are not committed (`committed`:
    the names its commit log holds, evicted ones too): an extraction stopped before its end, or
    still running, or one of its ranks lost. None when every planned part is there, or the cache
    has no current plan (written before plans, or by a merge or recompress, which commit whole)."""
    plan = read_plan(cache_dir, header)
    if plan is None:
        return None
    done = [p for p in plan.parts if p.name in committed]
    if len(done) >= len(plan.parts):
        return None
    return ExtractionProgress(len(plan.parts), len(done), plan.num_samples, sum(len(p.sample_ids) for p in done))


def extraction_progress(plan: ExtractionPlan, log: CommitLog) -> ExtractionProgress:
    """Planned parts committed so far, by the commit log (refreshed here)."""
    log.refresh()
    return ExtractionProgress(len(plan.parts), sum(1 for n in plan.names() if n in log.records))
