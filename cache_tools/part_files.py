"""One committed part's arrays on disk, read without zarr's per-call machinery (metadata
parsing, asyncio tasks and copies for every read of a few rows): each array's zarr.json and shard
index are parsed once per process, shard files are mapped with mmap, each chunk's crc32c is
checked, and whole chunks are decompressed straight into the output buffer. CacheReader
(reader.py) opens one PartFiles per part it reads.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numcodecs.blosc
import numpy as np
from dflash.runtime.findings import Finding
from numcodecs.zstd import Zstd

from .errors import CacheCorruptError
from .manifest import HEADER_FILE, LOG_FILE, PartRecord
from .schema import SAMPLE_IDS, PartSchema, shard_key
from .shard_format import EMPTY, decode_index, located, unframe_chunk

# Blosc's internal thread pool is not fork-safe: each call decodes on the calling thread (blosc
# releases the GIL while it does), and a reader that may use more cores decodes whole chunks on
# threads of its own (`set_decode_threads`).
numcodecs.blosc.use_threads = False

_ZSTD = Zstd()


class _DecodeThreads:
    """The threads this process decodes a read's whole chunks on, side by side: none while set to 1
    (the default), made in the process that uses them (threads do not survive a fork, so a pool
    made before one is made again after it)."""

    def __init__(self) -> None:
        self.count, self._pool, self._pid = 1, None, None

    def pool(self) -> ThreadPoolExecutor | None:
        if self.count < 2:
            return None
        if self._pool is None or self._pid != os.getpid():
            self._pool, self._pid = ThreadPoolExecutor(self.count, thread_name_prefix="dflash-decode"), os.getpid()
        return self._pool

    def set(self, count: int) -> None:
        if count != self.count:
            if self._pool is not None and self._pid == os.getpid():  # (a forked child's copy has no threads)
                self._pool.shutdown(wait=True)
            self.count, self._pool, self._pid = count, None, None


_DECODE = _DecodeThreads()


def set_decode_threads(count: int) -> None:
    """Decode the whole chunks of each read on `count` threads of this process (1: on the calling
    thread). A loader worker takes its share of the cores its process may use: one worker then reads
    a long sample's chunks about `count` times as fast."""
    _DECODE.set(max(1, int(count)))


@dataclass(frozen=True)
class ArrayMeta:
    """What the reader needs from one array's zarr.json."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_rows: int
    shard_rows: int | None  # None: unsharded, one file per chunk
    codecs: tuple[str, ...]  # bytes-to-bytes codecs after the serializer, in encode order
    index_checked: bool

    @functools.cached_property
    def row_bytes(self) -> int:  # cached: the hot path asks for it once per chunk
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    @classmethod
    def parse(cls, meta: dict[str, Any], where: object) -> ArrayMeta:
        try:
            shape = tuple(meta["shape"])
            dtype = np.dtype(meta["data_type"])
            outer = meta["chunk_grid"]["configuration"]["chunk_shape"]
            codecs = meta["codecs"]
            if codecs[0]["name"] == "sharding_indexed":
                conf = codecs[0]["configuration"]
                inner, shard_rows = conf["chunk_shape"], outer[0]
                chain = conf["codecs"]
                index_names = [c["name"] for c in conf["index_codecs"]]
                if conf.get("index_location", "end") != "end" or index_names[0] != "bytes":
                    raise ValueError("unsupported shard index layout")
                index_checked = "crc32c" in index_names
            else:
                inner, shard_rows, chain, index_checked = outer, None, codecs, False
            if list(inner[1:]) != list(shape[1:]):
                raise ValueError("chunks must span the full row width")
            if chain[0]["name"] != "bytes" or chain[0].get("configuration", {}).get("endian", "little") != "little":
                raise ValueError("only little-endian 'bytes' serialization is supported")
            names = tuple(c["name"] for c in chain[1:])
            if any(n not in ("blosc", "zstd", "crc32c") for n in names):
                raise ValueError(f"unsupported codecs {names}")
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise CacheCorruptError(Finding("cache.array-meta-unknown", **located(where), error=str(e))) from e
        return cls(shape, dtype, int(inner[0]), shard_rows, names, index_checked)


class ScratchBuffer:
    """One reusable decode buffer per reader process, grown on demand."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        if self.buf.nbytes < nbytes:
            self.buf = np.empty(nbytes, dtype=np.uint8)
        return self.buf[:nbytes]


class _Where:
    """Where a chunk is, for error messages: formatted only when one is raised."""

    __slots__ = ("part", "array", "chunk")

    def __init__(self, part: PartFiles, array: str, chunk: int):
        self.part, self.array, self.chunk = part, array, chunk

    def fields(self) -> dict[str, Any]:
        return self.part.location(self.array, chunk=self.chunk)


class PartFiles:
    """One part's arrays, opened lazily in one process: metadata, shard maps and indexes."""

    def __init__(self, part_dir: Path, record: PartRecord, verify: bool, scratch: ScratchBuffer,
                 stage: Any = None, schema: PartSchema | None = None):
        self.dir = part_dir
        self.stage = stage  # a remote cache's staging (remote.StagedCache): fetches data files on demand
        self.record = record
        self.verify = verify
        self.schema = schema  # given: each array's metadata is checked against it when first parsed
        self.meta: dict[str, ArrayMeta] = {}
        self.maps: dict[str, mmap.mmap | None] = {}
        self.indexes: dict[str, np.ndarray] = {}
        self.small: dict[str, np.ndarray] = {}
        self.scratch = scratch

    def close(self) -> None:
        for m in self.maps.values():
            if m is not None:
                m.close()
        self.maps.clear()

    def location(self, array: str, *, chunk: int | None = None, shard_file: str | None = None) -> dict[str, Any]:
        """Where an array (a chunk of it, a shard file's index) of this part is, as a finding's fields."""
        return dict(part=self.record.name, array=array, dir=str(self.dir), chunk=chunk, shard_file=shard_file)

    def array_meta(self, array: str) -> ArrayMeta:
        meta = self.meta.get(array)
        if meta is None:
            path = self.dir / array / "zarr.json"
            try:
                raw = json.loads(path.read_bytes())
            except FileNotFoundError:
                raise CacheCorruptError(Finding("cache.part-file-missing", **self.location(array),
                                                file=path.name)) from None
            except json.JSONDecodeError as e:
                raise CacheCorruptError(Finding("cache.array-meta-not-json", **self.location(array),
                                                error=str(e))) from e
            meta = ArrayMeta.parse(raw, self.location(array))
            if self.schema is not None and array in self.schema:
                self._check_meta(array, meta)
            self.meta[array] = meta
        return meta

    def _check_meta(self, array: str, meta: ArrayMeta) -> None:
        """An array's metadata against the manifest (its shape and dtype), as verify checks it,
        when the array is first read: a part written with other settings (a --force run of other
        settings beside this one, an edited manifest) is named here instead of failing a copy
        later. Checked per array as it is read, so that opening a cache of many parts, or reading
        only their sample ids, parses no other array's metadata."""
        spec, rec = self.schema[array], self.record
        want = (spec.rows(rec.tokens, rec.samples), *spec.row_shape)
        if tuple(meta.shape) != want or meta.dtype != spec.dtype:
            raise CacheCorruptError(Finding(
                "cache.array-meta-mismatch", **self.location(array), shape=list(meta.shape), dtype=str(meta.dtype),
                expected_shape=list(want), expected_dtype=str(spec.dtype), manifest=HEADER_FILE))

    def _map(self, array: str, key: str) -> mmap.mmap:
        """The mmap of one chunk or shard file, e.g. key 'c/0/0'."""
        name = f"{array}/{key}"
        m = self.maps.get(name)
        if m is None:
            if self.stage is not None:
                self.stage.ensure(self.record.name, array)
            path = self.dir / array / key
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size == 0:
                        raise CacheCorruptError(Finding("cache.part-file-empty", **self.location(array), file=key))
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError:
                raise CacheCorruptError(Finding("cache.part-file-missing", **self.location(array), file=key)) from None
            self.maps[name] = m
        return m

    def _decode(self, buf: memoryview, meta: ArrayMeta, nbytes: int, what: str | _Where, out=None):
        """Decode one stored chunk; returns a buffer of `nbytes` (possibly `out` itself)."""
        names = list(meta.codecs)
        if names and names[-1] == "crc32c":
            buf = unframe_chunk(buf, what, self.verify)
            names.pop()
        try:
            for name in reversed(names):
                if name == "blosc":
                    buf = numcodecs.blosc.decompress(buf, out) if out is not None else numcodecs.blosc.decompress(buf)
                    out = None
                elif name == "zstd":
                    buf = _ZSTD.decode(buf)
        except (RuntimeError, ValueError) as e:
            raise CacheCorruptError(Finding("cache.chunk-decompress", **located(what), error=str(e))) from e
        if len(memoryview(buf).cast("B")) != nbytes:
            raise CacheCorruptError(Finding("cache.chunk-size", **located(what), size=len(memoryview(buf).cast("B")),
                                            expected=nbytes))
        return buf

    def shard_index(self, array: str, shard: int, meta: ArrayMeta) -> tuple[mmap.mmap, np.ndarray]:
        key = shard_key(shard, len(meta.shape))
        m = self._map(array, key)
        idx = self.indexes.get(f"{array}/{key}")
        if idx is None:
            what = self.location(array, shard_file=key)
            idx = decode_index(memoryview(m), meta.shard_rows // meta.chunk_rows, meta.index_checked,
                               self.verify, what)
            self.indexes[f"{array}/{key}"] = idx
        return m, idx

    def read_rows(self, array: str, start: int, stop: int, out: np.ndarray) -> None:
        """Decode rows [start, stop) of a chunked array into `out` (shape [stop-start, ...],
        C-contiguous: the chunks are decoded into views of it)."""
        if not out.flags.c_contiguous:
            raise ValueError("read_rows needs a C-contiguous output array")
        meta = self.array_meta(array)
        cr, rb = meta.chunk_rows, meta.row_bytes
        chunk_bytes = cr * rb
        out_bytes = out.reshape(out.shape[0], -1).view(np.uint8)
        pool = _DECODE.pool()
        whole = []  # (chunk buffer, where, out rows) of the chunks decoded straight into `out`
        for c in range(start // cr, (stop - 1) // cr + 1):
            lo, hi = max(start, c * cr), min(stop, (c + 1) * cr)
            what = _Where(self, array, c)  # formatted only into an error message
            if meta.shard_rows is None:
                m = self._map(array, shard_key(c, len(meta.shape)))
                buf = memoryview(m)
            else:
                shard, inner = divmod(c * cr, meta.shard_rows)
                m, idx = self.shard_index(array, shard, meta)
                off, nb = idx[inner // cr]
                if off == EMPTY:
                    out_bytes[lo - start: hi - start] = 0
                    continue
                off, nb = int(off), int(nb)
                buf = memoryview(m)[off: off + nb]
            blosc = "blosc" in meta.codecs
            if blosc and lo == c * cr and hi == (c + 1) * cr:
                # Decompress straight into the output rows: no intermediate copy (on the decode
                # threads, once every chunk of the read is located, where this process has them).
                whole.append((buf, what, out_bytes[lo - start: hi - start]))
                continue
            # A chunk that straddles the request (decoded into a reused scratch buffer: a fresh
            # one per chunk would page-fault its whole size every time), or a raw chunk (its
            # checked bytes in the map): copy the rows asked for.
            dec = self._decode(buf, meta, chunk_bytes, what, out=self.scratch.get(chunk_bytes) if blosc else None)
            rows = np.frombuffer(dec, dtype=np.uint8, count=chunk_bytes).reshape(cr, rb)
            out_bytes[lo - start: hi - start] = rows[lo - c * cr: hi - c * cr]
        if pool is None or len(whole) < 2:
            for buf, what, rows in whole:
                self._decode(buf, meta, chunk_bytes, what, out=rows)
            return
        # every chunk is decoded (or failed) before the earliest chunk's error is raised: none is
        # still writing into `out` when the caller sees the error
        done = [pool.submit(self._decode, buf, meta, chunk_bytes, what, out=rows) for buf, what, rows in whole]
        wait(done)
        for future in done:
            future.result()

    def small_array(self, array: str) -> np.ndarray:
        """A per-part metadata array (ids, masks, scales), decoded whole once and kept."""
        arr = self.small.get(array)
        if arr is None:
            meta = self.array_meta(array)
            arr = np.empty(meta.shape, dtype=meta.dtype)
            if meta.shape[0]:
                self.read_rows(array, 0, meta.shape[0], arr)
            recorded = self.record.sample_ids
            if array == SAMPLE_IDS and self.schema is not None and recorded is not None and (
                    len(recorded) != len(arr) or not np.array_equal(arr, recorded)):
                raise CacheCorruptError(Finding("cache.part-sample-ids", **self.location(array), log=LOG_FILE))
            self.small[array] = arr
        return arr
