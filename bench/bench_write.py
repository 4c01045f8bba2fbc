"""Cache writer throughput: the direct shard writer against zarr's own array write, side by side.

Writes the same synthetic parts (bench_cache.py's synthetic activations, K=5, D=4096) through
CacheWriter with the hidden states' shard files written by `writer.write_shards` (what the
cache uses) and, alternately, by zarr (`array[...] = data`), and prints GB/s of raw bf16 per
process, best of --repeats each (all cores of the machine available to both).

    python bench/bench_write.py --workdir /dev/shm
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import zarr

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cache  # noqa: E402
from dflash.cache_tools import writer as writer_mod  # noqa: E402
from dflash.cache_tools.codecs import HiddenCodec  # noqa: E402


def zarr_shards(array_dir: Path, data, chunk_rows, shard_rows, codec) -> None:
    arr = zarr.open_array(zarr.storage.LocalStore(array_dir.parent), path=array_dir.name, mode="r+")
    arr[...] = data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/dev/shm")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--codecs", default="bf16,fp8")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    acts = bench_cache.synthetic_activations(args.tokens, 5, 4096, 0)
    lengths = [1024] * (args.tokens // 1024)
    direct = writer_mod.write_shards
    work = Path(tempfile.mkdtemp(prefix="dflash-write-", dir=args.workdir))
    try:
        for name in args.codecs.split(","):
            codec = HiddenCodec(name=name)
            stored = bench_cache.to_storage(acts, codec, 5)
            best = {"direct": 0.0, "zarr": 0.0}
            for _ in range(args.repeats):
                for method, fn in (("direct", direct), ("zarr", zarr_shards)):
                    writer_mod.write_shards = fn
                    path = work / f"{name}-{method}"
                    shutil.rmtree(path, ignore_errors=True)
                    t = time.perf_counter()
                    bench_cache.write_cache(path, stored, lengths, [1, 2, 3, 4, 5], 4096, codec, 128, 8192,
                                            args.tokens)
                    best[method] = max(best[method], acts.numel() * 2 / (time.perf_counter() - t) / 1e9)
                    shutil.rmtree(path, ignore_errors=True)
            writer_mod.write_shards = direct
            print(f"{name}: direct shard writer {best['direct']:.2f} GB/s, zarr {best['zarr']:.2f} GB/s "
                  f"({best['direct'] / best['zarr']:.2f}x)", flush=True)
    finally:
        writer_mod.write_shards = direct
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
