"""The hidden-state codecs: bytes on disk of each Blosc setting, and whether it is fast enough.

Activations (--kinds):
  model      hidden states of a small Qwen3 (8 layers, byte vocabulary, random init) trained
             for --train-steps AdamW steps on text generated here (templated sentences,
             arithmetic, code-like lines), captured at K layers on held-out text
  synthetic  bf16 Gaussian x log-normal per-channel scales, 4 channels per layer 50-100x larger,
             per-token drift (the outlier structure of LLM activations)

For each setting (--levels x --blocksizes, zstd with byte shuffle for bf16; fp8 quantized once,
no shuffle) it prints, over --chunk-rows-row chunks:
  bytes/token    stored bytes of the hidden array per token: Blosc chunks, their crc32c and
                 shard index entries
  encode         GB/s of raw bf16 per core (one thread; fp8: of its e4m3 bytes)
  all cores      GB/s of raw bf16 through every core at once (the extraction writers' case)
  decode         GB/s of decoded bytes per core: crc32c check + Blosc into a reused buffer
  writers busy   the share of the host's cores an extraction of --extract-tokens-per-second
                 tokens of width --extract-width needs to encode at this speed (the 8B-shaped
                 target on one H200 by default)
--compare-with DIR adds the codecs of another version's cache_tools package (e.g. `git
archive <commit> cache_tools | tar -x -C /tmp/old` then `--compare-with /tmp/old/cache_tools`),
measured on the same chunks. Last, the shipped codecs end to end: a cache written by
CacheWriter (and again with zarr's array write in place of the writer's own shard files), its
bytes on disk per token, and CacheReader.read_sample per core (hot; fp8 as stored bytes and
scales, as the trainer's workers read it).

    python bench/bench_codecs.py                         # full size (a GPU trains the model quickly)
    python bench/bench_codecs.py --small                 # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import numcodecs.blosc
import numpy as np
import torch
import zarr
from dflash.cache_tools import part_layout
from dflash.cache_tools.checksum import crc32c
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.manifest import make_header
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.writer import CacheWriter
from dflash.extract.codecs import quantize_fp8, quantize_nf4_rows
from dflash.train.data.codecs import device_decoder


# -- activations --------------------------------------------------------------------------
def synthetic_activations(tokens: int, k: int, d: int, seed: int) -> torch.Tensor:
    """[tokens, K*D] bf16 with per-channel scales, outlier channels and per-token drift."""
    g = torch.Generator().manual_seed(seed)
    chan = torch.exp(0.5 * torch.randn(k, d, generator=g))
    for layer in range(k):
        chan[layer, torch.randperm(d, generator=g)[:4]] *= 50 + 50 * torch.rand(4, generator=g)
        chan[layer] *= 1.5 ** layer  # the residual stream grows with depth
    x = torch.randn(tokens, k, d, generator=g) * chan * torch.exp(0.3 * torch.randn(tokens, 1, 1, generator=g))
    return x.reshape(tokens, k * d).to(torch.bfloat16)


def make_text(chars: int, seed: int) -> str:
    """Byte-level training text with learnable structure: prose, arithmetic, code."""
    rnd = random.Random(seed)
    words = ("the model a cache layer token drafts verifies target block anchor reads writes fast small "
             "large every first next state hidden value stores returns and of to in for with on is was "
             "were has had will can not").split()
    zipf = [1 / (i + 1) for i in range(len(words))]
    parts, size = [], 0
    while size < chars:
        kind = rnd.random()
        if kind < 0.5:
            s = " ".join(rnd.choices(words, zipf, k=rnd.randint(5, 14))).capitalize() + ". "
        elif kind < 0.75:
            a, b = rnd.randint(0, 999), rnd.randint(0, 999)
            s = f"{a} + {b} = {a + b}. {a} * 3 = {a * 3}.\n"
        else:
            f, x, y = rnd.choice(words), rnd.choice("abcxyz"), rnd.choice("npqk")
            s = f"def {f}_{x}({x}, {y}):\n    return {x} * {y} + {rnd.randint(1, 9)}\n"
        parts.append(s)
        size += len(s)
    return "".join(parts)[:chars]


def model_activations(tokens: int, k: int, hidden: int, steps: int, seed: int) -> tuple[torch.Tensor, str]:
    """Hidden states of a small Qwen3 trained briefly on generated text: [tokens, K*hidden] bf16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    layers, batch, window = 8, 16, 256
    layer_ids = sorted({round(1 + i * (layers - 4) / max(k - 1, 1)) for i in range(k)})
    cfg = Qwen3Config(vocab_size=256, hidden_size=hidden, intermediate_size=64 * round(hidden * 8 / 3 / 64),
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).to(device)
    text = torch.tensor(list(make_text(2_000_000 + tokens * 2, seed).encode()), dtype=torch.long)
    train, held = text[:2_000_000], text[2_000_000:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    t0, loss = time.perf_counter(), float("nan")
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * min(1.0, (step + 1) / 20)
        starts = torch.randint(0, len(train) - window - 1, (batch,))
        x = torch.stack([train[s: s + window] for s in starts]).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.loss.detach())
    model.eval().to(torch.bfloat16)
    acts = torch.empty(tokens, len(layer_ids) * hidden, dtype=torch.bfloat16)
    with torch.no_grad():
        for s in range(0, tokens, 1024):
            ids = held[s: min(s + 1024, tokens)].unsqueeze(0).to(device)
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            acts[s: s + ids.shape[1]] = torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1).cpu()
    desc = (f"Qwen3 {layers} layers, hidden {hidden}, byte vocab; {steps} AdamW steps of {batch}x{window} "
            f"tokens on {device} ({time.perf_counter() - t0:.0f} s, final loss {loss:.2f}); layers {layer_ids}")
    return acts, desc


def stored_chunks(acts: torch.Tensor, k: int, rows: int, fp8: bool) -> list[np.ndarray]:
    """The activations in stored form (bf16 bits, or fp8 quantized on the GPU if there is one),
    cut into `rows`-row chunks, the last one padded with zeros as zarr pads it."""
    if fp8:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        data = np.concatenate([quantize_fp8(acts[s: s + 8192].to(device), k)[0].cpu().numpy()
                               for s in range(0, acts.shape[0], 8192)])
    else:
        data = acts.view(torch.int16).numpy().view(np.uint16)
    chunks = []
    for s in range(0, data.shape[0], rows):
        block = np.zeros((rows, data.shape[1]), dtype=data.dtype)
        block[: min(rows, data.shape[0] - s)] = data[s: s + rows]
        chunks.append(block)
    return chunks


# -- measurements -------------------------------------------------------------------------
def measure(compress, chunks: list[np.ndarray], tokens: int, args) -> dict[str, float]:
    """Bytes/token of `compress` over all chunks (on every core), and its per-core speeds."""
    raw = sum(c.nbytes for c in chunks)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        stored = list(pool.map(compress, chunks))
    parallel = raw / (time.perf_counter() - t0) / 1e9
    per_shard = max(1, args.shard_rows // args.chunk_rows)
    nbytes = sum(len(s) + 4 + 16 for s in stored) + 4 * -(-len(stored) // per_shard)  # crc, index, index crc
    timed = chunks[: max(1, args.timed_tokens // args.chunk_rows)]
    t0 = time.perf_counter()
    for c in timed:
        compress(c)
    encode = sum(c.nbytes for c in timed) / (time.perf_counter() - t0) / 1e9
    dest = np.empty(chunks[0].nbytes, dtype=np.uint8)
    t0 = time.perf_counter()
    for body in stored[: len(timed)]:
        crc32c(body)
        numcodecs.blosc.decompress(body, dest)
    decode = sum(c.nbytes for c in timed) / (time.perf_counter() - t0) / 1e9
    return {"bytes_per_token": nbytes / tokens, "ratio": raw / nbytes, "encode": encode,
            "parallel": parallel, "decode": decode}


def load_baseline(package_dir: str):
    """The codecs module of another version's cache_tools package directory."""
    init = Path(package_dir) / "__init__.py"
    spec = importlib.util.spec_from_file_location("baseline_cache_tools", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_cache_tools"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("baseline_cache_tools.codecs")


def write_cache(path: Path, hidden, scale, k: int, d: int, codec: HiddenCodec, args) -> float:
    """A cache of 1024-token samples through CacheWriter; GB/s of raw bf16."""
    header = make_header(target={"model": "bench", "vocab_size": 256}, target_layer_ids=list(range(1, k + 1)),
                         hidden_size=d, codec=codec, chunk_rows=args.chunk_rows, shard_rows=args.shard_rows)
    writer = CacheWriter(path, header)
    length, tokens = 1024, hidden.shape[0]
    t0 = time.perf_counter()
    for p, start in enumerate(range(0, tokens, args.part_tokens)):
        with writer.part_writer(f"part-{p:06d}") as pw:
            for s in range(start, min(start + args.part_tokens, tokens), length):
                pw.add_sample(s // length, np.zeros(length, dtype=np.int32), np.ones(length, dtype=np.uint8),
                              hidden[s: s + length], hidden_scale=None if scale is None else scale[s: s + length])
    return tokens * hidden.shape[1] * 2 / (time.perf_counter() - t0) / 1e9


def zarr_array_write(array_dir: Path, data, chunk_rows, shard_rows, codec) -> None:
    """What the writer's own shard files replace: zarr's array write of the same metadata."""
    zarr.open_array(zarr.storage.LocalStore(array_dir.parent), path=array_dir.name, mode="r+")[...] = data


def cache_end_to_end(acts: torch.Tensor, k: int, d: int, codec: HiddenCodec, work: Path, args) -> dict[str, float]:
    """Bytes on disk per token of a cache of the shipped codec, CacheWriter GB/s (and with
    zarr writing the hidden shards instead), and read_sample GB/s per core."""
    path = work / f"e2e-{codec.name}"
    tokens = acts.shape[0] - acts.shape[0] % 1024
    hidden, scale = acts[:tokens], None
    if codec.has_scale:  # quantized beforehand (on the GPU if there is one), as extraction does
        device = "cuda" if torch.cuda.is_available() else "cpu"
        q, sc = zip(*(quantize_fp8(acts[s: s + 8192].to(device), k) for s in range(0, tokens, 8192)))
        hidden, scale = torch.cat(q).cpu().numpy(), torch.cat(sc).cpu().numpy()
    own = part_layout.write_shards
    try:
        part_layout.write_shards = zarr_array_write
        by_zarr = write_cache(work / "by-zarr", hidden, scale, k, d, codec, args)
    finally:
        part_layout.write_shards = own
    shutil.rmtree(work / "by-zarr")
    write = write_cache(path, hidden, scale, k, d, codec, args)
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    reader = CacheReader(path)
    out = {"hidden": np.empty((1024, acts.shape[1]), dtype=np.uint16)}  # bf16 bits
    for i in range(len(reader)):  # untimed: opens the parts, pages the data in
        reader.read_sample(i, out=None if codec.has_scale else out, dequantize=not codec.has_scale)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    for i in range(len(reader)):
        reader.read_sample(i, out=None if codec.has_scale else out, dequantize=not codec.has_scale)
    read = tokens * acts.shape[1] * 2 / (time.perf_counter() - t0) / 1e9
    torch.set_num_threads(os.cpu_count() or 1)
    reader.close()
    shutil.rmtree(path)
    return {"bytes_per_token": nbytes / tokens, "ratio": tokens * acts.shape[1] * 2 / nbytes, "write": write,
            "by_zarr": by_zarr, "read": read}


def host_decode_speed(acts: torch.Tensor, k: int, name: str, rows: int = 1024, repeats: int = 5) -> tuple[float, float]:
    """GB/s of decoded bf16 per core of the codec's numpy decode (the reader's, in a loader
    worker) and of its torch decoder run on the CPU, over `rows`-row samples."""
    codec = HiddenCodec(name=name)
    encode = {"fp8": quantize_fp8, "nf4": quantize_nf4_rows}[name]
    samples = [encode(acts[s: s + rows], k) for s in range(0, acts.shape[0] - rows + 1, rows)]
    decode = device_decoder(codec)
    out = np.empty((rows, acts.shape[1]), dtype=np.uint16)
    stored = [(q.numpy(), None if sc is None else sc.numpy()) for q, sc in samples]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a DataLoader worker's torch runs on one thread
    try:
        def numpy_pass():
            for q, sc in stored:
                codec.decode(q, sc, out)

        def torch_pass():
            for q, sc in samples:
                decode(q, sc)

        speeds = []
        for run in (numpy_pass, torch_pass):
            run()  # warm
            t0 = time.perf_counter()
            for _ in range(repeats):
                run()
            speeds.append(repeats * len(samples) * rows * acts.shape[1] * 2 / (time.perf_counter() - t0) / 1e9)
    finally:
        torch.set_num_threads(threads)
    return speeds[0], speeds[1]


def print_host_decode(acts: torch.Tensor, k: int) -> None:
    print("\n| host decode, one core | numpy (the reader) GB/s | torch on the CPU GB/s | numpy / torch |")
    print("|---|---|---|---|")
    for name in ("fp8", "nf4"):
        np_speed, torch_speed = host_decode_speed(acts, k, name)
        print(f"| {name} | {np_speed:.2f} | {torch_speed:.2f} | {np_speed / torch_speed:.2f}x |", flush=True)


# -- report -------------------------------------------------------------------------------
def environment() -> str:
    cpu = platform.processor() or "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent, check=False).stdout.strip() or "?"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    versions = ", ".join(f"{p} {version(p)}" for p in ("torch", "zarr", "numcodecs", "google-crc32c"))
    return (f"date {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; "
            f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {gpu}; python {platform.python_version()}, "
            f"{versions}; dflash-pipeline {commit}")


def print_sweep(kind: str, rows: list[tuple[str, dict[str, float]]], args) -> None:
    need = args.extract_tokens_per_second * args.extract_width * 2 / 1e9
    print(f"\n{kind}: chunks of {args.chunk_rows} rows; writers busy at {need:.2f} GB/s of raw bf16 "
          f"({args.extract_tokens_per_second:,} tokens/s x {args.extract_width} values) on {os.cpu_count()} cores")
    print("| setting | bytes/token | ratio | encode GB/s/core | all cores GB/s | decode GB/s/core | writers busy |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        busy = need / r["parallel"] if "fp8" not in name else need / 2 / r["parallel"]
        print(f"| {name} | {r['bytes_per_token']:,.0f} | {r['ratio']:.3f}x | {r['encode']:.3f} | {r['parallel']:.2f} "
              f"| {r['decode']:.2f} | {busy:.0%} |")


def bench_kind(kind: str, acts: torch.Tensor, k: int, d: int, baseline, work: Path, args) -> None:
    tokens = acts.shape[0]
    rows: list[tuple[str, dict[str, float]]] = []
    for fp8 in (False, True):
        chunks = stored_chunks(acts, k, args.chunk_rows, fp8)
        name = "fp8" if fp8 else "bf16"
        if baseline is not None:
            old = baseline.HiddenCodec(name=name)
            rows.append((f"{name}: --compare-with's default (level {old.clevel}, {old.blocksize >> 10} KiB)",
                         measure(old.compress, chunks, tokens, args)))
        for level in args.levels:
            for bs in (args.blocksizes if not fp8 else [HiddenCodec().blocksize]):
                codec = HiddenCodec(name=name, clevel=level, blocksize=bs)
                label = f"{name}: zstd {level}, {bs >> 10 if bs else 'auto'} KiB blocks"
                rows.append((label + (" (shipped)" if codec == HiddenCodec(name=name) else ""),
                             measure(codec.compress, chunks, tokens, args)))
        del chunks
    print_sweep(kind, rows, args)
    sys.stdout.flush()
    print_host_decode(acts, k)
    print("\n| shipped codec | bytes/token on disk (whole cache) | ratio | CacheWriter GB/s | the same, zarr "
          "writing the hidden shards | read_sample GB/s/core |")
    print("|---|---|---|---|---|---|")
    for name in args.codecs:
        r = cache_end_to_end(acts, k, d, HiddenCodec(name=name), work, args)
        print(f"| {name} | {r['bytes_per_token']:,.0f} | {r['ratio']:.3f}x | {r['write']:.2f} | {r['by_zarr']:.2f} "
              f"| {r['read']:.2f} |", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="smoke-test sizes: K=2, hidden 256, 8192 tokens, 30 steps")
    p.add_argument("--host-decode-only", action="store_true",
                   help="only the numpy vs torch host decode of fp8 and nf4, on synthetic activations")
    p.add_argument("--kinds", default="model", help="comma list of model, synthetic")
    p.add_argument("--layers", type=int, help="K, captured layers (default 5; small 2)")
    p.add_argument("--hidden", type=int, help="hidden size of the model / width D of synthetic (default 1024; small 256)")
    p.add_argument("--tokens", type=int, help="tokens of activations (default 65536; small 8192)")
    p.add_argument("--train-steps", type=int, help="training steps of the model (default 300; small 30)")
    p.add_argument("--levels", default="1,2,3,4,5,9", help="zstd levels to measure")
    p.add_argument("--blocksizes", default="262144,1048576,4194304", help="Blosc block sizes (bytes) for bf16; 0: auto")
    p.add_argument("--codecs", default="bf16,fp8,raw", help="shipped codecs measured end to end")
    p.add_argument("--compare-with", help="another version's cache_tools directory: its default codecs as well")
    p.add_argument("--chunk-rows", type=int, default=128)
    p.add_argument("--shard-rows", type=int, default=8192)
    p.add_argument("--part-tokens", type=int, default=16384)
    p.add_argument("--timed-tokens", type=int, default=8192, help="tokens timed per core for encode and decode")
    p.add_argument("--extract-tokens-per-second", type=int, default=34000)
    p.add_argument("--extract-width", type=int, default=5 * 4096, help="K*D of the extraction (default 8B-shaped)")
    p.add_argument("--workdir", help="where the end-to-end caches go (default: the system temp dir)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    for key, (full, small) in {"layers": (5, 2), "hidden": (1024, 256), "tokens": (65536, 8192),
                               "train_steps": (300, 30)}.items():
        if getattr(a, key) is None:
            setattr(a, key, small if a.small else full)
    a.levels = [int(x) for x in a.levels.split(",") if x]
    a.blocksizes = [int(x) for x in a.blocksizes.split(",") if x]
    a.codecs = [c for c in a.codecs.split(",") if c]
    a.part_tokens = max(1024, a.part_tokens - a.part_tokens % 1024)
    return a


def main() -> None:
    args = parse_args()
    numcodecs.blosc.use_threads = False  # one thread per call, as the writer threads and the reader run it
    baseline = load_baseline(args.compare_with) if args.compare_with else None
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-codecs-", dir=args.workdir))
    print(environment())
    if args.host_decode_only:
        print_host_decode(synthetic_activations(args.tokens, args.layers, args.hidden, args.seed), args.layers)
        return
    t0 = time.perf_counter()
    try:
        for kind in args.kinds.split(","):
            if kind == "model":
                acts, desc = model_activations(args.tokens, args.layers, args.hidden, args.train_steps, args.seed)
            elif kind == "synthetic":
                acts = synthetic_activations(args.tokens, args.layers, args.hidden, args.seed)
                desc = f"synthetic, K={args.layers}, D={args.hidden}"
            else:
                raise SystemExit(f"unknown kind {kind!r}: use model and/or synthetic")
            print(f"{kind}: {desc}; {args.tokens} tokens, raw bf16 {acts.shape[1] * 2:,} bytes/token")
            bench_kind(kind, acts, args.layers, args.hidden, baseline, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
