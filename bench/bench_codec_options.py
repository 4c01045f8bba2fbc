"""What the bf16 codec setting costs on one core, against the Blosc settings around it.

The cache format fixes the lossless codec (Blosc zstd level 1, byte shuffle, 1 MiB blocks);
the cache writer packs it as zstd frames of literals only (no matches; cache_tools/codecs.py),
first row, or where that is not available with zstd's match finder limited (64-entry hash
table, 7-byte matches), second row, against c-blosc's own encoder, third row.
This bench shows where its decode speed comes from and what other Blosc settings would give,
on the same activations as bench_cache.py (synthetic: K=5, D=4096, outlier channels; with
`--kinds synthetic,model` also those of a small Qwen3 it trains briefly), one thread:
  ratio         raw bytes / stored bytes
  encode        GB/s of raw bf16 per core
  decode        GB/s of decoded bf16 per core, into one chunk-sized buffer (best of --repeats)
and, for the format's setting, the two streams of a byte-shuffled block decoded apart (zstd
level 1 on the high bytes, sign and exponent, and on the low bytes, mantissa) to show which
one bounds the decoder. Last, for layer widths of common targets (`--widths`), the literal
packing with zstd blocks cut where the high-byte stream begins (the writer's) against zstd's
own cut every 128 KiB, which differ where a chunk's last Blosc block is not a multiple of
256 KiB.

    python bench/bench_codec_options.py --kinds synthetic,model
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numcodecs.blosc
import numpy as np
import torch
from numcodecs import Blosc, Zstd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cache  # noqa: E402
from dflash.cache_tools.codecs import HiddenCodec  # noqa: E402

SETTINGS = [  # (cname, clevel, shuffle, blocksize, streams split); "literals"/"limits": the format's writer
    ("zstd", 1, Blosc.SHUFFLE, 1 << 20, "literals"),  # the format's bf16 codec, as the cache writes it
    ("zstd", 1, Blosc.SHUFFLE, 1 << 20, "limits"),  # the same where literal-only frames are not available
    ("zstd", 1, Blosc.SHUFFLE, 1 << 20, False),  # same Blosc setting, c-blosc's encoder (zstd's own parameters)
    ("zstd", 1, Blosc.SHUFFLE, 1 << 20, True),  # same, each byte stream compressed apart
    ("zstd", 1, Blosc.SHUFFLE, 1 << 18, False),
    ("zstd", 1, Blosc.BITSHUFFLE, 1 << 20, False),
    ("lz4", 1, Blosc.SHUFFLE, 1 << 20, False),
    ("lz4", 1, Blosc.BITSHUFFLE, 1 << 20, False),
    ("lz4hc", 5, Blosc.BITSHUFFLE, 1 << 20, False),
    ("blosclz", 1, Blosc.BITSHUFFLE, 1 << 20, False),
]


def best_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def encode_split(codec: Blosc, chunks: list[np.ndarray]) -> list[bytes]:
    """Encode with Blosc's streams split (typesize streams compressed apart in each block).

    c-blosc reads BLOSC_SPLITMODE only on its global-context path (use_threads) and keeps the
    mode afterwards, so it is set back to c-blosc's default before returning.
    """
    numcodecs.blosc.use_threads = True
    os.environ["BLOSC_SPLITMODE"] = "ALWAYS"
    try:
        encoded = [codec.encode(c) for c in chunks]
    finally:
        os.environ["BLOSC_SPLITMODE"] = "FORWARD_COMPAT"
        codec.encode(chunks[0][:1])
        del os.environ["BLOSC_SPLITMODE"]
        numcodecs.blosc.use_threads = False
    assert not encoded[0][2] & 0x10, "Blosc did not split the streams"  # header flag: not split
    return encoded


def run_kind(label: str, data: np.ndarray, rows: int, args: argparse.Namespace) -> None:
    """data: [tokens, K*D] bf16 bit patterns as uint16; chunks of `rows` rows as in a cache."""
    nchunks = data.shape[0] // rows
    chunks = [np.ascontiguousarray(data[i * rows:(i + 1) * rows]) for i in range(nchunks)]
    raw = sum(c.nbytes for c in chunks)
    hot = np.empty(chunks[0].nbytes, dtype=np.uint8)
    print(f"\n{label}: {nchunks} chunks of {chunks[0].nbytes / 1e6:.2f} MB")
    print(f"{'Blosc setting':60s} {'ratio':>6s} {'encode GB/s':>12s} {'decode GB/s':>12s}")
    for cname, level, shuffle, blocksize, split in SETTINGS:
        codec = Blosc(cname=cname, clevel=level, shuffle=shuffle, blocksize=blocksize)
        t = time.perf_counter()
        if split in ("literals", "limits"):
            packer = HiddenCodec(name="bf16", zstd_literals_only=split == "literals")
            encoded = [packer.compress(c) for c in chunks]
        elif split:
            encoded = encode_split(codec, chunks)
        else:
            encoded = [codec.encode(c) for c in chunks]
        t_enc = time.perf_counter() - t

        def decode(encoded=encoded):
            for e in encoded:
                numcodecs.blosc.decompress(e, hot)

        t_dec = best_seconds(decode, args.repeats)
        name = (f"{cname}-{level} {'byte' if shuffle == Blosc.SHUFFLE else 'bit'} shuffle, "
                f"{blocksize >> 10} KiB blocks"
                + {"literals": ", literals only [format]", "limits": ", match limits [format, fallback]",
                   True: ", split", False: ""}[split])
        stored = sum(len(e) for e in encoded)
        print(f"{name:60s} {raw / stored:6.3f} {raw / t_enc / 1e9:12.2f} {raw / t_dec / 1e9:12.2f}", flush=True)

    # The format's setting, its two byte streams apart: each 1 MiB block byte-shuffled, i.e.
    # 512 KiB of low bytes then 512 KiB of high bytes, each compressed by zstd level 1.
    zstd = Zstd(level=1)
    block_values = (1 << 20) // 2
    flat = np.concatenate([c.reshape(-1) for c in chunks])
    lows, highs = [], []
    for s in range(0, flat.size - block_values + 1, block_values):
        pairs = flat[s:s + block_values].view(np.uint8).reshape(-1, 2)
        lows.append(zstd.encode(np.ascontiguousarray(pairs[:, 0])))
        highs.append(zstd.encode(np.ascontiguousarray(pairs[:, 1])))
    out = np.empty(block_values, dtype=np.uint8)
    for name, streams in (("high bytes (sign, exponent)", highs), ("low bytes (exponent bit, mantissa)", lows)):
        t = best_seconds(lambda streams=streams: [zstd.decode(b, out) for b in streams], args.repeats)
        size = len(streams) * block_values
        print(f"zstd-1 on the {name:35s}: ratio {size / sum(len(b) for b in streams):5.2f}, "
              f"decode {size / t / 1e9:5.2f} GB/s of its output")


def run_widths(widths: list[int], args: argparse.Namespace) -> None:
    """The literal packing on chunks of 128 rows of K=5 layers of width D (synthetic
    activations), with its zstd blocks cut at the byte streams' boundary (the format's
    writer) and as zstd alone cuts them, every 128 KiB. They differ where a Blosc block's
    streams are not a multiple of 128 KiB long, e.g. a chunk's last block; both rows decode
    into one chunk-sized buffer, interleaved, best of --repeats."""
    from dflash.cache_tools import codecs

    literals = codecs._LiteralsEncoder.get()
    if literals is None:
        print("\nliteral-only frames are not available here: no width comparison")
        return
    print(f"\n{'width D (K=5)':>14s} {'chunk MiB':>10s} {'last block KiB':>15s} {'ratio cut / zstd':>18s} "
          f"{'decode GB/s cut / zstd':>24s}")
    codec = HiddenCodec(name="bf16")
    own_cut = type("ZstdCut", (), {"compress": lambda self, src, level, streams=1: literals.compress(src, level)})()
    for d in widths:
        torch.set_num_threads(1)
        data = bench_cache.synthetic_activations(128 * args.chunks, 5, d, 0).view(torch.int16).numpy().view(np.uint16)
        chunks = [np.ascontiguousarray(data[i * 128:(i + 1) * 128]) for i in range(args.chunks)]
        raw = sum(c.nbytes for c in chunks)
        encoded = {"cut": [codec.compress(c) for c in chunks]}
        codecs._LiteralsEncoder._instance = own_cut
        try:
            encoded["zstd"] = [codec.compress(c) for c in chunks]
        finally:
            codecs._LiteralsEncoder._instance = literals
        hot = np.empty(chunks[0].nbytes, dtype=np.uint8)
        best = {k: float("inf") for k in encoded}
        for r in range(args.repeats):
            for key in (("cut", "zstd") if r % 2 == 0 else ("zstd", "cut")):  # in turn: noise hits both
                chunks_of = encoded[key]
                t = time.perf_counter()
                for e in chunks_of:
                    numcodecs.blosc.decompress(e, hot)
                best[key] = min(best[key], time.perf_counter() - t)
        ratio = {k: raw / sum(len(e) for e in v) for k, v in encoded.items()}
        last = chunks[0].nbytes % (1 << 20) or (1 << 20)
        print(f"{d:14d} {chunks[0].nbytes / 2**20:10.3f} {last >> 10:15d} "
              f"{ratio['cut']:8.3f} / {ratio['zstd']:.3f} {raw / best['cut'] / 1e9:13.2f} / {raw / best['zstd'] / 1e9:.2f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=24, help="128-row chunks of [128, 5 x 4096] bf16 (5.2 MB each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default="synthetic", help="comma list of synthetic, model (as in bench_cache.py)")
    ap.add_argument("--model-hidden", type=int, default=1024, help="hidden size of the trained model (model kind)")
    ap.add_argument("--train-steps", type=int, default=150, help="training steps of the model (model kind)")
    ap.add_argument("--widths", default="128,256,896,1536,2560,3584,4096",
                    help="comma list of layer widths D for the zstd block cut comparison ('' to skip)")
    args = ap.parse_args()
    numcodecs.blosc.use_threads = False
    print("\n".join(bench_cache.environment()) + "; one thread")
    rows, k, d = 128, 5, 4096
    for kind in [x for x in args.kinds.split(",") if x]:
        if kind == "synthetic":
            torch.set_num_threads(1)
            acts = bench_cache.synthetic_activations(rows * args.chunks, k, d, 0)
            run_kind("synthetic (K=5, D=4096, outlier channels)", acts.view(torch.int16).numpy().view(np.uint16),
                     rows, args)
        elif kind == "model":
            torch.set_num_threads(os.cpu_count() or 1)  # training is not timed
            # The same bytes per chunk as the synthetic kind: rows scaled to the model's width.
            mrows = rows * d // args.model_hidden
            acts, _, desc = bench_cache.model_activations(mrows * args.chunks, k, args.model_hidden,
                                                          args.train_steps, 16, 256, 0)
            torch.set_num_threads(1)
            run_kind(f"model ({desc})", acts.view(torch.int16).numpy().view(np.uint16), mrows, args)
        else:
            raise SystemExit(f"unknown kind {kind!r}: use synthetic or model")
    run_widths([int(x) for x in args.widths.split(",") if x], args)


if __name__ == "__main__":
    main()
