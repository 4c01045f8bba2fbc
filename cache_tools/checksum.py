"""crc32c (Castagnoli, RFC 3720): the checksum of every chunk, shard index and manifest.

It is the checksum of zarr's `crc32c` codec, so caches stay readable by zarr. crc32c-rs
picks the fastest kernel the CPU offers (on x86-64 with AVX-512 and VPCLMULQDQ it folds
64 bytes per step: ~3x the SSE4.2 `crc32` loop of the crc32c package on data in the CPU
cache). The raw reader's only work beyond a copy is this checksum, so its speed is the
reader's. Where crc32c-rs is not installed (it has wheels for Python >= 3.11), the crc32c
package, which zarr itself uses, computes the same values.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    from crc32c_rs import crc32c as _crc32c

    IMPLEMENTATION = "crc32c-rs"
except ImportError:  # pragma: no cover - exercised on installs without the wheel
    from crc32c import crc32c as _crc32c

    IMPLEMENTATION = "crc32c"

crc32c: Callable[..., int] = _crc32c
"""crc32c(data, value=0) -> int: the checksum of a C-contiguous buffer, continued from
`value` (the checksum of the bytes before it), as in the crc32c package."""

__all__ = ["IMPLEMENTATION", "crc32c"]
