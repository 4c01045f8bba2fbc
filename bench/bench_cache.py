"""Benchmark of the hidden-state cache: compression ratio, encode/decode throughput per core,
and random-sample reads through CacheReader against a plain np.memmap of the same data.

Two kinds of activations:
  synthetic  bf16 Gaussian x per-channel scales (log-normal spread), a few channels per layer
             50-100x larger, per-token and per-layer scale drift: the outlier structure of
             real LLM activations, at the real width (K=5, D=4096 at full size).
  model      hidden states of a small Qwen3 model (transformers, random init, then trained for
             a few hundred steps on byte-level text generated here: templated sentences,
             arithmetic, code-like lines), captured with output_hidden_states at K layers.

For each kind and codec (bf16, fp8, raw) it prints, as a Markdown table:
  ratio           raw bf16 bytes / bytes on disk of the whole cache (hidden, scales, ids, masks,
                  offsets, metadata)
  encode          GB/s of raw bf16 input per core: quantize (fp8) + Blosc + crc32c of every
                  chunk, one thread
  write           end-to-end CacheWriter throughput (zarr, fsync) given data in stored form
                  (fp8 quantized beforehand, on the GPU when there is one, as extraction does),
                  for information
  decode          GB/s of decoded bf16 per core: CacheReader.read_sample over all samples, one
                  thread, data hot in the page cache; median of --decode-passes rounds, each
                  round reading every cache once (so a slow spell of the host hits all alike)
  random read     GB/s of CacheReader.read_sample in a random sample order vs reading the same
                  samples from a flat uint16 np.memmap into a torch tensor, cold (page cache
                  evicted with posix_fadvise DONTNEED, best effort) and hot (second pass), reader
                  and memmap in turn for --read-rounds rounds (medians)

  python bench/bench_cache.py --small        # ~1-2 min on 2 cores, ~10 MB of disk
  python bench/bench_cache.py                # full size: see --help for the knobs
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numcodecs
import numcodecs.blosc
import numpy as np
import torch
from dflash.cache_tools.checksum import IMPLEMENTATION as CHECKSUM
from dflash.cache_tools.checksum import crc32c
from dflash.cache_tools.codecs import HiddenCodec, quantize_fp8
from dflash.cache_tools.manifest import make_header
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.writer import CacheWriter

TARGET_RATIO = {"bf16": 1.38, "fp8": 2.2}
TARGET_DECODE = {"bf16": 1.5}
TARGET_READ_VS_MEMMAP = {"raw": 0.6}


# -- activations --------------------------------------------------------------------------
def sample_lengths(total: int, mean: int, lo: int, hi: int, rng: np.random.Generator) -> list[int]:
    """Log-normal sample lengths in [lo, hi] summing to exactly `total` tokens."""
    out, left = [], total
    while left > 0:
        t = int(np.clip(rng.lognormal(math.log(mean), 0.6), lo, hi))
        t = left if left - t < lo else t
        out.append(t)
        left -= t
    return out


def synthetic_activations(tokens: int, k: int, d: int, seed: int) -> torch.Tensor:
    """[tokens, K*D] bf16 with per-channel scales, outlier channels and per-token drift."""
    g = torch.Generator().manual_seed(seed)
    chan = torch.exp(0.5 * torch.randn(k, d, generator=g))
    for layer in range(k):
        idx = torch.randperm(d, generator=g)[:4]
        chan[layer, idx] *= 50 + 50 * torch.rand(4, generator=g)
        chan[layer] *= 1.5 ** layer  # the residual stream grows with depth
    out = torch.empty(tokens, k * d, dtype=torch.bfloat16)
    step = 4096
    for s in range(0, tokens, step):
        n = min(step, tokens - s)
        x = torch.randn(n, k, d, generator=g) * chan
        x *= torch.exp(0.3 * torch.randn(n, 1, 1, generator=g))
        out[s: s + n] = x.reshape(n, k * d).to(torch.bfloat16)
    return out


def make_text(chars: int, seed: int) -> str:
    """Byte-level training text with learnable structure: prose, arithmetic, code."""
    rnd = random.Random(seed)
    words = ("the model a cache layer token drafts verifies target block anchor reads writes "
             "fast small large every first next state hidden value stores returns and of to in "
             "for with on is was were has had will can not").split()
    zipf = [1 / (i + 1) for i in range(len(words))]
    parts: list[str] = []
    size = 0
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


def model_activations(
    tokens: int, k: int, hidden: int, steps: int, batch: int, window: int, seed: int
) -> tuple[torch.Tensor, list[int], str]:
    """Hidden states of a small Qwen3 trained briefly on generated text: [tokens, K*hidden] bf16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    num_layers = 8
    layer_ids = sorted({round(1 + i * (num_layers - 4) / max(k - 1, 1)) for i in range(k)})
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=hidden, intermediate_size=64 * round(hidden * 8 / 3 / 64),
        num_hidden_layers=num_layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128), head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg).to(device)
    text = torch.tensor(list(make_text(2_000_000 + tokens * 2, seed).encode()), dtype=torch.long)
    train, held = text[: 2_000_000], text[2_000_000:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loss = float("nan")
    t0 = time.perf_counter()
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
    train_s = time.perf_counter() - t0
    model.eval().to(torch.bfloat16)
    acts = torch.empty(tokens, len(layer_ids) * hidden, dtype=torch.bfloat16)
    span = 1024
    with torch.no_grad():
        for s in range(0, tokens, span):
            ids = held[s: min(s + span, tokens)].unsqueeze(0).to(device)
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            acts[s: s + ids.shape[1]] = torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1).cpu()
    desc = (f"Qwen3 {num_layers} layers, hidden {hidden}, byte vocab; {steps} AdamW steps of "
            f"{batch}x{window} tokens on {device} ({train_s:.0f} s, final loss {loss:.2f}); "
            f"layers {layer_ids}")
    return acts, layer_ids, desc


# -- measurements -------------------------------------------------------------------------
def evict(path: Path) -> None:
    """Drop the page-cache pages of every file under `path` (clean pages only; best effort)."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def encode_throughput(acts: torch.Tensor, codec: HiddenCodec, k: int, chunk_rows: int) -> float:
    """GB/s of raw bf16 input through one thread of quantize (fp8) + the chunk encoder + crc32c."""
    t0 = time.perf_counter()
    for s in range(0, acts.shape[0], chunk_rows):
        chunk = acts[s: s + chunk_rows]
        if codec.has_scale:
            q, scale = quantize_fp8(chunk, k)
            data = q.numpy()
        else:
            data = chunk.view(torch.int16).numpy().view(np.uint16)
        crc32c(codec.compress(data))
    return acts.numel() * 2 / (time.perf_counter() - t0) / 1e9


def to_storage(acts: torch.Tensor, codec: HiddenCodec, k: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Activations in the codec's stored form, as extraction hands them to the writer: fp8 is
    quantized beforehand (on the GPU when there is one), bf16/raw are a free uint16 view."""
    if not codec.has_scale:
        return acts.view(torch.int16).numpy().view(np.uint16), None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = np.empty(acts.shape, dtype=np.uint8)
    scale = np.empty((acts.shape[0], k), dtype=np.float32)
    for s in range(0, acts.shape[0], 8192):
        qs, ss = quantize_fp8(acts[s: s + 8192].to(device), k)
        q[s: s + 8192], scale[s: s + 8192] = qs.cpu().numpy(), ss.cpu().numpy()
    return q, scale


def write_cache(path: Path, stored: tuple[np.ndarray, np.ndarray | None], lengths: list[int], layer_ids: list[int],
                d: int, codec: HiddenCodec, chunk_rows: int, shard_rows: int, part_tokens: int) -> float:
    """End-to-end CacheWriter throughput (GB/s of raw bf16) given data in stored form."""
    hidden, scale = stored
    header = make_header(target={"model": "bench", "vocab_size": 256}, target_layer_ids=layer_ids,
                         hidden_size=d, codec=codec, chunk_rows=chunk_rows, shard_rows=shard_rows)
    writer = CacheWriter(path, header)
    t0 = time.perf_counter()
    start, sid, part = 0, 0, 0
    while sid < len(lengths):
        with writer.part_writer(f"part-{part:06d}") as pw:
            while sid < len(lengths) and (pw.num_tokens < part_tokens or pw.num_samples == 0):
                t = lengths[sid]
                pw.add_sample(sid, np.zeros(t, dtype=np.int32), np.ones(t, dtype=np.uint8),
                              hidden[start: start + t],
                              hidden_scale=None if scale is None else scale[start: start + t])
                start, sid = start + t, sid + 1
        part += 1
    return hidden.shape[0] * hidden.shape[1] * 2 / (time.perf_counter() - t0) / 1e9


def read_reader(reader: CacheReader, order: list[int], reuse: bool = False, cpu: list | None = None) -> float:
    """GB/s of decoded bf16 through CacheReader.read_sample in the given sample order.

    reuse=True decodes into one preallocated buffer (`out=`), as the trainer's loader decodes
    into its batch tensor; otherwise every sample gets a fresh tensor (and its page faults).
    With `cpu` a list, the same bytes over this thread's CPU time are appended to it.
    """
    nbytes = 0
    buf = None
    if reuse:
        width = reader.manifest.num_layers * reader.manifest.hidden_size
        buf = torch.zeros((int(reader.lengths.max()), width), dtype=torch.bfloat16)
    t0, c0 = time.perf_counter(), time.thread_time()
    for i in order:
        out = {"hidden": buf[: int(reader.lengths[i])]} if buf is not None else None
        h = reader.read_sample(i, out=out)["hidden"]
        nbytes += h.numel() * 2
    wall, used = time.perf_counter() - t0, time.thread_time() - c0
    if cpu is not None:
        cpu.append(nbytes / max(used, 1e-9) / 1e9)
    return nbytes / wall / 1e9


def read_memmap(mm: np.memmap, offsets: np.ndarray, order: list[int]) -> float:
    """GB/s of the same samples copied from a flat uint16 memmap into bf16 torch tensors."""
    nbytes = 0
    t0 = time.perf_counter()
    for i in order:
        rows = mm[offsets[i]: offsets[i + 1]]
        h = torch.empty(rows.shape, dtype=torch.bfloat16)
        h.view(torch.int16).numpy().view(np.uint16)[...] = rows
        nbytes += h.numel() * 2
    return nbytes / (time.perf_counter() - t0) / 1e9


class HostLoad:
    """What else ran on the host during a timed section, from /proc/stat (Linux): the share of
    all cores' time used by other processes, and the share stolen by the hypervisor. Per-core
    figures of a shared host move with both; they are printed next to the results."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[list[int], int, float, float] | None:
        try:
            lines = Path("/proc/stat").read_text().splitlines()
            fields = [int(x) for x in lines[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        return fields, cores, time.perf_counter(), time.process_time()

    def summary(self) -> str:
        end = self._read()
        if self.start is None or end is None:
            return "host load: unknown (no /proc/stat)"
        (a, cores, t0, p0), (b, _, t1, p1) = self.start, end
        d = [y - x for x, y in zip(a, b)]
        hz = os.sysconf("SC_CLK_TCK")
        total = sum(d[:8]) or 1  # user nice system idle iowait irq softirq steal, in ticks
        others = (d[0] + d[1] + d[2] + d[5] + d[6]) / hz - (p1 - p0)  # less this process's own
        return (f"host during the timed section ({t1 - t0:.0f} s): other processes used "
                f"{max(others, 0.0) / ((t1 - t0) * max(cores, 1)):.0%} of its {cores} cores' time, "
                f"the hypervisor stole {d[7] / total:.1%}")


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_kind(
    name: str, acts: torch.Tensor, layer_ids: list[int], d: int, args, work: Path, peak: list[int]
) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    lengths = sample_lengths(acts.shape[0], args.mean_len, args.min_len, args.max_len, rng)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    order = rng.permutation(len(lengths))[: args.read_samples].tolist()
    flat = work / f"{name}.u16"
    with open(flat, "wb") as f:
        f.write(memoryview(acts.view(torch.int16).numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    rows = []
    for codec_name in args.codecs:
        codec = HiddenCodec(name=codec_name)
        path = work / f"{name}-{codec_name}"
        torch.set_num_threads(1)
        enc = encode_throughput(acts[: args.encode_tokens], codec, len(layer_ids), args.chunk_rows)
        torch.set_num_threads(args.threads)
        stored = to_storage(acts, codec, len(layer_ids))
        wr = write_cache(path, stored, lengths, layer_ids, d, codec, args.chunk_rows, args.shard_rows,
                         args.part_tokens)
        del stored
        size = du(path)
        peak[1] += size  # caches kept for the decode rounds
        peak[0] = max(peak[0], peak[1] + flat.stat().st_size)
        torch.set_num_threads(1)
        # Random reads, reader and memmap in turn for --read-rounds rounds (the order flips each
        # round): a slow spell of a shared host then lands on both alike. Cold: page cache
        # evicted and a fresh reader / memmap (their open cost included); hot: a second pass.
        # Reported: medians, and the median of the rounds' reader/memmap ratios.
        res: dict[str, list[float]] = {k: [] for k in ("cold_r", "cold_m", "hot_r", "hot_m")}
        load = HostLoad()
        for rnd in range(args.read_rounds):
            evict(path)
            evict(flat)
            reader = CacheReader(path)
            mm = np.memmap(flat, dtype=np.uint16, mode="r", shape=tuple(acts.shape))
            first, second = (("r", "m") if rnd % 2 == 0 else ("m", "r"))
            for temp in ("cold", "hot"):
                for who in (first, second):
                    res[f"{temp}_{who}"].append(read_reader(reader, order) if who == "r"
                                                else read_memmap(mm, offsets, order))
            reader.close()
            del mm
        host = load.summary()
        torch.set_num_threads(args.threads)
        rows.append({"kind": name, "codec": codec_name, "ratio": acts.numel() * 2 / size, "bytes": size,
                     "encode": enc, "write": wr, "path": path, "samples": len(lengths),
                     **{k: statistics.median(v) for k, v in res.items()},
                     "cold_vs": statistics.median(r / m for r, m in zip(res["cold_r"], res["cold_m"])),
                     "hot_vs": statistics.median(r / m for r, m in zip(res["hot_r"], res["hot_m"])),
                     "host": host})
        print(f"{name}, {codec_name}, random reads: {host}", flush=True)
    flat.unlink()
    return rows


def decode_rounds(rows: list[dict], args) -> None:
    """The decode figures of every cache, in --decode-passes rounds: each round reads every
    cache once into fresh tensors and once into a reused buffer, starting one cache further on
    each round. A slow spell of a shared host then lands on a round of every cache rather than
    on all passes of one (the figure is the median over rounds). Data hot in the page cache,
    parts already open as in a running loader. fp8 gets one pass: its CPU decode (torch's fp8
    cast) is slow and not the trainer's path (it dequantizes on the GPU)."""
    torch.set_num_threads(1)
    readers = []
    for row in rows:
        reader = CacheReader(row["path"])
        for i in range(row["samples"]):  # untimed: opens the parts, pages the data in
            reader.read_sample(i, dequantize=False)
        readers.append(reader)
        row.update(fresh=[], reuse=[], cpu=[])
    load = HostLoad()
    for rnd in range(args.decode_passes):
        for i in range(len(rows)):
            j = (i + rnd) % len(rows)
            row, reader = rows[j], readers[j]
            if rnd > 0 and row["codec"] == "fp8":  # one pass (see above)
                continue
            everything = list(range(row["samples"]))
            row["fresh"].append(read_reader(reader, everything))
            row["reuse"].append(read_reader(reader, everything, reuse=True, cpu=row["cpu"]))
    print(f"decode rounds: {load.summary()}", flush=True)
    for row, reader in zip(rows, readers):
        reader.close()
        row.update(decode=statistics.median(row["reuse"]), decode_cpu=statistics.median(row["cpu"]),
                   decode_fresh=statistics.median(row["fresh"]),
                   decode_spread=(min(row["reuse"]), max(row["reuse"])))
    torch.set_num_threads(args.threads)


# -- report -------------------------------------------------------------------------------
def environment() -> list[str]:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip() or "?"
    except OSError:
        commit = "?"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = ", ".join(f"{p} {version(p)}" for p in ("torch", "zarr", "numcodecs", "numpy", "transformers"))
    return [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"machine: {platform.node()}, {cpu}, {cores} usable cores, {platform.system()} {platform.release()}",
        f"python {platform.python_version()}, {versions}; checksum {CHECKSUM}; dflash-pipeline {commit}",
    ]


def target(value: float, goal: float | None, unit: str = "") -> str:
    if goal is None:
        return f"{value:.2f}{unit}"
    return f"{value:.2f}{unit} ({'ok' if value >= goal else 'MISS'} >= {goal}{unit})"


def print_table(rows: list[dict]) -> None:
    print("| activations | codec | ratio vs raw bf16 | encode GB/s/core | write GB/s | decode GB/s/core "
          "| decode rounds min-max | same, per CPU second | decode, fresh buffers "
          "| random read cold: reader / memmap | hot: reader / memmap | reader vs memmap (hot) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['codec']} | {target(r['ratio'], TARGET_RATIO.get(r['codec']), 'x')} "
              f"| {r['encode']:.2f} | {r['write']:.2f} | {target(r['decode'], TARGET_DECODE.get(r['codec']))} "
              f"| {r['decode_spread'][0]:.2f}-{r['decode_spread'][1]:.2f} "
              f"| {r['decode_cpu']:.2f} | {r['decode_fresh']:.2f} "
              f"| {r['cold_r']:.2f} / {r['cold_m']:.2f} (x{r['cold_vs']:.2f}) "
              f"| {r['hot_r']:.2f} / {r['hot_m']:.2f} "
              f"| {target(r['hot_vs'], TARGET_READ_VS_MEMMAP.get(r['codec']), 'x')} |")
    print("\nper CPU second: the decode figure over the reading thread's CPU time rather than "
          "wall time (the two part when the host takes the core away); random reads: medians of "
          "--read-rounds rounds, ratios the median of the rounds' ratios")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="smoke-test sizes: K=2, D=256, few tokens, tiny model")
    p.add_argument("--layers", type=int, help="K, captured layers (default 5; small 2)")
    p.add_argument("--hidden", type=int, help="D of the synthetic activations (default 4096; small 256)")
    p.add_argument("--tokens", type=int, help="tokens per kind of activations (default 65536; small 4096)")
    p.add_argument("--model-hidden", type=int, help="hidden size of the trained model (default 1024; small 128)")
    p.add_argument("--train-steps", type=int, help="training steps of the model (default 300; small 20)")
    p.add_argument("--train-batch", type=int, help="sequences per training step (default 16; small 4)")
    p.add_argument("--train-window", type=int, help="tokens per training sequence (default 256; small 128)")
    p.add_argument("--kinds", default="synthetic,model", help="comma list of synthetic, model")
    p.add_argument("--codecs", default="bf16,fp8,raw", help="comma list of bf16, fp8, raw")
    p.add_argument("--mean-len", type=int, help="mean sample length (default 1024; small 128)")
    p.add_argument("--chunk-rows", type=int, default=128)
    p.add_argument("--shard-rows", type=int, default=8192)
    p.add_argument("--part-tokens", type=int, help="tokens per part (default 16384; small 1024)")
    p.add_argument("--read-samples", type=int, default=2000, help="random samples read per pass (at most all)")
    p.add_argument("--read-rounds", type=int, default=5, help="rounds of random reads, reader and memmap in turn (median)")
    p.add_argument("--encode-tokens", type=int, default=4096, help="tokens timed for the encode figure")
    p.add_argument("--decode-passes", type=int, default=5, help="rounds over every cache for the decode figures (median; fp8: one pass)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads outside timed sections")
    p.add_argument("--workdir", help="where to write the caches (default: the system temp dir)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    small = a.small
    defaults = {"layers": (5, 2), "hidden": (4096, 256), "tokens": (65536, 4096), "model_hidden": (1024, 128),
                "train_steps": (300, 20), "train_batch": (16, 4), "train_window": (256, 128), "mean_len": (1024, 128), "part_tokens": (16384, 1024)}
    for key, (full, sm) in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, sm if small else full)
    a.min_len, a.max_len = max(8, a.mean_len // 16), a.mean_len * 4
    a.kinds = [k for k in a.kinds.split(",") if k]
    a.codecs = [c for c in a.codecs.split(",") if c]
    return a


def main() -> None:
    args = parse_args()
    numcodecs.blosc.set_nthreads(1)
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-", dir=args.workdir))
    print("\n".join(environment()))
    print(f"config: K={args.layers}, synthetic D={args.hidden}, model hidden={args.model_hidden}, "
          f"{args.tokens} tokens per kind, sample lengths {args.min_len}-{args.max_len} (mean ~{args.mean_len}), "
          f"chunk_rows {args.chunk_rows}, shard_rows {args.shard_rows}, {args.part_tokens} tokens per part; "
          f"work dir on {os.statvfs(work).f_bsize}-byte-block file system")
    print("page cache: cold columns after posix_fadvise(DONTNEED) on every file (best effort, not "
          "verified); decode and hot columns read data that is in the page cache.\n")
    rows: list[dict] = []
    peak = [0, 0]  # peak disk use, bytes of the caches kept
    t0 = time.perf_counter()
    try:
        for kind in args.kinds:
            if kind == "synthetic":
                acts = synthetic_activations(args.tokens, args.layers, args.hidden, args.seed)
                layer_ids = list(range(1, 1 + args.layers))
                print(f"synthetic: Gaussian x log-normal channel scales, 4 channels/layer 50-100x, "
                      f"K={args.layers}, D={args.hidden}")
                rows += bench_kind(kind, acts, layer_ids, args.hidden, args, work, peak)
            elif kind == "model":
                if not torch.cuda.is_available() and not args.small:
                    print("warning: no GPU; training the model on the CPU is slow (see --train-steps)")
                acts, layer_ids, desc = model_activations(args.tokens, args.layers, args.model_hidden, args.train_steps,
                                               args.train_batch, args.train_window, args.seed)
                print(f"model: {desc}")
                rows += bench_kind(kind, acts, layer_ids, args.model_hidden, args, work, peak)
            else:
                raise SystemExit(f"unknown kind {kind!r}: use synthetic and/or model")
            del acts
        decode_rounds(rows, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; peak disk use {peak[0] / 1e6:.0f} MB (every cache, and "
          "one kind's flat file)")


if __name__ == "__main__":
    main()
