"""Where the bf16 reader's decode time goes, on one core.

Writes a synthetic bf16 cache (the same activations and sample lengths as bench_cache.py's
synthetic kind) and times, over the same stored chunks:
  reader        CacheReader.read_sample of every sample into one reused buffer (what the
                trainer's loader does): crc32c check, Blosc, boundary chunks decoded block-wise
  blosc->dest   numcodecs Blosc decompress of every whole chunk, in order, into the same large
                destination buffer (no checksum, no boundary chunks): the codec's own ceiling
  blosc->hot    the same into one chunk-sized buffer that stays in the CPU cache
  crc32c        the checksum of every stored chunk
All GB/s are of decoded bf16 bytes, one thread.

    python bench/bench_decode.py --workdir /dev/shm
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import crc32c
import numcodecs.blosc
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cache  # noqa: E402
from dflash.cache_tools.codecs import HiddenCodec  # noqa: E402
from dflash.cache_tools.reader import CacheReader  # noqa: E402


def stored_chunks(reader: CacheReader) -> list[memoryview]:
    """Every stored chunk of the 'hidden' array (crc32c suffix included), in row order."""
    chunks = []
    for p in range(len(reader.parts)):
        pf = reader.part_arrays(p)
        meta = pf.array_meta("hidden")
        rows = meta.shape[0]
        for c in range(-(-rows // meta.chunk_rows)):
            shard, inner = divmod(c * meta.chunk_rows, meta.shard_rows)
            m, idx = pf.shard_index("hidden", shard, meta)
            off, nb = idx[inner // meta.chunk_rows]
            chunks.append(memoryview(m)[int(off): int(off + nb)])
    return chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/dev/shm")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many passes")
    args = ap.parse_args()
    torch.set_num_threads(1)
    numcodecs.blosc.use_threads = False
    k, d, chunk_rows = 5, 4096, 128
    rng = np.random.default_rng(0)
    acts = bench_cache.synthetic_activations(args.tokens, k, d, 0)
    lengths = bench_cache.sample_lengths(args.tokens, 1024, 64, 4096, rng)
    work = Path(tempfile.mkdtemp(prefix="dflash-decode-", dir=args.workdir))
    try:
        codec = HiddenCodec(name="bf16")
        path = work / "cache"
        bench_cache.write_cache(path, bench_cache.to_storage(acts, codec, k), lengths, [1, 2, 3, 4, 5], d,
                                codec, chunk_rows, 8192, 16384)
        reader = CacheReader(path)
        for p in range(len(reader.parts)):
            reader.read_tokens(p, 0, 1)
        chunks = stored_chunks(reader)
        chunk_bytes = chunk_rows * k * d * 2
        total = args.tokens * k * d * 2
        dest = np.zeros(total + chunk_bytes, dtype=np.uint8)
        hot = np.zeros(chunk_bytes, dtype=np.uint8)
        order = list(range(len(lengths)))

        def best(fn) -> float:
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times)

        def blosc_dest():
            for i, c in enumerate(chunks):
                numcodecs.blosc.decompress(c[:-4], dest[i * chunk_bytes: (i + 1) * chunk_bytes])

        def blosc_hot():
            for c in chunks:
                numcodecs.blosc.decompress(c[:-4], hot)

        def crc_all():
            for c in chunks:
                crc32c.crc32c(c[:-4])

        t_reader = min(total / (bench_cache.read_reader(reader, order, reuse=True) * 1e9)
                       for _ in range(args.repeats))
        whole = len(chunks) * chunk_bytes  # the last chunk may be partial: count what Blosc decodes
        rows = [("reader (read_sample into a reused buffer)", total / t_reader / 1e9),
                ("blosc->dest (whole chunks, no crc)", whole / best(blosc_dest) / 1e9),
                ("blosc->hot (one cached buffer)", whole / best(blosc_hot) / 1e9)]
        t_crc = best(crc_all)
        stored = sum(len(c) for c in chunks)
        print(f"{len(chunks)} chunks of {chunk_bytes / 1e6:.2f} MB, {len(lengths)} samples, ratio "
              f"{total / stored:.2f}x; numcodecs {numcodecs.__version__}")
        print(f"{'what':45s} {'GB/s decoded per core':>22s}")
        for name, gbs in rows:
            print(f"{name:45s} {gbs:22.2f}")
        print(f"{'crc32c of every stored chunk':45s} {stored / t_crc / 1e9:17.2f} GB/s of stored bytes "
              f"({t_crc / t_reader:.0%} of the reader's time)")
        chunks.clear()  # views into the reader's maps
        reader.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
