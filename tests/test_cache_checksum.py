"""The chunk checksum: crc32c-rs computes exactly zarr's crc32c, and caches written or read
with either implementation are the same caches."""

from __future__ import annotations

import os
import subprocess
import sys

import crc32c as crc32c_package
import numpy as np
import pytest
from cache_utils import bits, make_cache, shard_file
from dflash.cache_tools import checksum, reader, writer
from dflash.cache_tools.errors import CacheCorruptError
from dflash.cache_tools.reader import CacheReader


def test_the_installed_checksum_is_crc32c_rs_where_it_has_wheels():
    # setup.cfg requires crc32c-rs on Python >= 3.11 (its wheels' floor).
    assert checksum.IMPLEMENTATION == ("crc32c-rs" if sys.version_info >= (3, 11) else "crc32c")


@pytest.mark.parametrize("length", [0, 1, 3, 7, 8, 15, 16, 63, 64, 65, 255, 256, 257, 4095, 65537, 1 << 20])
def test_checksum_equals_the_crc32c_package_at_any_length_and_alignment(length):
    data = os.urandom(length + 3)
    for start in range(4):  # unaligned starts reach the kernels' head and tail loops
        view = memoryview(data)[start: start + length]
        assert checksum.crc32c(view) == crc32c_package.crc32c(view)
        assert checksum.crc32c(view, 0xDEADBEEF) == crc32c_package.crc32c(view, 0xDEADBEEF)


def test_checksum_continues_across_pieces_as_over_the_whole():
    data = np.frombuffer(os.urandom(3 * (256 << 10) + 123), dtype=np.uint8)
    crc = 0
    for p in range(0, len(data), 100_000):
        crc = checksum.crc32c(data[p: p + 100_000], crc)
    assert crc == crc32c_package.crc32c(data) == checksum.crc32c(data)
    assert checksum.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)


@pytest.mark.parametrize("codec", ["bf16", "raw"])
def test_caches_written_with_one_implementation_read_with_the_other(tmp_path, monkeypatch, codec):
    with monkeypatch.context() as m:
        m.setattr(writer, "crc32c", crc32c_package.crc32c)
        samples = make_cache(tmp_path / "by-package", codec, parts=1)
    by_rs = make_cache(tmp_path / "by-rs", codec, parts=1)
    monkeypatch.setattr(reader, "crc32c", crc32c_package.crc32c)
    for name in ("by-package", "by-rs"):
        got = CacheReader(tmp_path / name)
        for i, (_, _, hidden) in enumerate(samples):
            np.testing.assert_array_equal(bits(got.read_sample(i)["hidden"]), bits(hidden))
    monkeypatch.undo()
    got = CacheReader(tmp_path / "by-package")
    for i, (_, _, hidden) in enumerate(by_rs):
        np.testing.assert_array_equal(bits(got.read_sample(i)["hidden"]), bits(hidden))
    stored = {p.relative_to(tmp_path / "by-rs") for p in (tmp_path / "by-rs" / "parts").rglob("*") if p.is_file()}
    for rel in stored:  # same bytes: the checksums in chunks and indexes agree byte for byte
        if rel.parts[-1] != "zarr.json":
            assert (tmp_path / "by-rs" / rel).read_bytes() == (tmp_path / "by-package" / rel).read_bytes(), rel


def test_without_crc32c_rs_the_crc32c_package_checks_the_chunks(tmp_path):
    make_cache(tmp_path / "c", "raw", parts=1)
    path = shard_file(tmp_path / "c", "part-000000", shard=2)
    data = bytearray(path.read_bytes())
    data[200] ^= 0x10  # shard 2's first chunk: rows 128-143, all of sample 1 (rows 100-199)
    path.write_bytes(bytes(data))
    code = (
        "import sys; sys.modules['crc32c_rs'] = None\n"
        "from dflash.cache_tools import checksum\n"
        "from dflash.cache_tools.reader import CacheReader\n"
        "from dflash.cache_tools.errors import CacheCorruptError\n"
        "print(checksum.IMPLEMENTATION)\n"
        f"r = CacheReader({str(tmp_path / 'c')!r})\n"
        "r.read_sample(0)\n"
        "try:\n    r.read_sample(1)\nexcept CacheCorruptError as e:\n    print('caught', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "crc32c"
    assert "caught" in out and "checksum mismatch" in out
    with pytest.raises(CacheCorruptError, match="checksum mismatch"):
        CacheReader(tmp_path / "c").read_sample(1)
