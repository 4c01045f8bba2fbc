"""The writer's own shard files are byte for byte the files zarr writes, and read by zarr; the shard
index and chunk framing have one encoder and decoder (shard_format)."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.errors import CacheCorruptError
from dflash.cache_tools.part_layout import write_shards
from dflash.cache_tools.shard_format import (
    EMPTY,
    decode_index,
    encode_index,
    frame_chunk,
    unframe_chunk,
)


@pytest.mark.parametrize("codec_name,dtype", [("bf16", np.uint16), ("fp8", np.uint8), ("raw", np.uint16)])
@pytest.mark.parametrize("rows", [1, 70, 256, 300])  # one row, partial chunk, whole shards, partial shard
@pytest.mark.parametrize("blocksize", [1 << 12, HiddenCodec().blocksize])
def test_shard_files_match_zarrs_and_read_back(tmp_path, codec_name, dtype, rows, blocksize):
    codec = HiddenCodec(name=codec_name, blocksize=blocksize)
    rng = np.random.default_rng(rows)
    if dtype == np.uint16:  # bf16-like bits: compressible high bytes, noisy low bytes
        data = (rng.normal(size=(rows, 48)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        data = rng.integers(0, 256, size=(rows, 48), dtype=np.uint8)
    arrays = {}
    for name in ("by_zarr", "by_writer"):
        arrays[name] = zarr.create_array(
            zarr.storage.LocalStore(tmp_path / name), name="hidden", shape=data.shape, dtype=data.dtype,
            chunks=(32, 48), shards=(128, 48), compressors=codec.zarr_compressors(), filters=None,
            fill_value=0, config={"write_empty_chunks": True},
        )
    arrays["by_zarr"][...] = data
    write_shards(tmp_path / "by_writer" / "hidden", data, 32, 128, codec)
    ref = sorted(p.relative_to(tmp_path / "by_zarr") for p in (tmp_path / "by_zarr").rglob("*") if p.is_file())
    got = sorted(p.relative_to(tmp_path / "by_writer") for p in (tmp_path / "by_writer").rglob("*") if p.is_file())
    assert got == ref
    for rel in ref:
        assert (tmp_path / "by_writer" / rel).read_bytes() == (tmp_path / "by_zarr" / rel).read_bytes(), rel
    back = zarr.open_array(zarr.storage.LocalStore(tmp_path / "by_writer"), path="hidden")[...]
    np.testing.assert_array_equal(back, data)



def test_the_index_decodes_to_what_was_encoded_and_damage_is_named():
    """shard_format is the one encoder and decoder of the index: the reader reads back the
    offsets the writer wrote, and a flipped bit, a truncated file or an offset past the data
    is refused with the shard named."""
    chunks = [frame_chunk(bytes([i]) * (10 + i)) for i in range(3)]
    data = b"".join(b"".join(c) for c in chunks)
    shard = data + encode_index([sum(map(len, c)) for c in chunks], 4)
    idx = decode_index(memoryview(shard), 4, checked=True, verify=True, what="shard 0")
    assert idx[3].tolist() == [EMPTY, EMPTY]
    for i, (off, nb) in enumerate(idx[:3].tolist()):
        assert bytes(unframe_chunk(memoryview(shard)[off:off + nb], "chunk", True)) == bytes([i]) * (10 + i)
    flipped = bytearray(shard)
    flipped[-10] ^= 1
    where = {"part": "p", "array": "hidden", "dir": "c/parts/p", "chunk": None, "shard_file": "c/0/0"}
    with pytest.raises(CacheCorruptError) as err:
        decode_index(memoryview(bytes(flipped)), 4, checked=True, verify=True, what=where)
    assert err.value.code == "cache.chunk-checksum" and err.value.fields == where
    with pytest.raises(CacheCorruptError) as err:
        decode_index(memoryview(shard[-20:]), 4, checked=True, verify=True, what=where)
    assert err.value.code == "cache.shard-truncated" and err.value.fields == {**where, "size": 20}
    with pytest.raises(CacheCorruptError) as err:
        decode_index(memoryview(data[:-1] + shard[len(data):]), 4, checked=True, verify=True, what="shard 0")
    assert err.value.code == "cache.shard-offsets-past-end" and err.value.fields == {"where": "shard 0"}
    with pytest.raises(CacheCorruptError) as err:
        unframe_chunk(memoryview(b"\x07" + shard[1:idx[0, 1]]), "chunk", True)
    assert err.value.code == "cache.chunk-checksum" and err.value.fields == {"where": "chunk"}  # the caller's words
