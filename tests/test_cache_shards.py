"""The writer's own shard files: laid out as zarr writes them, and readable by zarr.

With zstd's own parameters for the level the files are byte for byte zarr's (c-blosc's)
files, which pins the Blosc chunk format the writer produces; packed as the format packs
them (literal-only zstd frames by default, or the match limits) they hold other zstd frames
but the same layout, and decode to the same data.
"""

from __future__ import annotations

import numcodecs.blosc
import numpy as np
import pytest
import zarr
from dflash.cache_tools import codecs
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.writer import write_shards


@pytest.mark.parametrize("codec_name,dtype", [("bf16", np.uint16), ("fp8", np.uint8), ("raw", np.uint16)])
@pytest.mark.parametrize("rows", [1, 70, 256, 300])  # one row, partial chunk, whole shards, partial shard
@pytest.mark.parametrize("packing", ["zstd-own-params", "match-limits", "literals-only"])
def test_shard_files_match_zarrs_and_read_back(tmp_path, codec_name, dtype, rows, packing):
    own_params = packing == "zstd-own-params"
    codec = HiddenCodec(name=codec_name, blocksize=1 << 12, zstd_literals_only=packing == "literals-only")
    if own_params:
        codec = HiddenCodec(name=codec_name, blocksize=1 << 12, zstd_hash_log=0, zstd_min_match=0,
                            zstd_literals_only=False)
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
        mine, zarrs = (tmp_path / "by_writer" / rel).read_bytes(), (tmp_path / "by_zarr" / rel).read_bytes()
        if own_params or codec_name == "raw" or rel.parts[-3:-2] != ("c",):
            assert mine == zarrs, rel
        else:  # a shard file: same chunks in the same order, other zstd frames
            chunks_mine, chunks_zarrs = shard_chunks(mine, 128 // 32), shard_chunks(zarrs, 128 // 32)
            assert len(chunks_mine) == len(chunks_zarrs) > 0
            for a, b in zip(chunks_mine, chunks_zarrs):
                assert numcodecs.blosc.decompress(a) == numcodecs.blosc.decompress(b), rel
    back = zarr.open_array(zarr.storage.LocalStore(tmp_path / "by_writer"), path="hidden")[...]
    np.testing.assert_array_equal(back, data)


def shard_chunks(data: bytes, per_shard: int) -> list[bytes]:
    """The stored chunk bodies (crc32c stripped) of a shard file, in index order."""
    index = np.frombuffer(data[-4 - 16 * per_shard:-4], dtype="<u8").reshape(per_shard, 2)
    return [data[int(off):int(off + nb) - 4] for off, nb in index if off != codecs.EMPTY_CHUNK]
