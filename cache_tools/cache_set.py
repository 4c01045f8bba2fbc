"""The caches a trainer opens, and the rule for which caches may train together.

A run trains on one or more caches as one list of samples (`CacheSet`). Caches may train
together when they were extracted from the same target (`identity.Purpose.TRAIN_TOGETHER`)
with the same layers, width and extras; their codecs may differ, since every codec decodes to
the same bf16 states. Both are part of the cache contract, so they live here rather than in the
trainer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from dflash.runtime.findings import Finding

from .errors import ConfigMismatchError
from .eviction import refuse_evicted
from .identity import Purpose, target_differences
from .manifest import value_differences
from .plan import ExtractionProgress, unfinished_extraction
from .reader import CacheReader
from .remote import open_reader
from .schema import SAMPLE_IDS
from .sources import part_number


# Header parts that must agree between caches trained on together (the codec may differ: every
# codec decodes to the same bf16 states; the top-1 share too: each sample says whether it has
# its top-1; the target is compared by cache_tools.identity).
def train_together_identity(reader: CacheReader) -> dict[str, Any]:
    h = reader.manifest.header
    extras = {k: v for k, v in (h.get("extras") or {}).items() if k != "top1_share"}
    return {"format_version": h.get("format_version"), "target_layer_ids": h.get("target_layer_ids"),
            "hidden_size": h["hidden"].get("hidden_size"), "extras": extras}


def data_digests(header: dict[str, Any]) -> set[str]:
    """The sha256 digests of the input data a cache was extracted from (a merged cache: its
    sources'); empty for a header of before digests. Two caches that share one hold the same
    samples (a copy, a recompressed copy, a second extraction of the same files)."""
    data = header.get("data") or {}
    out = {data["sha256"]} if isinstance(data.get("sha256"), str) else set()
    for source in data.get("merged_from") or []:
        out |= data_digests({"data": source.get("data") or {}})
    return out


def shared_data(first: CacheReader, other: CacheReader) -> str | None:
    """The data digest two caches share (their samples are the same ones), or None."""
    common = data_digests(first.manifest.header) & data_digests(other.manifest.header)
    return min(common) if common else None


def check_distinct_data(readers: list[CacheReader], use: str = "train") -> None:
    """No two of `readers` were extracted from the same data: trained on together (`use`
    "train"), each of its samples would count twice an epoch (merged, "merge": twice in the cache)."""
    for i, reader in enumerate(readers):
        for earlier in readers[:i]:
            if (digest := shared_data(earlier, reader)) is not None:
                raise ConfigMismatchError(Finding("cache.same-data", first=str(earlier.cache_dir),
                                                  second=str(reader.cache_dir), sha256=digest, use=use))


def check_compatible(first: CacheReader, other: CacheReader) -> None:
    """Two caches can be trained on together: same target, layers, width and extras."""
    targets = target_differences(first.manifest.header.get("target"), other.manifest.header.get("target"),
                                 Purpose.TRAIN_TOGETHER)
    diffs = [[f"target.{k}", repr(a), repr(b)] for k, a, b in targets]
    diffs += value_differences(train_together_identity(first), train_together_identity(other))
    if diffs:
        raise ConfigMismatchError(Finding("cache.not-trainable-together", first=str(first.cache_dir),
                                          second=str(other.cache_dir), differences=diffs[:6]))


class CacheSet:
    """One or more finished caches of the same target and layers, seen as one list of samples
    (a `sources.SampleSource`); an s3:// cache is read from its staged copy."""

    follows = False  # (every part is committed: a read never waits)

    def __init__(self, cache_dirs: list[str], *, max_seq_len: int, verify_checksums: bool = True,
                 disk_budget: int | None = None, staging_dir: str | None = None):
        # An s3:// cache is read through a local staging directory (remote.py), within disk_budget.
        self.readers = [open_reader(d, verify_checksums=verify_checksums, disk_budget=disk_budget,
                                    staging_dir=staging_dir) for d in cache_dirs]
        for reader in self.readers:  # (its evicted parts would read as damaged ones)
            refuse_evicted(reader.cache_dir, "train")
        first = self.readers[0]
        for other in self.readers[1:]:
            check_compatible(first, other)
        check_distinct_data(self.readers, "train")
        self.manifest = first.manifest
        sizes = [len(r) for r in self.readers]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        full = np.concatenate([r.lengths for r in self.readers]) if sizes else np.zeros(0, np.int64)
        self.full_lengths = full
        self.lengths = np.minimum(full, max_seq_len)
        self.max_seq_len = max_seq_len
        self.truncated_samples = int((full > max_seq_len).sum())
        self.truncated_tokens = int((full - self.lengths).sum())
        self._sample_ids: np.ndarray | None = None
        self._split_keys: np.ndarray | None = None
        self.reading_epoch: int | None = None  # (set by the loader; a finished cache reads alike for every epoch)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def progress(self) -> ExtractionProgress | None:
        return None  # (no extraction is followed: see unfinished() for one that stopped early)

    def release(self, names: list[str]) -> None:
        pass  # (nothing is evicted from a finished cache: its maps stay open)

    def report_trained(self, parts: list[str], *, epoch: int, rank: int, world_size: int) -> None:
        pass  # (no extraction waits for it)

    def unfinished(self) -> list[tuple[Path, ExtractionProgress]]:
        """The caches whose extraction plan promises parts not committed yet, with how far each
        is (plan.unfinished_extraction); a staged s3:// cache's plan is not fetched, so it reads as
        finished."""
        out = []
        for reader in self.readers:
            progress = unfinished_extraction(reader.cache_dir, reader.manifest.header,
                                             {p.name for p in reader.manifest.parts})
            if progress is not None:
                out.append((reader.cache_dir, progress))
        return out

    def locate(self, index: int) -> tuple[int, int]:
        cache = int(np.searchsorted(self.starts, index, side="right") - 1)
        return cache, index - int(self.starts[cache])

    def read(self, index: int, out: dict[str, np.ndarray] | None = None,
             dequantize: bool = True) -> dict[str, Any]:
        cache, local = self.locate(index)
        return self.readers[cache].read_sample(local, max_tokens=self.max_seq_len, out=out,
                                               dequantize=dequantize)

    def read_ids(self, indices: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The token ids and loss mask (up to max_seq_len) of each sample of `indices`, in that
        order, without their hidden states: a part's arrays are decoded once for its samples in
        a row and dropped when the next sample is another part's (sorted indices read each once)."""
        for reader, local in self._each_sample(indices):
            yield reader.read_ids(local, max_tokens=self.max_seq_len)

    def read_top1_logprobs(self, indices: Any) -> Iterator[tuple[np.ndarray | None, np.ndarray]]:
        """The target's top-1 log-prob at each token (None where a cache stores no top-k) and the
        loss mask of each sample of `indices`, in that order, as read_ids reads them."""
        for reader, local in self._each_sample(indices):
            yield (reader.read_top1_logprobs(local, max_tokens=self.max_seq_len),
                   reader.read_ids(local, max_tokens=self.max_seq_len)[1])

    def _each_sample(self, indices: Any) -> Iterator[tuple[CacheReader, int]]:
        """(reader, its index) of each of `indices`, keeping a part open for its samples in a row
        and closing it when the next sample is another part's (its decoded arrays dropped)."""
        held: tuple[int, int] | None = None
        try:
            for index in indices:
                cache, local = self.locate(int(index))
                where = (cache, self.readers[cache].locate(local)[0])
                if held is not None and held != where:
                    self.readers[held[0]].close_part(held[1])
                held = where
                yield self.readers[cache], local
        finally:
            if held is not None:
                self.readers[held[0]].close_part(held[1])

    def sample_ids(self) -> np.ndarray:
        """The global sample id of every sample, in index order: from the commit records, or, for
        a part whose record predates them, read from the part once."""
        if self._sample_ids is None:
            ids = [np.asarray(rec.sample_ids, np.int64) if rec.sample_ids is not None
                   else r.part_arrays(p).small_array(SAMPLE_IDS) for r in self.readers for p, rec in enumerate(r.parts)]
            self._sample_ids = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, np.int64)
            for r in self.readers:
                r.close()  # DataLoader workers open their own maps
        return self._sample_ids

    def split_keys(self) -> np.ndarray:
        """The split key of every sample, in index order (what the held-out split, the evaluation
        cap, --max-train-samples and the top-1 selection score): the key its commit record stores
        (a hash of its prompt), else, for a part extracted before keys were stored, its sample
        id, so that such a cache splits as it always did."""
        if self._split_keys is None:
            ids, keys, at = self.sample_ids(), [], 0
            for r in self.readers:
                for rec in r.parts:
                    keys.append(ids[at: at + rec.samples] if rec.split_keys is None
                                else np.asarray(rec.split_keys, np.int64))
                    at += rec.samples
            self._split_keys = np.concatenate(keys).astype(np.int64) if keys else np.zeros(0, np.int64)
        return self._split_keys

    def part_numbers(self) -> np.ndarray:
        """The number of each sample's part ('part-000012': 12; the extraction's order), or for a
        part of another name (a merged cache) its position in its cache."""
        out = [np.full(p.samples, part_number(p.name, i), dtype=np.int64)
               for r in self.readers for i, p in enumerate(r.parts)]
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def part_names(self) -> list[str]:
        return [p.name for r in self.readers for p in r.parts]

    def sample_parts(self) -> np.ndarray:
        sizes = [p.samples for r in self.readers for p in r.parts]
        return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)

    def grouped(self) -> np.ndarray:
        """bool per sample, in index order: whether its split key is its record group's (the
        commit records' `grouped`) rather than its prompt's."""
        out, at = np.zeros(len(self), dtype=bool), 0
        for r in self.readers:
            for rec in r.parts:
                out[at + np.asarray(rec.grouped or (), dtype=np.int64)] = True
                at += rec.samples
        return out

    def identity(self) -> list[dict[str, Any]]:
        """What decides the samples: each cache's header identity and committed size (not its path)."""
        return [{"identity": r.manifest.identity(), "samples": len(r), "tokens": r.num_tokens}
                for r in self.readers]
