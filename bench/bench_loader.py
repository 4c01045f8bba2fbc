"""How fast one loader worker reads long samples, by the threads it decodes on (docs/train.md,
"Long samples"): bench_train's synthetic cache of a shape (the bf16 states of the captured layers and
the top-8 soft labels of each sample), read sample by sample through the trainer's `read_batch` into
fresh batches, as a worker does, at each of --threads decode threads (`set_decode_threads`). It
prints the ms a sample, the GB/s of bf16 states decoded and the context tokens a second one worker
feeds the GPU (compare the step's context tokens/s, docs/BENCHMARKS.md); --codecs fp8 adds the same
cache recompressed to fp8 (its states are decoded on the GPU).

    python bench/bench_loader.py --shape 8b-8k --samples 4 --threads 1,2   # the 2-core host
    python bench/bench_loader.py --shape 8b-32k --samples 4 --threads 1,2,4 --codecs bf16,fp8
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def read_rate(cache: Path, seq_len: int, samples: int, repeats: int) -> float:
    """Median seconds a sample over `repeats` passes (the first pass warms the page cache)."""
    from dflash.cache_tools.cache_set import CacheSet
    from dflash.train.data.loader import read_batch

    caches = CacheSet([str(cache)], max_seq_len=seq_len)
    read_batch(caches, [0])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for j in range(samples):
            read_batch(caches, [j])
        times.append((time.perf_counter() - start) / samples)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    import bench_train
    from dflash.cache_tools import part_files

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(bench_train.SHAPES), default="8b-8k")
    ap.add_argument("--samples", type=int, default=4, help="samples in the cache, each read once a pass")
    ap.add_argument("--threads", default="1,2", help="decode threads to measure, comma-separated")
    ap.add_argument("--codecs", default="bf16", help="bf16 and/or fp8 (fp8: recompressed from the bf16 cache)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the samples")
    ap.add_argument("--workdir", default=None, help="where the cache is written (default: a temporary directory)")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args(argv)
    shape = bench_train.SHAPES[a.shape]
    work = Path(a.workdir or tempfile.mkdtemp(prefix="dflash-bench-loader-"))
    shutil.rmtree(work / "bf16", ignore_errors=True)
    bench_train.write_cache(work / "bf16", shape, a.samples, a.samples, 1, bench_train.PROMPT[a.shape])
    rows = []
    try:
        for codec in a.codecs.split(","):
            cache = work / codec
            if codec != "bf16":
                shutil.rmtree(cache, ignore_errors=True)
                subprocess.run(["dflash-cache", "recompress", str(work / "bf16"), str(cache), "--codec", codec],
                               check=True, capture_output=True)
            for threads in (int(t) for t in a.threads.split(",")):
                part_files.set_decode_threads(threads)
                seconds = read_rate(cache, shape.seq_len, a.samples, a.repeats)
                states = shape.seq_len * len(bench_train.LAYER_IDS[shape.target_layers]) * shape.hidden * 2
                rows.append(dict(shape=a.shape, codec=codec, threads=threads, ms_per_sample=seconds * 1e3,
                                 decoded_gb_per_s=states / seconds / 1e9,
                                 context_tokens_per_s=shape.seq_len / seconds))
    finally:
        part_files.set_decode_threads(1)
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"one worker reading {a.shape} samples ({shape.seq_len:,} tokens, bf16 states of "
          f"{len(bench_train.LAYER_IDS[shape.target_layers])} x {shape.hidden}):")
    print("codec  threads  ms/sample  GB/s of bf16 states  context tok/s")
    for r in rows:
        print(f"{r['codec']:5} {r['threads']:8} {r['ms_per_sample']:10.0f} {r['decoded_gb_per_s']:20.2f} "
              f"{r['context_tokens_per_s']:14,.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
