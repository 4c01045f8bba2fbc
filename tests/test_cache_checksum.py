"""The chunk checksum is CRC-32C (RFC 3720) on every kind of buffer the cache hands it, and
the one zarr checks. (That the values are those of caches written by earlier versions:
tests/test_cache_old_format.py.)"""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr
from cache_utils import bits, make_cache, shard_file
from dflash.cache_tools.checksum import crc32c

_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ (0x82F63B78 if _c & 1 else 0)  # the reflected Castagnoli polynomial
    _TABLE.append(_c)


def reference_crc32c(data: bytes) -> int:
    """CRC-32C straight from its definition (table-driven, one byte at a time)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def test_checksum_is_the_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283 == reference_crc32c(b"123456789")
    assert crc32c(b"") == 0


@pytest.mark.parametrize("length", [1, 3, 7, 8, 15, 16, 63, 64, 65, 255, 256, 257, 4095, 65537])
def test_checksum_is_crc32c_for_bytes_memoryviews_and_arrays_at_any_alignment(length):
    data = os.urandom(length + 3)
    for start in range(4):  # unaligned starts, as chunk bodies inside a mapped shard file are
        piece = data[start: start + length]
        expected = reference_crc32c(piece)
        assert crc32c(piece) == expected
        assert crc32c(memoryview(data)[start: start + length]) == expected  # a slice of a map
        assert crc32c(bytearray(piece)) == expected
        assert crc32c(np.frombuffer(data, dtype=np.uint8)[start: start + length]) == expected
    if length % 2 == 0:
        assert crc32c(np.frombuffer(piece, dtype=np.uint16)) == expected  # a chunk as the writer has it


@pytest.mark.parametrize("codec", ["bf16", "raw"])
def test_zarr_checks_the_chunks_with_the_same_checksum(tmp_path, codec):
    """zarr reads a part's chunks only when their crc32c is its own; a flipped byte fails both."""
    samples = make_cache(tmp_path / "c", codec, parts=1)
    part = tmp_path / "c" / "parts" / "part-000000"
    hidden = zarr.open_group(part, mode="r")["hidden"][:]
    np.testing.assert_array_equal(hidden.view(np.int16), np.concatenate([bits(s[2]) for s in samples]))
    path = shard_file(tmp_path / "c", "part-000000")
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF  # inside the first chunk
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match="(?i)checksum"):
        zarr.open_group(part, mode="r")["hidden"][:16]
