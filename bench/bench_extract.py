"""Extraction throughput on one GPU: plain prefill vs the two forwards an extraction is held to.

Builds a randomly initialized target in bf16 directly on the GPU (no checkpoint), writes
synthetic ~2K-token samples, and reports side by side:
  prefill      model(ids, logits_to_keep=1)                      tokens/s
  stop-fwd     the forward that stops after the last captured layer  tokens/s: the reference of
               an extraction without top-k (--store-topk 0)
  full-fwd     the forward through every layer, the final norm and the head over every token,
               reduced to the top-K log-probs as dflash-extract reduces them (no capture, nothing
               copied): the reference of an extraction that stores them (its default, K = 8;
               K: the largest '@K' of --codecs, else 8). Both references are measured before
               and after every extraction; each extraction is compared with the two around it.
  head-fwd     the same forward and head with no top-k (once): what the top-k itself costs
  extract bf16 full extraction into a cache (codec bf16)          tokens/s, GPU util (NVML, over
               the timed span: first batch to last commit), bytes/token
  extract fp8  the same with codec fp8
Each cache is deleted after it is measured. Targets: an extraction >= 0.95x stop-fwd without
top-k, >= 0.95x full-fwd with it.

A --codecs entry ending in '+old' (e.g. 'bf16@8,bf16@8+old') runs that extraction with the
top-k formula before the chunk reduction (bench/bench_topk.py's old_next_token_outputs: per
2,048-row chunk a float32 copy of the logits, their log_softmax and its topk), and full-fwd is
then measured once with it too: old against new, side by side in one process.

Target shapes (--shape; 5 captured layers from the default layer rule):
  8b          Qwen3-8B (dense Qwen3: hidden 4096, 36 layers, 32/8 heads)
  27b-dense   a dense Qwen3 of Qwen3.6-27B's size (hidden 5120, 64 layers, 24/4 heads of 256,
              MLP 17408, vocab 248,320)
  27b-hybrid  Qwen3.6-27B as transformers defines it (Qwen3_5ForCausalLM: the same dimensions,
              gated-delta-net linear attention (16 key / 48 value heads of 128) in three layers of
              four, full attention in every 4th); the linear-attention kernels transformers took
              (flash-linear-attention, causal-conv1d, or its torch fallback) are reported
--small builds a tiny model of the same architecture on the CPU (a smoke run). The last line of
the output is the figures as one JSON object (also written to --json), which bench/gpu_hours.py
reads.

    python bench/bench_extract.py --output /dev/shm/dflash-bench          # one H200
    python bench/bench_extract.py --shape 27b-hybrid --output /dev/shm/x --json /dev/shm/x.json
    python bench/bench_extract.py --codecs bf16,bf16@8,bf16@8+old --output /dev/shm/x   # top-k, old vs new
    python bench/bench_extract.py --small --output /tmp/dflash-bench      # CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import random
import shutil
import sys
import time
from pathlib import Path

import dflash.extract.engine as extraction_engine
import torch
import transformers
from bench_topk import head_alone, old_next_token_outputs
from dflash.cache_tools.layers import default_target_layer_ids
from dflash.cache_tools.reader import CacheReader
from dflash.extract.batching import make_batches
from dflash.extract.config import ExtractConfig
from dflash.extract.data import plan_windows
from dflash.extract.engine import _compiled_head
from dflash.extract.pipeline import STAGED_COPY_ENV, run_extraction
from dflash.extract.target import LayerCapture, head_reducer, next_token_outputs
from dflash.train.data.loader import sample_tensors
from profiling import GpuSampler, device_busy_seconds
from transformers import AutoModelForCausalLM, Qwen3Config

FULL = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
            head_dim=128, intermediate_size=12288, vocab_size=151936)
SMALL = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, intermediate_size=512, vocab_size=1024)
# Qwen3.6-27B's text model (as Qwen3.5-27B): transformers' Qwen3_5TextConfig fields of its config.json.
DENSE_27B = dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                 head_dim=256, intermediate_size=17408, vocab_size=248320)
LINEAR_27B = dict(linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4)
LINEAR_SMALL = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_conv_kernel_dim=4)
FULL_ATTENTION_INTERVAL = 4  # Qwen3.5/3.6: layers 3, 7, 11, ... are full attention, the others linear
SHAPES = {  # --shape: (architecture, dimensions, dimensions with --small)
    "8b": ("Qwen3ForCausalLM", FULL, SMALL),
    "27b-dense": ("Qwen3ForCausalLM", DENSE_27B, SMALL),
    "27b-hybrid": ("Qwen3_5ForCausalLM", {**DENSE_27B, **LINEAR_27B}, {**SMALL, **LINEAR_SMALL}),
}


def build_config(architecture: str, shape: dict):
    """The transformers config of a randomly initialized target of `shape`."""
    common = dict(max_position_embeddings=32768, tie_word_embeddings=False)
    if architecture == "Qwen3ForCausalLM":
        cfg = Qwen3Config(**shape, **common)
    else:
        config_class = getattr(transformers, "Qwen3_5TextConfig", None)
        if config_class is None:
            raise SystemExit(f"transformers {transformers.__version__} has no Qwen3_5TextConfig (Qwen3.5/3.6); "
                             "the 27b-hybrid shape needs a transformers that defines it. Use --shape 27b-dense instead.")
        n = shape["num_hidden_layers"]
        types = ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention" for i in range(n)]
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}  # Qwen3.6-27B's
        cfg = config_class(**shape, layer_types=types, rope_parameters=rope, **common)
    cfg.architectures = [architecture]
    return cfg


def build_model(cfg, device: torch.device) -> torch.nn.Module:
    with torch.device(device):  # random init on the GPU directly: seconds, not minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


class FallbackWarnings(logging.Handler):
    """Collects transformers' warnings about a missing fast kernel (its torch fallback taken)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "fall" in msg.lower() and ("kernel" in msg.lower() or "fast path" in msg.lower() or "install" in msg):
            self.messages.append(msg)


def _implementation(fn) -> str:
    """The module whose code `fn` runs. transformers 5.24 wraps the linear-attention functions in a
    closure over the implementation it chose at import (the package's kernel or its own torch code);
    earlier 5.x versions keep the chosen function on the layer, None meaning their torch path."""
    if fn is None:
        return "torch"
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if callable(c.cell_contents)]
    for f in [fn, *cells]:
        module = getattr(f, "__module__", None) or ""
        if module and not module.startswith("transformers"):
            return module
    return "torch"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import_error(module: str) -> str | None:
    """Why `module` does not import here (None if it does): what a torch fallback traces to."""
    try:
        importlib.import_module(module)
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:300]
    return None


def linear_attention_kernels(model: torch.nn.Module, warnings: list[str]) -> dict | None:
    """Which code runs the linear-attention layers' chunked delta rule, causal conv1d and gated norm
    (None for a target without linear-attention layers)."""
    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if layer is None:
        return None
    module = sys.modules[type(layer).__module__]
    found = {}
    for name in ("chunk_gated_delta_rule", "causal_conv1d_fn"):
        if name in vars(layer):  # chosen per layer (older transformers)
            fn = vars(layer)[name]
        else:
            fn = getattr(module, name, None) or getattr(module, f"torch_{name}", None)
        found[name] = _implementation(fn)
    norm = type(layer.norm)
    found["gated_norm"] = "torch" if norm.__module__.startswith("transformers") else norm.__module__
    fast, conv = found["chunk_gated_delta_rule"].startswith("fla"), found["causal_conv1d_fn"].startswith("causal")
    path = ("flash-linear-attention" if fast else "torch fallback") + " delta rule, " + (
        "causal-conv1d" if conv else "torch") + " conv1d"
    return {"path": path, **found, "flash_linear_attention": _version("flash-linear-attention"),
            "fla_core": _version("fla-core"), "causal_conv1d": _version("causal-conv1d"),
            "fla_import_error": _import_error("fla.ops.gated_delta_rule"),
            "transformers_warnings": sorted(set(warnings))}


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
    """Real tokens/s of `fn` over `batches`, after one warm-up call per distinct batch shape (kernels
    that autotune or compile per shape, such as flash-linear-attention's, pay that once, not in
    the timed pass)."""
    for ids in {tuple(b.shape): b for b in batches}.values():
        fn(ids)
    sync(device)
    t = time.perf_counter()
    for ids in batches:
        fn(ids)
    sync(device)
    return sum(b.numel() for b in batches) / (time.perf_counter() - t)


def extraction_batches(cfg: ExtractConfig, vocab: int, device: torch.device, *, rank: int = 0,
                       world_size: int = 1) -> tuple[list[torch.Tensor], int]:
    """The forward batches an extraction with `cfg` runs (same windows, parts, order, padding),
    on the device, and the number of real tokens in them; of rank `rank`'s windows only (window
    % world_size == rank, as dflash-extract splits them)."""
    batches, real = [], 0
    for plans in plan_windows([Path(cfg.data)], cfg.part_rules(vocab)):
        if plans[0].window % world_size != rank:
            continue
        samples = [s for plan in plans for s in plan.samples]
        for batch in make_batches(samples, cfg.token_budget):
            batches.append(batch.input_ids.to(device))
            real += batch.real_tokens
    return batches, real


def check_cache(cache: Path, model, layer_ids: list[int], count: int,
                device: torch.device) -> tuple[list[float], list[float]]:
    """Per captured layer, the largest relative Frobenius error over the checked samples of the
    cached states against the same sample run alone, and the same error of the forward itself
    with the checked samples batched together (right-padded, as the extraction batches them)
    and no cache involved: the floor of what batching alone moves. In bf16 compute batched and
    single forwards differ by rounding (~1e-3 on a dense Qwen3, more through a hybrid's
    linear-attention kernels, whose chunking depends on the batch); through random-init layers
    that rounding grows with depth. A row in the wrong place is off by ~1, in the first captured
    layer already."""
    reader = CacheReader(cache)
    capture = LayerCapture(model, layer_ids, need_last=False)
    worst, floor = [0.0] * len(layer_ids), [0.0] * len(layer_ids)

    def errors(got: torch.Tensor, ref: torch.Tensor, into: list[float]) -> None:
        for k in range(len(layer_ids)):
            cols = slice(k * ref.shape[1] // len(layer_ids), (k + 1) * ref.shape[1] // len(layer_ids))
            err = (got[:, cols] - ref[:, cols]).norm() / ref[:, cols].norm()
            into[k] = max(into[k], float(err))

    try:
        singles, rows = [], []
        for index in torch.linspace(0, len(reader) - 1, count).long().tolist():
            sample = sample_tensors(reader.read_sample(index))
            ids = sample["input_ids"].long()
            with torch.inference_mode():
                ref = torch.cat(capture(ids[None].to(device), None).layers, dim=-1)[0].float()
            errors(sample["hidden"].to(device).float(), ref, worst)
            singles.append(ref)
            rows.append(ids)
        batch = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
        for b, r in enumerate(rows):
            batch[b, :len(r)] = r
        with torch.inference_mode():
            batched = torch.cat(capture(batch.to(device), None).layers, dim=-1).float()
        for b, ref in enumerate(singles):
            errors(batched[b, :ref.shape[0]], ref, floor)
    finally:
        capture.close()
        reader.close()
    return worst, floor


def check_passes(errors: list[float], floor: list[float], limit: float) -> bool:
    """The cache matches the target when every captured layer's error is within the codec's
    limit plus twice what batching alone moves that layer (`check_cache`'s floor): rounding
    that grows with depth passes where the forward itself shows it, a misplaced row (~1) never."""
    return all(e <= limit + 2 * f for e, f in zip(errors, floor))


def traced_extraction(out: Path, data: Path, tokens: int, layer_ids, budget, args, device, model,
                      label: str) -> None:
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
    cfg = ExtractConfig(target_model=label, data=str(small), output=str(cache),
                        codec="bf16", target_layer_ids=layer_ids, token_budget=budget,
                        part_tokens=args.part_tokens, sort_window_tokens=args.sort_window_tokens,
                        max_seq_len=2 * max(len(json.loads(x)["input_ids"]) for x in lines),
                        num_writers=args.num_writers, device=str(device), progress=False,
                        top1_share=args.top1_share, store_topk=args.store_topk)
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


def print_table(rows: list, stop_rates: list[float], full_rates: list[float], own_rate: float, raw: int,
                full_label: str) -> None:
    """The figures: tokens/s of each row against the two reference forwards around it."""
    print("\nstop-after-last-layer forward, measured before and after each extraction: "
          + ", ".join(f"{r:,.0f}" for r in stop_rates) + " tokens/s")
    print(f"{full_label} (full-fwd), the same: " + ", ".join(f"{r:,.0f}" for r in full_rates) + " tokens/s")
    print(f"{'what':52s} {'tokens/s':>10s} {'vs stop-fwd':>11s} {'vs full-fwd':>11s} {'vs own batches':>14s} "
          f"{'GPU util':>9s} {'bytes/token':>12s}")
    for name, tps, util, bpt, ref, full in rows:
        util_s = f"{util:.0f}%" if util is not None else "-"
        bpt_s = f"{bpt:,.0f}" if bpt is not None else "-"
        own_s = f"{tps / own_rate:.3f}x" if name.startswith("full") else "-"
        full_s = f"{tps / full:.3f}x" if full else "-"
        print(f"{name:52s} {tps:10,.0f} {tps / ref:10.3f}x {full_s:>11s} {own_s:>14s} {util_s:>9s} {bpt_s:>12s}")
    print(f"(raw bf16 would be {raw:,} bytes/token; targets: an extraction without top-k >= 0.95x stop-fwd, one "
          "with top-k >= 0.95x full-fwd; 'vs own batches': against the stop-forward over the batches the "
          "extraction runs, padding included, in real tokens/s)")


OLD_TOPK = "+old"
"""The end of a --codecs entry that runs its extraction with the old top-k formula."""


def parse_topk(entry: str) -> tuple[str, int | None]:
    """A --codecs entry's own --store-topk ('bf16@8'; None for the flag's) and the entry without it
    (and without a '+old' at its end)."""
    rest, sep, k = entry.removesuffix(OLD_TOPK).partition("@")
    if not sep:
        return rest, None
    if not k.isdigit():
        raise SystemExit(f"--codecs entry {entry!r}: after '@' comes the top-k to store, e.g. 'bf16@8'")
    return rest, int(k)


def parse_codec(entry: str) -> tuple[str, float | None]:
    """A --codecs entry: the codec and its own --top1-share ('bf16:0'), None for the flag's; an
    '@K' at its end is its own --store-topk (parse_topk)."""
    codec, sep, share = parse_topk(entry)[0].partition(":")
    if not sep:
        return codec, None
    try:
        value = float(share)
    except ValueError:
        raise SystemExit(f"--codecs entry {entry!r}: after ':' comes a top-1 share between 0 and 1, "
                         f"e.g. 'bf16:0'") from None
    if not 0.0 <= value <= 1.0:
        raise SystemExit(f"--codecs entry {entry!r}: the top-1 share must be between 0 and 1")
    return codec, value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", required=True, help="Scratch directory for data and caches (e.g. /dev/shm/x).")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                    help="Target shape [8b]: 8b (dense Qwen3-8B), 27b-dense (a dense Qwen3 of Qwen3.6-27B's "
                         "size), 27b-hybrid (Qwen3.6-27B: linear attention in 3 layers of 4).")
    ap.add_argument("--small", action="store_true",
                    help="Tiny model of the --shape's architecture and tiny data (CPU smoke run).")
    ap.add_argument("--json", help="Also write the figures (the last line of the output) to this file.")
    ap.add_argument("--tokens", type=int, help="Tokens to extract [1M; 27b shapes: 256K; small: 16K].")
    ap.add_argument("--seq-len", type=int, help="Typical sample length [2048; small: 256].")
    ap.add_argument("--forward-tokens", type=int,
                    help="Tokens for the forward-only figures [256K; 27b shapes: 128K; small: 8K].")
    ap.add_argument("--token-budget", type=int, default=32768)
    ap.add_argument("--part-tokens", type=int, default=32768)
    ap.add_argument("--sort-window-tokens", type=int, default=1 << 20,
                    help="dflash-extract's sort window [1M: what the default 64K-token parts get; "
                         "16 x --part-tokens would be 512K here]. Larger windows, less padding.")
    ap.add_argument("--num-writers", type=int, help="Writer processes [default of dflash-extract].")
    ap.add_argument("--top1-share", type=float, default=ExtractConfig.top1_share,
                    help="dflash-extract's --top1-share: the share of samples whose target top-1 is stored "
                         "(their rows run on to the last layer and the head) [its default, "
                         f"{ExtractConfig.top1_share}]; 1: every sample, 0: none.")
    ap.add_argument("--store-topk", type=int, default=0,
                    help="dflash-extract's --store-topk for every entry without its own '@K' [0: the capture "
                         f"alone; dflash-extract's default is {ExtractConfig.store_topk}, whose cost 'bf16,bf16@"
                         f"{ExtractConfig.store_topk}' shows side by side].")
    ap.add_argument("--codecs", default="bf16,fp8",
                    help="Codecs to extract with; 'bf16-staged' adds a bf16 run through the host-copy "
                         "fallback (DFLASH_EXTRACT_STAGED_COPY=1) for comparison; 'CODEC:SHARE' runs that "
                         "codec at --top1-share SHARE (e.g. 'bf16,bf16:0': what storing the top-1 costs, "
                         "side by side); 'CODEC@K' stores the top-K log-probs too (--store-topk K); a '+old' "
                         "at the end of an entry (e.g. 'bf16@8+old') runs it with the top-k formula before the "
                         "chunk reduction (float32 log_softmax of the whole vocabulary), to compare old and new "
                         "in one process. The full-fwd reference reduces to the largest K of the entries (8 if "
                         "none has one).")
    ap.add_argument("--trace-tokens", type=int, default=0,
                    help="Also extract this many tokens (bf16) under torch.profiler and print where the "
                         "host and the GPU spend their time.")
    ap.add_argument("--check-samples", type=int, default=4,
                    help="Samples of each cache compared with a single-sample forward (catches rows "
                         "landing in the wrong place).")
    return ap


CHECK_LIMITS = {"fp8": 0.08, "nf4": 0.2}
"""Relative error a cache may show against a single-sample forward beyond what batching alone
moves (others: 0.03; `check_passes`)."""


class Bench:
    """One target on one device, its forward batches and its data file: the measurements."""

    def __init__(self, args, architecture: str, shape: dict, device: torch.device, out: Path):
        self.args, self.architecture, self.shape, self.device, self.out = args, architecture, shape, device, out
        small = args.small
        big = shape["hidden_size"] > FULL["hidden_size"]
        self.tokens = args.tokens or (16384 if small else (1 << 18 if big else 1 << 20))
        self.seq_len = args.seq_len or (256 if small else 2048)
        self.fwd_tokens = args.forward_tokens or (8192 if small else (1 << 17 if big else 1 << 18))
        self.budget = min(args.token_budget, 4096) if small else args.token_budget
        self.label = f"<in-memory {args.shape}-shaped {architecture}>"
        self._reducers: dict[int, object] = {}
        warnings = FallbackWarnings()
        logging.getLogger("transformers").addHandler(warnings)
        try:
            t = time.perf_counter()
            self.model = build_model(build_config(architecture, shape), device)
            sync(device)
            self.build_seconds = time.perf_counter() - t
            print(f"model: {architecture} {shape} on {device}, built in {self.build_seconds:.1f}s")
            self.layer_ids = default_target_layer_ids(shape["num_hidden_layers"], 5)
            self.data = out / "bench-data.jsonl"
            n = write_data(self.data, self.tokens, self.seq_len, shape["vocab_size"])
            print(f"data: {n} samples of ~{self.seq_len} tokens ({self.tokens} tokens), layers {self.layer_ids}; "
                  f"token budget {self.budget}, parts of {args.part_tokens} tokens, sort window "
                  f"{args.sort_window_tokens} tokens, top-1 for a share {args.top1_share:g} of the samples")
            per_batch = max(1, self.budget // self.seq_len)
            gen = torch.Generator().manual_seed(0)
            self.batches = [torch.randint(0, shape["vocab_size"], (per_batch, self.seq_len), generator=gen).to(device)
                            for _ in range(max(1, self.fwd_tokens // (per_batch * self.seq_len)))]
            # The first forward runs here: the kernel choice is logged then (older transformers: at build).
            self.prefill = self.prefill_rate()
            print(f"prefill: {self.prefill:,.0f} tokens/s (at {time.perf_counter() - t:.0f} s)", flush=True)
        finally:
            logging.getLogger("transformers").removeHandler(warnings)
        self.kernels = linear_attention_kernels(self.model, warnings.messages)
        if self.kernels:
            print(f"linear attention: {self.kernels['path']} ({json.dumps(self.kernels)})", flush=True)

    def config(self, data_file: Path, cache: Path, codec: str, top1_share: float | None = None,
               store_topk: int | None = None) -> ExtractConfig:
        a = self.args
        return ExtractConfig(store_topk=a.store_topk if store_topk is None else store_topk,target_model=self.label, data=str(data_file), output=str(cache), codec=codec,
                             target_layer_ids=self.layer_ids, token_budget=self.budget, part_tokens=a.part_tokens,
                             sort_window_tokens=a.sort_window_tokens, max_seq_len=self.seq_len * 2,
                             num_writers=a.num_writers, device=str(self.device), progress=False,
                             top1_share=a.top1_share if top1_share is None else top1_share)

    def prefill_rate(self) -> float:
        with torch.inference_mode():
            return time_forward(lambda ids: self.model(ids, logits_to_keep=1), self.batches, self.device)

    def stop_forward_rate(self, batches: list[torch.Tensor] | None = None) -> float:
        with torch.inference_mode():
            capture = LayerCapture(self.model, self.layer_ids, need_last=False)
            try:
                return time_forward(lambda ids: capture(ids, None), batches or self.batches, self.device)
            finally:
                capture.close()

    def full_forward_rate(self, topk: int, formula=next_token_outputs) -> float:
        """The forward through every layer, the final norm and the head over every token, reduced
        to the top-`topk` log-probs (0: the logits thrown away) by `formula` (the old one:
        bench_topk.old_next_token_outputs), in tokens/s: what an extraction storing the top-k
        computes, without the capture, the packing, the encoding and the copies. The reduction
        is compiled as ExtractionEngine compiles it."""
        reduce = self.reducer(topk) if topk else None
        with torch.inference_mode():
            capture = LayerCapture(self.model, self.layer_ids, need_last=True)

            def forward(ids: torch.Tensor):
                last = capture(ids, None).last_hidden
                last = last.reshape(-1, last.shape[-1])
                return (formula(self.model, last, topk=topk, reduce=reduce) if topk
                        else head_alone(self.model, last))
            try:
                return time_forward(forward, self.batches, self.device)
            finally:
                capture.close()

    def reducer(self, topk: int):
        """The head's top-k reduction as the extraction runs it (compiled on a GPU), once per k."""
        if topk not in self._reducers:
            reduce = head_reducer(self.model, topk=topk, top1=False)
            if self.device.type == "cuda":
                head = self.model.get_output_embeddings().weight
                reduce = _compiled_head(reduce, self.device, int(head.shape[0]), head.dtype)
            self._reducers[topk] = reduce
        return self._reducers[topk]

    def own_batches_rate(self) -> float:
        """The same forward over the very batches the extraction runs (its windows, lengths and
        padding), in real tokens/s: extraction / this is the part of the host side not hidden."""
        own, real = extraction_batches(self.config(self.data, self.out / "unused", "bf16"),
                                       self.shape["vocab_size"], self.device)
        return self.stop_forward_rate(own) * real / sum(b.numel() for b in own)

    def extract(self, name: str) -> tuple[object, float | None, dict[str, float]]:
        """One extraction with codec `name` (its cache checked, then deleted): the summary, the GPU
        utilisation over its timed span and the check's largest relative error per captured layer."""
        codec, share = parse_codec(name)
        codec, staged = codec.removesuffix("-staged"), codec.endswith("-staged")
        cache = self.out / f"bench-cache-{name.replace(':', '-').replace('@', '-top').replace('+', '-')}"
        shutil.rmtree(cache, ignore_errors=True)
        cfg = self.config(self.data, cache, codec, share, parse_topk(name)[1])
        if staged:
            os.environ[STAGED_COPY_ENV] = "1"
        if name.endswith(OLD_TOPK):  # the engine's head with the formula before the chunk reduction
            extraction_engine.next_token_outputs = old_next_token_outputs
        try:
            with GpuSampler(self.device) as gpu:
                summary = run_extraction(cfg, model=self.model)
                returned = time.perf_counter()
        finally:
            os.environ.pop(STAGED_COPY_ENV, None)
            extraction_engine.next_token_outputs = next_token_outputs
        # GPU utilisation over the timed span only (first batch to last commit): start-up
        # (writers, page-locking, compiling) and shutdown leave the GPU idle and are not timed.
        end = returned - summary.teardown_seconds
        util = gpu.mean_between(end - summary.seconds, end)
        print(summary.format())
        per_layer, floor = check_cache(cache, self.model, self.layer_ids, self.args.check_samples, self.device)
        print(f"check: {self.args.check_samples} samples of the {name} cache vs a single-sample forward: "
              f"max relative error {max(per_layer):.4f} (per layer, cache / batched forward without a cache: " +
              ", ".join(f"{layer}: {e:.4f} / {f:.4f}" for layer, e, f in zip(self.layer_ids, per_layer, floor)) +
              ")", flush=True)
        shutil.rmtree(cache, ignore_errors=True)
        return summary, util, dict(zip(map(str, self.layer_ids), per_layer)), dict(zip(map(str, self.layer_ids), floor))


def main() -> None:
    args = build_parser().parse_args()
    for entry in args.codecs.split(","):  # a bad entry stops here, before minutes of model building
        parse_codec(entry)
    architecture, full_shape, small_shape = SHAPES[args.shape]
    shape = small_shape if args.small else full_shape
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(args, architecture, shape, device, out)
    layer_ids = b.layer_ids
    # The two reference forwards (stop-fwd and full-fwd) are measured before and after every
    # extraction, and each extraction is compared with the mean of the two measurements around
    # it: the GPU's clocks drift over minutes of load (thermals), which a single measurement at
    # the start would bias.
    entries = args.codecs.split(",")
    topks = [parse_topk(e)[1] if parse_topk(e)[1] is not None else args.store_topk for e in entries]
    ref_k = max(topks) or ExtractConfig.store_topk  # the full-fwd reference's top-k
    full_label = f"forward + head + top-{ref_k} over every token"
    stop_rates = [b.stop_forward_rate()]
    print(f"forward stopping after layer {max(layer_ids)}: {stop_rates[0]:,.0f} tokens/s", flush=True)
    full_rates = [b.full_forward_rate(ref_k)]
    print(f"{full_label}: {full_rates[0]:,.0f} tokens/s", flush=True)
    head_rate = b.full_forward_rate(0)
    print(f"forward + head over every token, no top-k: {head_rate:,.0f} tokens/s", flush=True)
    rows = [("prefill model(ids, logits_to_keep=1)", b.prefill, None, None, stop_rates[0], full_rates[0]),
            (f"forward stopping after layer {max(layer_ids)}", stop_rates[0], None, None, stop_rates[0],
             full_rates[0]),
            (full_label, full_rates[0], None, None, stop_rates[0], full_rates[0]),
            ("forward + head over every token, no top-k", head_rate, None, None, stop_rates[0], full_rates[0])]
    old_rate = None
    if any(e.endswith(OLD_TOPK) for e in entries):
        old_rate = b.full_forward_rate(ref_k, old_next_token_outputs)
        print(f"{full_label}, the old top-k formula: {old_rate:,.0f} tokens/s = {old_rate / full_rates[0]:.3f}x "
              "of the new", flush=True)
        rows.append((f"{full_label}, old formula", old_rate, None, None, stop_rates[0], full_rates[0]))
    own_rate = b.own_batches_rate()
    print(f"  the stop-forward over the extraction's own batches: {own_rate:,.0f} tokens/s", flush=True)
    rows.append(("  stop-fwd over the extraction's own batches", own_rate, None, None, stop_rates[0], None))
    raw = len(layer_ids) * shape["hidden_size"] * 2
    result = {"bench": "extract", "shape": args.shape, "small": args.small, "architecture": architecture,
              "dims": shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "build_seconds": b.build_seconds, "target_layer_ids": layer_ids, "top1_share": args.top1_share,
              "tokens": b.tokens, "seq_len": b.seq_len, "token_budget": b.budget, "linear_attention": b.kernels,
              "prefill_tokens_per_second": b.prefill, "own_batches_tokens_per_second": own_rate,
              "raw_bytes_per_token": raw, "extract": {}, "stop_forward_tokens_per_second": stop_rates,
              "full_forward_topk": ref_k, "full_forward_tokens_per_second": full_rates,
              "head_forward_tokens_per_second": head_rate, "full_forward_old_topk_tokens_per_second": old_rate}

    def write_json() -> None:  # after every codec too: a run stopped later keeps what it measured
        if device.type == "cuda":
            result["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if args.json:
            Path(args.json).write_text(json.dumps(result) + "\n")

    write_json()
    failed = []
    for entry, topk in zip(entries, topks):
        summary, util, per_layer, floor = b.extract(entry)
        name, n = entry, 1
        while name in result["extract"]:  # an entry again (before and after another): its own row
            n += 1
            name = f"{entry}#{n}"
        err = max(per_layer.values())
        stop_rates.append(b.stop_forward_rate())
        full_rates.append(b.full_forward_rate(ref_k))
        around = (stop_rates[-2] + stop_rates[-1]) / 2
        full_around = (full_rates[-2] + full_rates[-1]) / 2
        bpt = summary.bytes / max(summary.tokens, 1)
        rows.append((f"full extraction, codec {name}", summary.tokens_per_second, util, bpt, around,
                     full_around if topk else None))
        result["extract"][name] = {
            "tokens": summary.tokens, "seconds": summary.seconds, "tokens_per_second": summary.tokens_per_second,
            "vs_stop_forward": summary.tokens_per_second / around,
            "vs_full_forward": summary.tokens_per_second / full_around if topk else None,
            "vs_own_batches": summary.tokens_per_second / own_rate,
            "gpu_util_percent": util, "bytes_per_token": bpt, "check_max_relative_error": err,
            "check_relative_error_per_layer": per_layer, "batched_forward_relative_error_per_layer": floor,
            "top1_share": args.top1_share if parse_codec(entry)[1] is None else parse_codec(entry)[1],
            "store_topk": topk, "old_topk_formula": entry.endswith(OLD_TOPK)}
        limit = CHECK_LIMITS.get(parse_codec(entry)[0].removesuffix("-staged"), 0.03)
        if not check_passes(list(per_layer.values()), list(floor.values()), limit):
            failed.append(f"cache {name} does not match the target's states (error {err:.3f}; limit {limit} "
                          f"plus twice the batched forward's own error per layer: "
                          f"{', '.join(f'{v:.3f}' for v in floor.values())})")
        write_json()

    if args.trace_tokens:
        traced_extraction(out, b.data, args.trace_tokens, layer_ids, b.budget, args, device, b.model, b.label)

    print_table(rows, stop_rates, full_rates, own_rate, raw, full_label)
    b.data.unlink()
    write_json()
    print(json.dumps(result), flush=True)
    if failed:
        raise SystemExit("; ".join(failed))


if __name__ == "__main__":
    main()
