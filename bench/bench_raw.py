"""The raw reader against a plain np.memmap, and what its checksum costs.

A raw chunk is copied as it is, so the reader's only work beyond the memmap's copy is the
crc32c of every chunk it touches. The reader checks and copies a chunk in pieces of
`reader._RAW_PIECE` bytes (256 KiB), so that each piece is copied while the checksum has just
brought it into the CPU cache, and computes crc32c with crc32c-rs (`cache_tools.checksum`).
This bench writes a raw cache of synthetic activations (K=5, widths --widths, 128-row chunks,
the sample lengths of bench_cache.py) and reads every sample in a random order, in turn for
--rounds rounds:
  pieces        CacheReader.read_sample, as shipped
  crc32c pkg    the same with the crc32c package's checksum (SSE4.2 crc32 loop) instead
  whole chunk   the same as shipped with the piece as large as the chunk: check all, then copy
  memmap        the same rows from a flat uint16 np.memmap into a torch tensor
All one thread, data in the page cache, fresh tensors per sample on every side (as
bench_cache.py's random reads). Printed: medians (GB/s) and the medians of the rounds' ratios
to the memmap.

    python bench/bench_raw.py --workdir /dev/shm
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import crc32c
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cache  # noqa: E402
from dflash.cache_tools import checksum  # noqa: E402
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
    shipped, shipped_crc = reader_module._RAW_PIECE, reader_module.crc32c
    chunk_bytes = 128 * 5 * d * 2
    for _ in range(2):  # maps opened, pages in the page cache and mapped
        bench_cache.read_reader(reader, order)
    variants = {  # name: (piece bytes, checksum function)
        "pieces": (shipped, shipped_crc),
        "crc32c pkg": (shipped, crc32c.crc32c),
        "whole chunk": (chunk_bytes, shipped_crc),
    }
    res: dict[str, list[float]] = {k: [] for k in (*variants, "memmap")}
    keys = list(res)
    try:
        for rnd in range(args.rounds):
            for key in (keys if rnd % 2 else keys[::-1]):
                if key == "memmap":
                    res[key].append(bench_cache.read_memmap(mm, offsets, order))
                    continue
                reader_module._RAW_PIECE, reader_module.crc32c = variants[key]
                res[key].append(bench_cache.read_reader(reader, order))
    finally:
        reader_module._RAW_PIECE, reader_module.crc32c = shipped, shipped_crc
        reader.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(res[k], res["memmap"])) for k in variants}
    print(f"{d:8d} {chunk_bytes / 2**20:10.2f} " + " ".join(f"{med[k]:>12.2f}" for k in keys) + " "
          + " ".join(f"{ratio[k]:>12.3f}" for k in variants), flush=True)
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
    names = ("pieces", "crc32c pkg", "whole chunk", "memmap")
    print(f"checksum: {checksum.IMPLEMENTATION} (shipped) against crc32c {version('crc32c')}")
    print(f"\n{'width D':>8s} {'chunk MiB':>10s} " + " ".join(f"{k:>12s}" for k in names) + " "
          + " ".join(f"{k + '/mm':>12s}" for k in names[:3]) + "   (GB/s, medians; ratios to the memmap)")
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-raw-", dir=args.workdir))
    try:
        for d in [int(x) for x in args.widths.split(",") if x]:
            run_width(d, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
