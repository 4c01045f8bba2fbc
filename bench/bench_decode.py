"""Where the bf16 reader's decode time goes, on one core.

Writes a bf16 cache (the same activations and sample lengths as bench_cache.py's synthetic
kind, by default) and times, over the same stored chunks:
  reader        CacheReader.read_sample of every sample into one reused buffer (what the
                trainer's loader does): crc32c check, Blosc, boundary chunks decoded block-wise
  blosc->dest   numcodecs Blosc decompress of every whole chunk, in order, into the same large
                destination buffer (no checksum, no boundary chunks): the codec's own ceiling
  blosc->hot    the same into one chunk-sized buffer that stays in the CPU cache
  crc32c        the checksum of every stored chunk
All GB/s are of decoded bf16 bytes, one thread. `--kinds synthetic,model` repeats it on the
activations of a small Qwen3 trained briefly by bench_cache.py (on the GPU where there is one).

    python bench/bench_decode.py --workdir /dev/shm --kinds synthetic,model
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numcodecs.blosc
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cache  # noqa: E402
from dflash.cache_tools.checksum import crc32c  # noqa: E402
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


def measure(acts: torch.Tensor, k: int, d: int, args: argparse.Namespace, work: Path, label: str) -> None:
    """Write acts ([tokens, K*D] bf16) as a bf16 cache and time the four paths, interleaved."""
    chunk_rows = 128
    tokens = acts.shape[0]
    lengths = bench_cache.sample_lengths(tokens, 1024, 64, 4096, np.random.default_rng(0))
    codec = HiddenCodec(name="bf16")
    path = work / label
    bench_cache.write_cache(path, bench_cache.to_storage(acts, codec, k), lengths, list(range(1, k + 1)), d,
                            codec, chunk_rows, 8192, 16384)
    reader = CacheReader(path)
    for p in range(len(reader.parts)):
        reader.read_tokens(p, 0, 1)
    chunks = stored_chunks(reader)
    chunk_bytes = chunk_rows * k * d * 2
    total = tokens * k * d * 2
    whole = len(chunks) * chunk_bytes  # the last chunk may be partial: count what Blosc decodes
    stored = sum(len(c) for c in chunks)
    dest = np.zeros(whole, dtype=np.uint8)
    hot = np.zeros(chunk_bytes, dtype=np.uint8)
    order = list(range(len(lengths)))

    def blosc_dest():
        for i, c in enumerate(chunks):
            numcodecs.blosc.decompress(c[:-4], dest[i * chunk_bytes: (i + 1) * chunk_bytes])

    def blosc_hot():
        for c in chunks:
            numcodecs.blosc.decompress(c[:-4], hot)

    def crc_all():
        for c in chunks:
            crc32c(c[:-4])

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    # One pass of each path per round, the paths in turn: a slow spell of a shared host
    # then lands on all of them alike. Reported: the median and the best round.
    names = ["reader (read_sample into a reused buffer)", "blosc->dest (whole chunks, no crc)",
             "blosc->hot (one cached buffer)"]
    gbs: dict[str, list[float]] = {n: [] for n in names}
    crc_s: list[float] = []
    reader_s: list[float] = []
    load = bench_cache.HostLoad()
    for _ in range(args.repeats):
        r = bench_cache.read_reader(reader, order, reuse=True)
        gbs[names[0]].append(r)
        reader_s.append(total / (r * 1e9))
        gbs[names[1]].append(whole / timed(blosc_dest) / 1e9)
        gbs[names[2]].append(whole / timed(blosc_hot) / 1e9)
        crc_s.append(timed(crc_all))
    print(f"\n{label}: {len(chunks)} chunks of {chunk_bytes / 1e6:.2f} MB, {len(lengths)} samples, ratio "
          f"{total / stored:.3f}x; {args.repeats} rounds")
    print(load.summary())
    print(f"{'what':45s} {'GB/s decoded per core: median':>30s} {'best':>6s}")
    for name in names:
        v = sorted(gbs[name])
        print(f"{name:45s} {statistics.median(v):30.2f} {v[-1]:6.2f}")
    t_crc = statistics.median(crc_s)
    print(f"{'crc32c of every stored chunk':45s} {stored / t_crc / 1e9:25.2f} GB/s of stored bytes "
          f"({t_crc / statistics.median(reader_s):.0%} of the reader's time)")
    chunks.clear()  # views into the reader's maps
    reader.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/dev/shm")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5, help="rounds; each times every path once")
    ap.add_argument("--kinds", default="synthetic", help="comma list of synthetic, model (as in bench_cache.py)")
    ap.add_argument("--model-hidden", type=int, default=1024, help="hidden size of the trained model (model kind)")
    ap.add_argument("--train-steps", type=int, default=150, help="training steps of the model (model kind)")
    args = ap.parse_args()
    numcodecs.blosc.use_threads = False
    k = 5
    print("\n".join(bench_cache.environment()) + "; one thread")
    work = Path(tempfile.mkdtemp(prefix="dflash-decode-", dir=args.workdir))
    try:
        for kind in [x for x in args.kinds.split(",") if x]:
            if kind == "synthetic":
                torch.set_num_threads(1)
                measure(bench_cache.synthetic_activations(args.tokens, k, 4096, 0), k, 4096, args, work, kind)
            elif kind == "model":
                torch.set_num_threads(os.cpu_count() or 1)  # training is not timed
                acts, _, desc = bench_cache.model_activations(args.tokens, k, args.model_hidden, args.train_steps,
                                                              16, 256, 0)
                torch.set_num_threads(1)
                print(f"model: {desc}")
                measure(acts, acts.shape[1] // args.model_hidden, args.model_hidden, args, work, kind)
            else:
                raise SystemExit(f"unknown kind {kind!r}: use synthetic or model")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
