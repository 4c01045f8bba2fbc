"""The raw reader against a plain np.memmap, and what its checksum costs.

A raw chunk is copied as it is, so the reader's only work beyond the memmap's copy is the
crc32c of every chunk it touches. The reader checks and copies a chunk in pieces of
`reader._RAW_PIECE` bytes (256 KiB), so that each piece is copied while the checksum has just
brought it into the CPU cache. This bench writes a raw cache of synthetic activations (K=5,
widths --widths, 128-row chunks, the sample lengths of bench_cache.py) and reads every sample
in a random order, in turn for --rounds rounds:
  pieces        CacheReader.read_sample, as shipped
  whole chunk   the same with the piece as large as the chunk: check all, then copy
  memmap        the same rows from a flat uint16 np.memmap into a torch tensor
All one thread, data in the page cache, fresh tensors per sample on every side (as
bench_cache.py's random reads). Printed: medians (GB/s) and the median of the rounds' ratios.

    python bench/bench_raw.py --workdir /dev/shm
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cache  # noqa: E402
from dflash.cache_tools import reader as reader_module  # noqa: E402
from dflash.cache_tools.codecs import HiddenCodec  # noqa: E402


def run_width(d: int, args: argparse.Namespace, work: Path) -> None:
    acts = bench_cache.synthetic_activations(args.tokens, 5, d, 0)
    rng = np.random.default_rng(0)
    lengths = bench_cache.sample_lengths(acts.shape[0], 1024, 64, 4096, rng)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    order = rng.permutation(len(lengths)).tolist()
    codec = HiddenCodec(name="raw")
    path = work / f"raw-{d}"
    bench_cache.write_cache(path, bench_cache.to_storage(acts, codec, 5), lengths, [1, 2, 3, 4, 5], d, codec,
                            128, 8192, 16384)
    flat = work / f"raw-{d}.u16"
    acts.view(torch.int16).numpy().tofile(flat)
    mm = np.memmap(flat, dtype=np.uint16, mode="r", shape=tuple(acts.shape))
    reader = reader_module.CacheReader(path)
    shipped = reader_module._RAW_PIECE
    chunk_bytes = 128 * 5 * d * 2
    for _ in range(2):  # maps opened, pages in the page cache and mapped
        bench_cache.read_reader(reader, order)
    res: dict[str, list[float]] = {"pieces": [], "whole chunk": [], "memmap": []}
    try:
        for rnd in range(args.rounds):
            for key in (("pieces", "whole chunk", "memmap") if rnd % 2 else ("memmap", "whole chunk", "pieces")):
                if key == "memmap":
                    res[key].append(bench_cache.read_memmap(mm, offsets, order))
                    continue
                reader_module._RAW_PIECE = shipped if key == "pieces" else chunk_bytes
                res[key].append(bench_cache.read_reader(reader, order))
    finally:
        reader_module._RAW_PIECE = shipped
        reader.close()
    ratio = {k: statistics.median(a / b for a, b in zip(res[k], res["memmap"])) for k in ("pieces", "whole chunk")}
    print(f"{d:8d} {chunk_bytes / 2**20:10.2f} {statistics.median(res['pieces']):8.2f} "
          f"{statistics.median(res['whole chunk']):12.2f} {statistics.median(res['memmap']):8.2f} "
          f"{ratio['pieces']:16.3f} {ratio['whole chunk']:16.3f}", flush=True)
    del mm
    shutil.rmtree(path)
    flat.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="where to write the caches (default: the system temp dir)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--widths", default="1024,4096", help="comma list of layer widths D")
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("\n".join(bench_cache.environment()) + "; one thread")
    print(f"\n{'width D':>8s} {'chunk MiB':>10s} {'pieces':>8s} {'whole chunk':>12s} {'memmap':>8s} "
          f"{'pieces/memmap':>16s} {'whole/memmap':>16s}   (GB/s, medians)")
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-raw-", dir=args.workdir))
    try:
        for d in [int(x) for x in args.widths.split(",") if x]:
            run_width(d, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
