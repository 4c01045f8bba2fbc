"""What a trainer reads samples from: one protocol, three sources.

A finished cache (or several trained on together), a cache still being extracted (`--follow`)
and a remote cache staged under a local directory are all a list of samples with their ids,
split keys, lengths and part numbers, read one at a time into the loader's buffers. The
trainer plans its batches from those and never asks which kind it reads:

- `cache_set.CacheSet`: finished caches, local or s3:// (remote.py stages those; a staged cache
  is read as a local one).
- `followed.FollowCacheSet`: the samples an extraction plan promises; a read waits for its part.

What differs between them is said by the source: `follows` (reads wait for an extraction, so
the trainer does not scan the samples ahead of training), `grouped()` (None where it is not
known yet), `progress()` (None where no extraction is followed), `release` and
`report_trained` (no-ops for a finished cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from .manifest import Manifest
    from .plan import ExtractionProgress
    from .reader import CacheReader


def part_number(name: str, fallback: int) -> int:
    """12 for 'part-000012' (the extraction's order); `fallback` for another name (a merged cache)."""
    head, _, digits = name.rpartition("-")
    return int(digits) if head == "part" and digits.isdigit() else fallback


@runtime_checkable
class SampleSource(Protocol):
    """A list of cached samples a trainer plans batches over and reads (index order throughout)."""

    readers: list[CacheReader]
    """One reader per cache (its header, schema, codec and --top1-share)."""
    manifest: Manifest
    """The first cache's manifest: the header every cache of the source agrees on."""
    starts: np.ndarray
    """The first index of each cache, then the number of samples."""
    full_lengths: np.ndarray
    """Each sample's stored tokens."""
    lengths: np.ndarray
    """Each sample's tokens as read (up to max_seq_len)."""
    max_seq_len: int
    truncated_samples: int
    truncated_tokens: int
    follows: bool
    """Reads wait for the parts an extraction still writes (`dflash-train --follow`)."""
    reading_epoch: int | None
    """The training epoch the sample being read is for (set by the loader; None: an evaluation)."""

    def __len__(self) -> int: ...

    def sample_ids(self) -> np.ndarray:
        """The global sample id of every sample."""

    def split_keys(self) -> np.ndarray:
        """The key the held-out split, the caps and the top-1 selection score each sample by."""

    def part_numbers(self) -> np.ndarray:
        """The number of each sample's part (the extraction's order; --shuffle-parts groups)."""

    def part_names(self) -> list[str]:
        """The parts' names, the order `sample_parts` indexes."""

    def sample_parts(self) -> np.ndarray:
        """Each sample's part, as an index into part_names()."""

    def grouped(self) -> np.ndarray | None:
        """Whether each sample's split key is its record group's; None where not known yet."""

    def identity(self) -> list[dict[str, Any]]:
        """What decides the samples, per cache (a run's identity; not the paths)."""

    def read(self, index: int, out: dict[str, Any] | None = None, dequantize: bool = True) -> dict[str, Any]:
        """Sample `index` (up to max_seq_len tokens), its hidden arrays decoded into `out` when given."""

    def progress(self) -> ExtractionProgress | None:
        """How far the followed extraction is; None for finished caches."""

    def release(self, names: list[str]) -> None:
        """Close this process's maps of the named parts (read no more this epoch)."""

    def report_trained(self, parts: list[str], *, epoch: int, rank: int, world_size: int) -> None:
        """Record in the cache that this rank has trained on `parts` in `epoch` (an extraction under
        a disk budget may evict them); nothing for finished caches."""

