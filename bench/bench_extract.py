"""Extraction throughput on one GPU: plain prefill vs stop-after-last-layer vs full extraction.

Builds a randomly initialized Qwen3-8B-shaped target in bf16 directly on the GPU (no
checkpoint), writes synthetic ~2K-token samples, and reports side by side:
  prefill      model(ids, logits_to_keep=1)                      tokens/s
  capture      the forward that stops after the last captured layer  tokens/s (measured before
               and after every extraction; each extraction is compared with the two around it)
  extract bf16 full extraction into a cache (codec bf16)          tokens/s, GPU util (NVML, over
               the timed span: first batch to last commit), bytes/token
  extract fp8  the same with codec fp8
Each cache is deleted after it is measured. Target: extract >= 0.95x capture.

    python bench/bench_extract.py --output /dev/shm/dflash-bench          # one H200
    python bench/bench_extract.py --small --output /tmp/dflash-bench      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path

import torch
from dflash.cache_tools.layers import default_target_layer_ids
from dflash.cache_tools.reader import CacheReader
from dflash.extract.batching import make_batches
from dflash.extract.config import ExtractConfig
from dflash.extract.data import plan_windows
from dflash.extract.pipeline import STAGED_COPY_ENV, run_extraction
from dflash.extract.target import LayerCapture
from profiling import device_busy_seconds
from transformers import AutoModelForCausalLM, Qwen3Config

FULL = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
            head_dim=128, intermediate_size=12288, vocab_size=151936)
SMALL = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, intermediate_size=512, vocab_size=1024)


class GpuSampler:
    """GPU utilisation (NVML / nvidia-smi, every 200 ms) while a block runs, each sample with its
    time; `mean_between` averages a span of it. None without a GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.samples: list[tuple[float, float]] = []  # (perf_counter, percent)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _query(self) -> float | None:
        try:
            return float(torch.cuda.utilization(self.device))
        except Exception:
            pass
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 f"--id={self.device.index or 0}"], capture_output=True, text=True, timeout=5)
            return float(out.stdout.strip().splitlines()[0])
        except Exception:
            return None

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            v = self._query()
            if v is not None:
                self.samples.append((time.perf_counter(), v))

    def __enter__(self) -> GpuSampler:
        if self.device.type == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def mean_between(self, start: float, end: float) -> float | None:
        """Mean of the samples taken in [start, end] (perf_counter times). A sample covers the
        driver's last sampling period (up to 1 s), so the first second of the span is left out."""
        vals = [v for t, v in self.samples if start + 1.0 <= t <= end]
        return sum(vals) / len(vals) if vals else None


def build_model(shape: dict, device: torch.device) -> torch.nn.Module:
    cfg = Qwen3Config(**shape, max_position_embeddings=32768, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3ForCausalLM"]
    with torch.device(device):  # random init on the GPU directly: seconds, not minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def write_data(path: Path, tokens: int, seq_len: int, vocab: int) -> int:
    rng = random.Random(0)
    n = max(1, tokens // seq_len)
    with open(path, "w") as f:
        for _ in range(n):
            length = rng.randint(seq_len * 3 // 4, seq_len * 5 // 4)
            ids = [rng.randrange(vocab) for _ in range(length)]
            f.write(json.dumps({"input_ids": ids, "prompt_len": length // 4}) + "\n")
    return n


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(fn, batches: list[torch.Tensor], device: torch.device) -> float:
    fn(batches[0])  # warm-up
    sync(device)
    t = time.perf_counter()
    for ids in batches:
        fn(ids)
    sync(device)
    return sum(b.numel() for b in batches) / (time.perf_counter() - t)


def extraction_batches(cfg: ExtractConfig, vocab: int, device: torch.device) -> tuple[list[torch.Tensor], int]:
    """The forward batches an extraction with `cfg` runs (same windows, parts, order, padding),
    on the device, and the number of real tokens in them."""
    batches, real = [], 0
    for plans in plan_windows([Path(cfg.data)], cfg.part_rules(vocab)):
        samples = [s for plan in plans for s in plan.samples]
        for batch in make_batches(samples, cfg.token_budget):
            batches.append(batch.input_ids.to(device))
            real += batch.real_tokens
    return batches, real


def check_cache(cache: Path, model, layer_ids: list[int], count: int, device: torch.device) -> float:
    """Largest relative Frobenius error, per (sample, layer), of cached states against the same
    sample run alone (bf16 compute: batched and single forwards differ by rounding, ~1e-3;
    a row in the wrong place is off by ~1)."""
    reader = CacheReader(cache)
    capture = LayerCapture(model, layer_ids, need_last=False)
    worst = 0.0
    try:
        for index in torch.linspace(0, len(reader) - 1, count).long().tolist():
            sample = reader.read_sample(index)
            ids = sample["input_ids"].long()[None].to(device)
            with torch.inference_mode():
                ref = torch.cat(capture(ids, None).layers, dim=-1)[0].float()
            got = sample["hidden"].to(device).float()
            for k in range(len(layer_ids)):
                cols = slice(k * ref.shape[1] // len(layer_ids), (k + 1) * ref.shape[1] // len(layer_ids))
                err = (got[:, cols] - ref[:, cols]).norm() / ref[:, cols].norm()
                worst = max(worst, float(err))
    finally:
        capture.close()
        reader.close()
    return worst



def traced_extraction(out: Path, data: Path, tokens: int, layer_ids, budget, args, device, model) -> None:
    """A bf16 extraction of the first `tokens` tokens under torch.profiler (CPU + CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    lines, total = [], 0
    for line in data.read_text().splitlines():
        if total >= tokens:
            break
        lines.append(line)
        total += len(json.loads(line)["input_ids"])
    small = out / "trace-data.jsonl"
    small.write_text("\n".join(lines) + "\n")
    cache = out / "bench-cache-trace"
    shutil.rmtree(cache, ignore_errors=True)
    cfg = ExtractConfig(target_model="<in-memory Qwen3-8B-shaped model>", data=str(small), output=str(cache),
                        codec="bf16", target_layer_ids=layer_ids, token_budget=budget,
                        part_tokens=args.part_tokens, sort_window_tokens=args.sort_window_tokens,
                        max_seq_len=2 * max(len(json.loads(x)["input_ids"]) for x in lines),
                        num_writers=args.num_writers, device=str(device), progress=False)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        summary = run_extraction(cfg, model=model)
    wall = time.perf_counter() - t
    print(summary.format())
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    try:
        print(events.table(sort_by="self_device_time_total", row_limit=12))
    except Exception:
        print(events.table(sort_by="self_cuda_time_total", row_limit=12))
    busy = device_busy_seconds(prof)
    print(f"traced extraction: {summary.tokens} tokens in {wall:.1f} s, GPU kernel+copy time {busy:.1f} s "
          f"({busy / wall:.0%} of the wall time)", flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    small.unlink()


def print_table(rows: list, stop_rates: list[float], own_rate: float, raw: int) -> None:
    """The figures: tokens/s of each row against the stop-after-last-layer forward around it."""
    print("\nstop-after-last-layer forward, measured before and after each extraction: "
          + ", ".join(f"{r:,.0f}" for r in stop_rates) + " tokens/s")
    print(f"{'what':48s} {'tokens/s':>10s} {'vs stop-fwd':>11s} {'vs own batches':>14s} {'GPU util':>9s} "
          f"{'bytes/token':>12s}")
    for name, tps, util, bpt, ref in rows:
        util_s = f"{util:.0f}%" if util is not None else "-"
        bpt_s = f"{bpt:,.0f}" if bpt is not None else "-"
        own_s = f"{tps / own_rate:.3f}x" if name.startswith("full") else "-"
        print(f"{name:48s} {tps:10,.0f} {tps / ref:10.3f}x {own_s:>14s} {util_s:>9s} {bpt_s:>12s}")
    print(f"(raw bf16 would be {raw:,} bytes/token; target: full extraction >= 0.95x stop-fwd; "
          "'vs own batches': against the same forward over the batches the extraction runs, padding included, "
          "in real tokens/s)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", required=True, help="Scratch directory for data and caches (e.g. /dev/shm/x).")
    ap.add_argument("--small", action="store_true", help="Tiny model and data (CPU smoke run).")
    ap.add_argument("--tokens", type=int, help="Tokens to extract [1M; small: 16K].")
    ap.add_argument("--seq-len", type=int, help="Typical sample length [2048; small: 256].")
    ap.add_argument("--forward-tokens", type=int, help="Tokens for the forward-only figures [256K].")
    ap.add_argument("--token-budget", type=int, default=32768)
    ap.add_argument("--part-tokens", type=int, default=32768)
    ap.add_argument("--sort-window-tokens", type=int, default=1 << 20,
                    help="dflash-extract's sort window [1M: what the default 64K-token parts get; "
                         "16 x --part-tokens would be 512K here]. Larger windows, less padding.")
    ap.add_argument("--num-writers", type=int, help="Writer processes [default of dflash-extract].")
    ap.add_argument("--codecs", default="bf16,fp8",
                    help="Codecs to extract with; 'bf16-staged' adds a bf16 run through the host-copy "
                         "fallback (DFLASH_EXTRACT_STAGED_COPY=1) for comparison.")
    ap.add_argument("--trace-tokens", type=int, default=0,
                    help="Also extract this many tokens (bf16) under torch.profiler and print where the "
                         "host and the GPU spend their time.")
    ap.add_argument("--check-samples", type=int, default=4,
                    help="Samples of each cache compared with a single-sample forward (catches rows "
                         "landing in the wrong place).")
    return ap


def main() -> None:
    args = build_parser().parse_args()

    small = args.small
    shape = SMALL if small else FULL
    tokens = args.tokens or (16384 if small else 1 << 20)
    seq_len = args.seq_len or (256 if small else 2048)
    fwd_tokens = args.forward_tokens or (8192 if small else 1 << 18)
    budget = min(args.token_budget, 4096) if small else args.token_budget
    device = torch.device("cuda" if torch.cuda.is_available() and not small else "cpu")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)

    t = time.perf_counter()
    model = build_model(shape, device)
    print(f"model: {shape} on {device}, built in {time.perf_counter() - t:.1f}s")
    layer_ids = default_target_layer_ids(shape["num_hidden_layers"], 5)
    data = out / "bench-data.jsonl"
    n = write_data(data, tokens, seq_len, shape["vocab_size"])
    print(f"data: {n} samples of ~{seq_len} tokens ({tokens} tokens), layers {layer_ids}; token budget "
          f"{budget}, parts of {args.part_tokens} tokens, sort window {args.sort_window_tokens} tokens")

    per_batch = max(1, budget // seq_len)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, shape["vocab_size"], (per_batch, seq_len), generator=gen).to(device)
               for _ in range(max(1, fwd_tokens // (per_batch * seq_len)))]
    rows = []

    def bench_config(data_file: Path, cache: Path, codec: str) -> ExtractConfig:
        return ExtractConfig(target_model="<in-memory Qwen3-8B-shaped model>", data=str(data_file),
                             output=str(cache), codec=codec, target_layer_ids=layer_ids,
                             token_budget=budget, part_tokens=args.part_tokens,
                             sort_window_tokens=args.sort_window_tokens, max_seq_len=seq_len * 2,
                             num_writers=args.num_writers, device=str(device), progress=False)

    def stop_forward_rate() -> float:
        with torch.inference_mode():
            capture = LayerCapture(model, layer_ids, need_last=False)
            try:
                return time_forward(lambda ids: capture(ids, None), batches, device)
            finally:
                capture.close()

    with torch.inference_mode():
        prefill = time_forward(lambda ids: model(ids, logits_to_keep=1), batches, device)
    # The stop-after-last-layer forward is measured before and after every extraction, and each
    # extraction is compared with the mean of the two measurements around it: the GPU's clocks
    # drift over minutes of load (thermals), which a single measurement at the start would bias.
    stop_rates = [stop_forward_rate()]
    rows.append(("prefill model(ids, logits_to_keep=1)", prefill, None, None, stop_rates[0]))
    rows.append((f"forward stopping after layer {max(layer_ids)}", stop_rates[0], None, None, stop_rates[0]))
    # The same forward over the very batches the extraction runs (its windows, lengths and
    # padding), in real tokens/s: extraction / this is the part of the host side not hidden.
    own, real = extraction_batches(bench_config(data, out / "unused", "bf16"), shape["vocab_size"], device)
    with torch.inference_mode():
        capture = LayerCapture(model, layer_ids, need_last=False)
        try:
            own_rate = time_forward(lambda ids: capture(ids, None), own, device) * real / sum(b.numel() for b in own)
        finally:
            capture.close()
    del own
    rows.append(("  the same over the extraction's own batches", own_rate, None, None, stop_rates[0]))

    for name in args.codecs.split(","):
        codec, staged = name.removesuffix("-staged"), name.endswith("-staged")
        cache = out / f"bench-cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        cfg = bench_config(data, cache, codec)
        if staged:
            os.environ[STAGED_COPY_ENV] = "1"
        try:
            with GpuSampler(device) as gpu:
                summary = run_extraction(cfg, model=model)
                returned = time.perf_counter()
        finally:
            os.environ.pop(STAGED_COPY_ENV, None)
        stop_rates.append(stop_forward_rate())
        around = (stop_rates[-2] + stop_rates[-1]) / 2
        # GPU utilisation over the timed span only (first batch to last commit): start-up
        # (writers, page-locking, compiling) and shutdown leave the GPU idle and are not timed.
        end = returned - summary.teardown_seconds
        util = gpu.mean_between(end - summary.seconds, end)
        rows.append((f"full extraction, codec {name}", summary.tokens_per_second, util,
                     summary.bytes / max(summary.tokens, 1), around))
        print(summary.format())
        err = check_cache(cache, model, layer_ids, args.check_samples, device)
        print(f"check: {args.check_samples} samples of the {name} cache vs a single-sample forward: "
              f"max relative error {err:.4f}", flush=True)
        if err > (0.08 if codec == "fp8" else 0.03):
            raise SystemExit(f"cache {name} does not match the target's states (error {err:.3f})")
        shutil.rmtree(cache, ignore_errors=True)

    if args.trace_tokens:
        traced_extraction(out, data, args.trace_tokens, layer_ids, budget, args, device, model)

    print_table(rows, stop_rates, own_rate, len(layer_ids) * shape["hidden_size"] * 2)
    data.unlink()


if __name__ == "__main__":
    main()
