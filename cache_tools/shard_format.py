"""zarr v3's sharding format (`sharding_indexed`, index at the end), as the cache writes and reads it.

A shard file holds its stored inner chunks back to back, then the index: one little-endian
uint64 (offset, nbytes) pair per inner chunk, in chunk order ((2**64-1, 2**64-1) for a chunk
that is not stored), then the index's own crc32c (4 bytes, little-endian) when the index
codecs include crc32c. Each stored chunk is framed the same way: its codec's body, then its
crc32c (zarr's Crc32cCodec). The writer (part_layout.write_shards) encodes this and the hot read
path (part_files.PartFiles) decodes it, both through this module; tests/test_cache_shards.py
checks the bytes against zarr's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from dflash.runtime.findings import Finding

from .checksum import crc32c
from .errors import CacheCorruptError

EMPTY_CHUNK = 2**64 - 1  # a shard index entry (offset and size) of a chunk that is not stored
EMPTY = np.uint64(EMPTY_CHUNK)
INDEX_ENTRY_BYTES = 16  # (offset, nbytes), uint64 each
CRC_BYTES = 4


def checksum_bytes(data: bytes | memoryview) -> bytes:
    """The crc32c suffix of a chunk or an index."""
    return crc32c(data).to_bytes(CRC_BYTES, "little")


def frame_chunk(body: bytes) -> list[bytes]:
    """A stored chunk, as the pieces to write: its body, then its crc32c."""
    return [body, checksum_bytes(body)]


def located(what: object) -> dict[str, Any]:
    """Where a chunk is, as a finding's fields: `what` is a location (a mapping, or an object
    whose `fields()` gives one: part, array, dir, chunk, shard_file), or a text that names it."""
    if hasattr(what, "fields"):
        return what.fields()
    return dict(what) if isinstance(what, Mapping) else {"where": str(what)}


def checksum_mismatch(what: object) -> CacheCorruptError:
    return CacheCorruptError(Finding("cache.chunk-checksum", **located(what)))


def unframe_chunk(buf: memoryview, what: object, verify: bool) -> memoryview:
    """The body of a stored chunk (a view, no copy); its crc32c is checked when `verify`.
    `what` names the chunk in an error (`located`: made into fields only then)."""
    if len(buf) < CRC_BYTES:
        raise CacheCorruptError(Finding("cache.chunk-truncated", **located(what)))
    body = buf[:-CRC_BYTES]
    if verify and crc32c(body) != int.from_bytes(buf[-CRC_BYTES:], "little"):
        raise checksum_mismatch(what)
    return body


def index_nbytes(chunks_per_shard: int, checked: bool = True) -> int:
    """Bytes of a shard's index at the end of its file, with its crc32c when `checked`."""
    return chunks_per_shard * INDEX_ENTRY_BYTES + (CRC_BYTES if checked else 0)


def encode_index(chunk_nbytes: Sequence[int], chunks_per_shard: int) -> bytes:
    """The index (and its crc32c) of a shard whose first len(chunk_nbytes) inner chunks are
    stored back to back from offset 0 with these sizes; the others are not stored."""
    index = np.full((chunks_per_shard, 2), EMPTY_CHUNK, dtype="<u8")
    sizes = np.asarray(chunk_nbytes, dtype="<u8")
    index[:len(sizes), 1] = sizes
    index[:len(sizes), 0] = np.cumsum(sizes) - sizes
    raw = index.tobytes()
    return raw + checksum_bytes(raw)


def decode_index(shard: memoryview, chunks_per_shard: int, checked: bool, verify: bool,
                 what: object) -> np.ndarray:
    """The index of a shard file's bytes `shard` (a map of the whole file): uint64
    [chunks_per_shard, 2] (offset, nbytes), its crc32c checked when `checked` and `verify`,
    every stored chunk inside the file's data."""
    size = index_nbytes(chunks_per_shard, checked)
    if len(shard) < size:
        raise CacheCorruptError(Finding("cache.shard-truncated", **located(what), size=len(shard)))
    raw = shard[len(shard) - size:]
    if checked:
        raw = unframe_chunk(raw, what, verify)
    idx = np.frombuffer(raw, dtype="<u8").reshape(chunks_per_shard, 2).copy()
    live = idx[:, 0] != EMPTY
    if np.any(idx[live, 0] + idx[live, 1] > len(shard) - size):
        raise CacheCorruptError(Finding("cache.shard-offsets-past-end", **located(what)))
    return idx
