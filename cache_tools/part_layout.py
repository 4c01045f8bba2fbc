"""Writing one part's files: its zarr v3 group (the layout docs/cache-format.md describes),
with the shard files of its large arrays written here rather than by zarr.

`writer.PartWriter` calls `write_part_group` on a temporary directory, then fsyncs and commits
it; what a part's files hold and how they are chunked comes from the cache's `PartSchema`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np
import zarr

from .codecs import HiddenCodec
from .schema import HIDDEN_CHUNKS, OFFSETS, SAMPLE_IDS, PartSchema, sample_offsets, shard_key
from .shard_format import encode_index, frame_chunk


class CacheFormat(Protocol):
    """What writing a part's files reads of its cache (`writer.CacheWriter`)."""

    schema: PartSchema
    codec: HiddenCodec


def write_part_group(
    path: Path,
    cache: CacheFormat,
    cols: dict[str, list[np.ndarray]],
    sample_ids: list[int],
    lengths: list[int],
    name: str,
) -> None:
    """Write the zarr v3 group of one part (the layout docs/cache-format.md describes)."""
    store = zarr.storage.LocalStore(path)
    tokens = sum(lengths)
    zarr.create_group(store, zarr_format=3, attributes={
        "dflash_part": {"format_version": 1, "name": name, "samples": len(sample_ids), "tokens": tokens}
    })
    schema = cache.schema
    # A part added in one piece (add_samples) is written from its buffer without a copy.
    arrays = {key: parts[0] if len(parts) == 1 else np.concatenate(parts) for key, parts in cols.items()}
    arrays[OFFSETS] = sample_offsets(lengths)
    arrays[SAMPLE_IDS] = np.asarray(sample_ids, dtype=np.int64)
    for spec in schema:
        data = arrays[spec.name]
        chunks, shards = schema.chunking(spec, data.shape[0])
        arr = zarr.create_array(
            store, name=spec.name, shape=data.shape, dtype=data.dtype, chunks=chunks, shards=shards,
            compressors=schema.compressors(spec, cache.codec), filters=None, fill_value=0,
            config={"write_empty_chunks": True},
        )
        if spec.storage == HIDDEN_CHUNKS and data.shape[0]:
            # The large arrays: shard files written here, byte for byte as zarr writes them for
            # this metadata (tests/test_cache_shards.py), without its per-chunk copies and task
            # overhead (docs/BENCHMARKS.md).
            write_shards(path / spec.name, data, schema.chunk_rows, schema.shard_rows, cache.codec)
        else:
            arr[...] = data


def write_shards(array_dir: Path, data: np.ndarray, chunk_rows: int, shard_rows: int,
                 codec: HiddenCodec) -> None:
    """The shard files of a 2-D zarr v3 array sharded along rows (`shard_rows` rows of
    `chunk_rows`-row chunks, inner codecs = `codec`, laid out by shard_format). Chunks are encoded on several threads (Blosc,
    the checksum and numpy release the GIL); the last chunk is padded with the fill value 0 to full size, as
    zarr does."""
    rows = data.shape[0]
    per_shard = shard_rows // chunk_rows
    def chunk(c: int) -> list[bytes]:
        block = data[c * chunk_rows:(c + 1) * chunk_rows]
        if block.shape[0] < chunk_rows:
            padded = np.zeros((chunk_rows, *data.shape[1:]), dtype=data.dtype)
            padded[:block.shape[0]] = block
            block = padded
        # the codec's Blosc stage (none for raw), then the crc32c suffix, as zarr's
        # BloscCodec + Crc32cCodec lay them out
        return frame_chunk(codec.compress(np.ascontiguousarray(block)))

    num_chunks = -(-rows // chunk_rows)
    num_shards = -(-rows // shard_rows)

    def write_shard(shard: int, encoded: list[list[bytes]]) -> None:
        index = encode_index([sum(len(p) for p in pieces) for pieces in encoded], per_shard)
        target = array_dir / shard_key(shard, data.ndim)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            for pieces in encoded:
                f.writelines(pieces)
            f.write(index)

    # Every chunk is queued for encoding on all cores at once (at the end of a run few parts
    # are left, and they are what the run waits for); each shard file is written by its own
    # thread as soon as its chunks are done, so files are written while later chunks encode.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as encoders, \
            ThreadPoolExecutor(max_workers=max(1, min(4, num_shards))) as files:
        chunks = [encoders.submit(chunk, c) for c in range(num_chunks)]

        def shard_file(shard: int) -> None:
            write_shard(shard, [f.result() for f in chunks[shard * per_shard:(shard + 1) * per_shard]])

        for done in [files.submit(shard_file, s) for s in range(num_shards)]:
            done.result()
