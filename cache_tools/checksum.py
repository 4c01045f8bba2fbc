"""crc32c (Castagnoli, RFC 3720): the checksum of every chunk, shard index and commit record.

It is the checksum of zarr's `crc32c` codec, computed by the library zarr computes it with
(google-crc32c), so caches stay readable and checkable by zarr, and the values are those of
every earlier version of the cache format.
"""

from __future__ import annotations

import google_crc32c
import numpy as np

__all__ = ["crc32c"]


def crc32c(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The checksum of a C-contiguous buffer (google-crc32c takes bytes and numpy arrays:
    other buffers are looked at as a numpy view of their bytes, without a copy)."""
    if not isinstance(data, (bytes, np.ndarray)):
        data = np.frombuffer(data, dtype=np.uint8)
    return google_crc32c.value(data)
