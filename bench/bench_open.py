"""Time to open a cache of N committed parts and read one sample (the trainer's startup path).

    python bench/bench_open.py --parts 10000 --workdir /tmp

Parts are symlinks to one real part plus their commit records (opening must not depend on
what the parts hold, only on the manifest); the figure printed is the median of --repeat runs
of CacheReader(cache) + read_sample(last sample), each in a fresh reader.
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

import numpy as np
import torch
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.manifest import LOG_FILE, PartRecord, encode_log_line, make_header
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.writer import CacheWriter


def build(cache: Path, parts: int) -> None:
    header = make_header(target={"path": "bench"}, target_layer_ids=[1, 2], hidden_size=64,
                         codec=HiddenCodec(name="bf16"), chunk_rows=16, shard_rows=64)
    writer = CacheWriter(cache, header)
    with writer.part_writer("part-000000") as pw:
        for s in range(2):
            pw.add_sample(s, np.zeros(3, np.int32), np.ones(3, np.uint8), torch.zeros(3, 128))
    template = cache / "parts" / "part-000000"
    lines = []
    for p in range(1, parts):
        name = f"part-{p:06d}"
        os.symlink(template, cache / "parts" / name)
        lines.append(encode_log_line(PartRecord(name=name, samples=2, tokens=6, lengths=(3, 3), nbytes=1)))
    with open(cache / LOG_FILE, "ab") as f:
        f.write(b"".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dflash-open-", dir=args.workdir))
    try:
        build(work / "cache", args.parts)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            reader = CacheReader(work / "cache")
            reader.read_sample(len(reader) - 1)
            times.append(time.perf_counter() - t0)
        print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} cores")
        print(f"{args.parts} parts, {len(reader)} samples: open + read one sample "
              f"median {statistics.median(times) * 1e3:.1f} ms (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
