"""Training throughput of a Qwen3-8B- or Qwen3.6-27B-shaped drafter through the real trainer (loop, loader,
workers).

Writes a synthetic target (config.json + embed_tokens/lm_head/norm only, random bf16) and a
synthetic bf16 cache under --workdir, runs `dflash.train.run.loop.train` on it, and prints context
tokens/s, achieved model FLOP/s and its fraction of the bf16 peak, the data-wait fraction and
peak GPU memory.

    python bench/bench_train.py --workdir /dev/shm/dflash-bench            # one H200
    python bench/bench_train.py --small --workdir /tmp/dflash-bench-small  # CPU smoke run
    torchrun --standalone --nproc_per_node 2 bench/bench_train.py --workdir /dev/shm/b2   # 2 GPUs, DDP
    python bench/bench_train.py --shape 27b --workdir /dev/shm/b27 --json /dev/shm/train27.json
    python bench/bench_train.py --drafter-type dflash,dflash2 --samples 16 --steps 8 --warmup-steps 4
                                       # both drafters in turn in one process, on the same cache, side by side
Under torchrun each process trains its own sequence per step; tokens/s are totals and the
fraction of peak is per GPU.

Model FLOPs per sample (T context tokens, A anchors, B block size, Q = A*B block tokens, L draft
layers, D hidden, K target layers, Hq/Hkv heads of width d, I MLP width, V vocab); forward
counts, times 3 for a trained matmul (forward + input grad + weight grad), times 2 where one
gradient is not needed:
  fc         2*T*(K*D)*D                         x2 (its input, the cache, needs no grad)
  context kv L * 2*T*D*(2*Hkv*d)                 x3
  block qkvo L * 2*Q*D*(2*Hq*d + 2*Hkv*d)        x3
  mlp        L * 2*Q*3*D*I                       x3
  attention  sum over layers 4*Q*Hq*d*keys       x3 (keys a block query actually sees, the
                                                     block-sparse mask's visible pairs: the context
                                                     before its anchor, averaged over the positions
                                                     anchors are drawn from (the completion), plus
                                                     its block; a sliding layer of window W sees
                                                     min(anchor, W - 1 - slot) context keys, a
                                                     causal one slot + 1 block keys: `visible_keys`)
  lm_head    2*A*(B-1)*D*V                       x2 (frozen: input grad only)

Long samples: --shape 8b-8k / 8b-32k (27b-8k / 27b-32k) train one 8,192- or 32,768-token sample a
step (512 anchors of 16: the block side is the 3,072-token shape's, the context grows), and
--sliding-window 0,2048 trains each drafter with full layers (0) and with sliding ones of 2,048
tokens (the trainer's --draft-layer-types sliding --draft-sliding-window 2048), in turn:

    python bench/bench_train.py --shape 8b-32k --drafter-type dflash,dflash2 --sliding-window 0,2048 \
        --steps 6 --warmup-steps 3 --workdir /dev/shm/b32k

Each run's peak GPU memory is printed beside the trainer's estimate of it (train/run/memory.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from profiling import device_busy_seconds

PEAK_FLOPS = 790e12  # measured bf16 dense peak of one H200
TOPK = 8
"""The synthetic cache holds the target's top-8 log-probs of every token, as dflash-extract's default
does, so each run trains with the default soft labels."""


@dataclass
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    target_layers: int
    draft_layers: int
    block_size: int
    anchors: int
    seq_len: int


FULL = Shape(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
             target_layers=36, draft_layers=5, block_size=16, anchors=512, seq_len=3072)
SMALL = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
              target_layers=8, draft_layers=2, block_size=8, anchors=32, seq_len=256)
# The drafter of bench/quality (a 384-wide byte-level target of 6 layers, layers 0/2/4 captured):
# 64 samples of 256 tokens per step, ~160 completion tokens each, so ~10K blocks of 16 per step.
QUALITY = Shape(hidden=384, heads=6, kv_heads=2, head_dim=64, intermediate=1024, vocab=260,
                target_layers=6, draft_layers=5, block_size=16, anchors=512, seq_len=256)
# The drafter of the BPE quality benchmark (bench/quality, its default sizes): the same 384-wide target of 6
# layers over a learned vocabulary of 8,192 ids; 64-128-token prompts and 160-token completions, 64 a step.
QUALITY_BPE = Shape(**{**QUALITY.__dict__, "vocab": 8192})
# The drafter of a Qwen3.6-27B target: its draft layers take the target's dimensions (hidden 5120, 24/4 heads
# of 256, MLP 17408; vocab 248,320, 64 target layers), one 3072-token sample per step as for 8b. The synthetic
# target is a Qwen3 config of those dimensions: the trainer reads only its embedding, lm_head and final norm.
TARGET_27B = Shape(hidden=5120, heads=24, kv_heads=4, head_dim=256, intermediate=17408, vocab=248320,
                   target_layers=64, draft_layers=5, block_size=16, anchors=512, seq_len=3072)
# The 8B drafter on chat-like data: 32 samples of 512 tokens per step (the trainer's default token
# budget of 16,384), 40 % prompt, so ~9.8K anchors and ~147K scored slots a step, against the
# 7.7K of one long sample: the shape where the head's logits outgrow the GPU unless chunked.
CHAT_8B = Shape(**{**FULL.__dict__, "seq_len": 512})
# Long samples: one sample of 8,192 or 32,768 tokens a step, 512 anchors (the trainer's default --max-anchors),
# so the block side is the 3,072-token shape's and the context (fc, its keys/values, attention) grows.
LONG = {f"{name}-{k}k": Shape(**{**shape.__dict__, "seq_len": k * 1024}) for name, shape in
        (("8b", FULL), ("27b", TARGET_27B)) for k in (8, 32)}
# The long shapes' smoke run on the CPU: one 2,048-token sample of the small drafter, 32 anchors.
SMALL_LONG = Shape(**{**SMALL.__dict__, "seq_len": 2048})
LAYER_IDS = {36: [1, 9, 17, 25, 33], 64: [1, 16, 31, 46, 61], 8: [1, 2, 3, 4, 5], 6: [0, 2, 4]}
SHAPES = {"8b": FULL, "8b-chat": CHAT_8B, "27b": TARGET_27B, "quality": QUALITY, "quality-bpe": QUALITY_BPE,
          "small": SMALL, "small-long": SMALL_LONG, **LONG}
BATCH = {"8b": 1, "8b-chat": 32, "27b": 1, "quality": 64, "quality-bpe": 64, "small": 1, "small-long": 1,
         **dict.fromkeys(LONG, 1)}
"""Samples per step (a token budget of BATCH x seq_len)."""
PROMPT = {"8b": 0.1, "8b-chat": 0.4, "27b": 0.1, "quality": 96 / 256, "quality-bpe": 96 / 256, "small": 0.1,
          "small-long": 0.1, **dict.fromkeys(LONG, 0.1)}
"""Share of each sample that is prompt (loss mask 0)."""
CPU_SHAPES = ("small", "small-long")
"""Shapes that run on the CPU (smoke runs of the bench)."""


def visible_keys(context: int, prompt: float, block_size: int, window: int | None = None,
                 causal: bool = False) -> float:
    """Keys one block query sees under the training mask (train/model/attention.py), averaged over its
    slot and over the anchor positions p the trainer draws from (every completion position with a
    completion token after it: p in [prompt, context - 2], uniformly): the context keys j < p (within
    the window: j > p + slot - W), plus its own block's keys (slot + 1 of them when causal; within
    the window too)."""
    first = int(context * prompt)
    p = np.arange(first, max(first + 1, context - 1), dtype=np.float64)[:, None]  # [positions, 1]
    slot = np.arange(block_size, dtype=np.float64)[None, :]  # [1, slots]
    seen = p if window is None else np.minimum(p, np.maximum(0.0, window - 1 - slot))
    block = slot + 1 if causal else np.full_like(slot, block_size)
    if window is not None:
        block = np.minimum(block, window) if causal else block - np.maximum(0.0, slot - window + 1)
    return float((seen + block).mean())


def flops_per_sample(s: Shape, context: int, anchors: int, dflash2: dict | None = None, *, prompt: float = 0.0,
                     layers: list[tuple[int | None, bool]] | None = None) -> float:
    """Model FLOPs of one sample of `context` tokens and `anchors` blocks (module docstring); `prompt`
    is the share of the sample anchors are not drawn from, `layers` each draft layer's (window,
    causal) (default: all full and bidirectional)."""
    k = len(LAYER_IDS[s.target_layers])
    q = anchors * s.block_size
    d, hq, hd = s.hidden, s.heads, s.head_dim
    hkv = s.kv_heads
    fc = 2 * context * k * d * d * 2
    ctx_kv = s.draft_layers * 2 * context * d * 2 * hkv * hd * 3
    block = s.draft_layers * 2 * q * d * (2 * hq * hd + 2 * hkv * hd) * 3
    mlp = s.draft_layers * 2 * q * 3 * d * s.intermediate * 3
    kinds = layers or [(None, False)] * s.draft_layers
    attention = sum(4 * q * hq * hd * visible_keys(context, prompt, s.block_size, w, c) * 3 for w, c in kinds)
    lm_head = 2 * anchors * (s.block_size - 1) * d * s.vocab * 2
    return float(fc + ctx_kv + block + mlp + attention + lm_head + dflash2_flops(s, anchors, dflash2))


def dflash2_flops(s: Shape, anchors: int, config: dict | None) -> float:
    """DFlash2's extra model FLOPs per sample: the kernel projection and taps of the two convolutions
    around each sublayer, the selector's hidden projection and K+1 candidate edges per scored slot
    (the top-K and the K-way loss add no matrix work); 0 for DFlash (`config` None)."""
    if not config:
        return 0.0
    q, slots, d = anchors * s.block_size, anchors * (s.block_size - 1), s.hidden
    taps, groups, rank, k = (config["conv_kernel_size"], d // config["conv_group_size"], config["selector_rank"],
                             config["selector_top_k"])
    conv = s.draft_layers * 2 * (2 * q * d * 2 * taps * groups + 2 * 2 * taps * q * d) * 3
    selector = (2 * slots * d * rank + 2 * slots * (k + 1) * rank * 2) * 3
    return float(conv + selector)


def write_target(path: Path, s: Shape) -> None:
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    path.mkdir(parents=True, exist_ok=True)
    Qwen3Config(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                head_dim=s.head_dim, intermediate_size=s.intermediate, vocab_size=s.vocab,
                num_hidden_layers=s.target_layers, max_position_embeddings=40960,
                tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"]).save_pretrained(str(path))
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(s.vocab, s.hidden, generator=g).to(torch.bfloat16),
        "lm_head.weight": (torch.randn(s.vocab, s.hidden, generator=g) / s.hidden**0.5).to(torch.bfloat16),
        "model.norm.weight": torch.ones(s.hidden, dtype=torch.bfloat16),
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _header(s: Shape) -> dict:
    from dflash.cache_tools.codecs import HiddenCodec
    from dflash.cache_tools.manifest import make_header

    return make_header(
        target={"path": "synthetic", "architecture": "Qwen3ForCausalLM", "hidden_size": s.hidden,
                "num_hidden_layers": s.target_layers, "vocab_size": s.vocab},
        target_layer_ids=LAYER_IDS[s.target_layers], hidden_size=s.hidden, codec=HiddenCodec(name="bf16"),
        data={"name": "synthetic"}, topk=TOPK,
    )


def _write_part(args: tuple[str, Shape, int, int, float, int]) -> int:
    from dflash.cache_tools.writer import CacheWriter

    cache, s, part, samples, prompt, per_part = args
    torch.set_num_threads(1)
    writer = CacheWriter(cache, _header(s))
    g = torch.Generator().manual_seed(part)
    width = len(LAYER_IDS[s.target_layers]) * s.hidden
    base = torch.randn(s.seq_len + samples, width, generator=g, dtype=torch.bfloat16)
    with writer.part_writer(f"part-{part:06d}") as pw:
        for i in range(samples):
            ids = torch.randint(0, s.vocab - 1, (s.seq_len,), generator=g)
            mask = torch.ones(s.seq_len, dtype=torch.uint8)
            mask[: int(s.seq_len * prompt)] = 0  # a prompt, then the completion
            # the target's top-8 log-probs of each token, as the default extraction stores them (soft labels)
            top_ids = torch.randint(0, s.vocab - 1, (s.seq_len, TOPK), generator=g, dtype=torch.int32)
            top_lp = torch.log_softmax(torch.randn(s.seq_len, TOPK, generator=g), -1).sort(-1, descending=True).values
            pw.add_sample(part * per_part + i, ids, mask, base[i:i + s.seq_len], topk_ids=top_ids, topk_logprobs=top_lp)
    return samples


def write_cache(path: Path, s: Shape, samples: int, per_part: int, writers: int, prompt: float) -> None:
    from dflash.cache_tools.writer import CacheWriter

    CacheWriter(path, _header(s))  # create it once, before the writers open it
    # parts of `per_part` samples, the last one holding the rest (--samples 4 of a long shape: one part of 4)
    jobs = [(str(path), s, p, min(per_part, samples - p * per_part), prompt, per_part)
            for p in range(-(-samples // per_part))]
    with multiprocessing.get_context("fork").Pool(writers) as pool:
        pool.map(_write_part, jobs)


def traced_train(config, *, skip: int, warm: int, active: int) -> None:
    """train(config) under torch.profiler: steps skip+warm+1 .. skip+warm+active are recorded."""
    from dflash.train.run import loop
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = torch.cuda.is_available() and config.runtime.device != "cpu"
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                   schedule=schedule(wait=skip, warmup=warm, active=active, repeat=1))
    stamps: list[float] = []
    advance = loop.RunLogger.advance

    def stepping(self, n, **kw):
        advance(self, n, **kw)
        if n:
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            prof.step()

    loop.RunLogger.advance = stepping
    try:
        with prof:
            loop.train(config)
    finally:
        loop.RunLogger.advance = advance
    wall = stamps[skip + warm + active - 1] - stamps[skip + warm - 1]
    events = prof.key_averages()
    busy = device_busy_seconds(prof)
    for sort in ("self_device_time_total", "self_cpu_time_total"):
        try:
            print(events.table(sort_by=sort, row_limit=25), flush=True)
        except Exception:
            print(events.table(sort_by=sort.replace("device", "cuda"), row_limit=25), flush=True)
    calls = {e.key: e.count for e in events}
    launches = sum(n for k, n in calls.items() if "LaunchKernel" in k or "cuLaunch" in k or "GraphLaunch" in k)
    syncs = sum(n for k, n in calls.items() if "Synchronize" in k)
    copies = sum(n for k, n in calls.items() if k.startswith("cudaMemcpy"))
    print(f"traced {active} steps: wall {wall / active * 1e3:.1f} ms/step, GPU kernels "
          f"{busy / active * 1e3:.1f} ms/step (union of kernel intervals), GPU busy {busy / wall:.1%} of the "
          f"wall time; per step {launches / active:.0f} kernel launches, {syncs / active:.1f} synchronizations, "
          f"{copies / active:.1f} cudaMemcpy calls", flush=True)


def summarize(run: Path, config: Any, shape: Any, shape_name: str, *, warmup: int, steps: int,
              world: int) -> dict[str, Any]:
    """The measured steps' figures from the run's metrics.jsonl."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in records if r["kind"] == "train" and warmup < r["step"] <= warmup + steps]
    seconds = sum(r["seconds_per_step"] * config.logging.log_interval for r in measured)
    n = len(measured) * config.logging.log_interval
    step_time = seconds / n
    context = sum(r["context_tokens_per_second"] * r["seconds_per_step"] * config.logging.log_interval for r in measured) / n
    anchors = sum(r["block_tokens_per_second"] * r["seconds_per_step"] * config.logging.log_interval
                  for r in measured) / n / shape.block_size
    samples = sum(r["samples_per_second"] * r["seconds_per_step"] * config.logging.log_interval for r in measured) / n
    # The logged counts are over all processes and samples; attention is per sample (its own context).
    dflash2 = ({k: getattr(config.model, k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k")} if config.model.drafter_type == "dflash2" else None)
    layers = [(config.model.draft_sliding_window if t == "sliding_attention" else None,
               (t == "sliding_attention") if config.model.draft_causal is None else config.model.draft_causal)
              for t in parse_types(config.model.draft_layer_types, config.model.num_draft_layers)]
    flops = samples * flops_per_sample(shape, int(round(context / samples)), int(round(anchors / samples)), dflash2,
                                       prompt=PROMPT[shape_name], layers=layers)
    wait = sum(r["data_wait"] * r["seconds_per_step"] for r in measured) / sum(r["seconds_per_step"] for r in measured)
    result = {
        "shape": {"small": "small (CPU)", "8b": "Qwen3-8B drafter (5 layers), K=5, B=16",
                  "8b-chat": "Qwen3-8B drafter (5 layers), K=5, B=16, 32 x 512 tokens (40 % prompt)",
                  "27b": "Qwen3.6-27B drafter (hidden 5120, 5 layers), K=5, B=16",
                  "quality": "bench/quality drafter (hidden 384, 5 layers), K=3, B=16, 64 x 256 tokens",
                  "quality-bpe": "bench/quality BPE drafter (hidden 384, 5 layers, 8,192 ids), K=3, B=16, "
                                 "64 x 256 tokens",
                  "small-long": "small (CPU), one 2,048-token sample",
                  **{name: f"{'Qwen3-8B' if name.startswith('8b') else 'Qwen3.6-27B'} drafter (5 layers), K=5, B=16, "
                           f"one {SHAPES[name].seq_len:,}-token sample, 512 anchors" for name in LONG}}[shape_name],
        "drafter_type": config.model.drafter_type,
        "compile": config.runtime.compile, "compile_mode": config.runtime.compile_mode, "steps_per_second": 1 / step_time,
        "processes": world,
        "samples_per_step": samples, "context_tokens_per_step": context, "anchors_per_step": anchors,
        "seconds_per_step": step_time, "context_tokens_per_second": context / step_time,
        # a measured step that compiled again (a new batch shape) shows as a mean far above the median
        "median_seconds_per_step": statistics.median(r["seconds_per_step"] for r in measured),
        "model_tflop_per_step": flops / 1e12, "model_tflops": flops / step_time / 1e12,
        "fraction_of_peak": flops / step_time / (PEAK_FLOPS * world),
        "context_tokens_per_second_per_process": context / step_time / world, "data_wait_fraction": wait,
        "peak_gpu_memory_gib": max(r["gpu_mem_gib"] for r in measured),
        "log_interval": config.logging.log_interval,
        "draft_layer_types": config.model.draft_layer_types, "draft_sliding_window": config.model.draft_sliding_window,
        "estimated_gpu_memory_gib": estimated_memory(config, shape, samples, context, anchors, world) / 2**30,
    }
    return result


def estimated_memory(config: Any, shape: Shape, samples: float, context: float, anchors: float, world: int) -> float:
    """The trainer's estimate (train/run/memory.py) of a step's peak GPU memory for the measured batches."""
    from dflash.train.heads import get_head
    from dflash.train.run.memory import Dims, MicroBatch, estimate_step_memory

    m = config.model
    types = parse_types(m.draft_layer_types, m.num_draft_layers)
    dims = Dims(hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                intermediate=shape.intermediate, vocab=shape.vocab, context_layers=len(LAYER_IDS[shape.target_layers]),
                draft_layers=shape.draft_layers, block_size=shape.block_size, drafter_type=m.drafter_type,
                settings=tuple((n, getattr(m, n)) for n in get_head(m.drafter_type).setting_names),
                layer_attention=tuple((m.draft_sliding_window if t == "sliding_attention" else None,
                                       (t == "sliding_attention") if m.draft_causal is None else m.draft_causal)
                                      for t in types))
    per_process = max(1, round(samples / world))
    batch = MicroBatch(samples=per_process, tokens=int(round(context / samples)), anchors=int(round(anchors / world)))
    backend = "sdpa" if config.runtime.device == "cpu" or m.attention_backend == "sdpa" else "flex"
    return estimate_step_memory(dims, batch, backend=backend, logits_chunk_mib=config.objective.logits_chunk_mib,
                                gradient_checkpointing=config.runtime.gradient_checkpointing,
                                compiled=config.runtime.compile is not False, world_size=world,
                                parallel=config.runtime.parallel).total


def parse_types(types: str, layers: int) -> list[str]:
    from dflash.train.model.layer_types import parse_layer_types

    return parse_layer_types(types, layers)


def train_config(a: argparse.Namespace, parser: argparse.ArgumentParser, shape: Shape, batch: int, *, cache: Path,
                 target: Path, run: Path, workers: int | None, steps: int, warmup: int, resumed_from: int, kind: str,
                 window: int = 0):
    """The TrainConfig of one measured run of `kind` (dflash or dflash2), its draft layers sliding with
    `window` (0: full), with --train-arg applied."""
    from dflash.runtime.settings import convert_file_value, settings_of
    from dflash.train.config import LoggingConfig, TrainConfig

    values = dict(
        cache=[str(cache)], target_model=str(target), output_dir=str(run), num_draft_layers=shape.draft_layers,
        block_size=shape.block_size, max_anchors=shape.anchors, token_budget=shape.seq_len * batch,
        max_batch_size=batch,
        max_seq_len=shape.seq_len, num_workers=workers, prefetch_factor=2 if shape.seq_len > 4096 else 4, epochs=100,
        max_steps=resumed_from + warmup + steps + (2 + a.trace_steps if a.trace_steps else 0), resume=a.resume_run,
        log_interval=2 if a.small else LoggingConfig.log_interval, eval_interval=0, save_interval=0,
        progress=False, tensorboard=False, compile=a.compile, device="cpu" if a.small else None,
        profile_interval=a.profile_interval, drafter_type=kind,
    )
    if window:
        values.update(draft_layer_types=a.layer_types, draft_sliding_window=window)
    settings = settings_of(TrainConfig)
    for item in a.train_arg:
        name, _, value = item.partition("=")
        if name not in settings:
            parser.error(f"--train-arg {item!r}: dflash-train has no setting {name!r}.")
        values[name] = convert_file_value(settings[name], value, "--train-arg")  # as its flag takes it
    values["log_interval"] = log_interval(resumed_from + warmup, steps, values["log_interval"])
    return TrainConfig.from_dict(values)


def draw_drafters_at(std: float):
    """Every drafter this process builds from now on draws its weights at `std` (the trainer's
    `reset_parameters`, its own default 0.02); returns what undoes it."""
    from dflash.train.model.drafter import DFlashDrafter

    reset = DFlashDrafter.reset_parameters
    DFlashDrafter.reset_parameters = lambda self, drawn=std: reset(self, drawn)

    def undo() -> None:
        DFlashDrafter.reset_parameters = reset
    return undo


def log_interval(unmeasured: int, measured: int, most: int) -> int:
    """The steps between the run's metric logs: the largest that divides both the unmeasured steps
    and the measured ones (a log falls on the measured span's first and last step) and is at most
    `most` (dflash-train's own --log-interval). Each log reads the step's metrics on the host, so it
    waits for the GPU: logging more often than the trainer does would time a slower loop than the
    one users run, less often a faster one."""
    return max(d for d in range(1, most + 1) if unmeasured % d == 0 and measured % d == 0)


def side_by_side(results: list[dict[str, Any]]) -> str:
    """The runs' step time, fraction of peak, context tokens/s and peak memory in one table, each
    drafter's tokens/s against the first's."""
    first = results[0]
    lines = [f"{'drafter':<8} {'window':>6} {'kernels':>8} {'ms/step':>9} {'median':>7} {'TFLOP/s':>8} {'of peak':>8} "
             f"{'ctx tok/s':>10} {'vs ' + first['drafter_type']:>10} {'GiB':>6} {'est GiB':>8}"]
    for r in results:
        median = r.get("median_seconds_per_step", r["seconds_per_step"])
        lines.append(f"{r['drafter_type']:<8} {r.get('draft_sliding_window') or 'full':>6} {r.get('head_kernels', ''):>8} "
                     f"{r['seconds_per_step'] * 1e3:9.1f} {median * 1e3:7.1f} {r['model_tflops']:8.0f} "
                     f"{r['fraction_of_peak']:8.1%} {r['context_tokens_per_second']:10.0f} "
                     f"{r['context_tokens_per_second'] / first['context_tokens_per_second']:9.3f}x "
                     f"{r['peak_gpu_memory_gib']:6.1f} {r.get('estimated_gpu_memory_gib', 0):8.1f}")
    if any(r["seconds_per_step"] > 1.15 * r.get("median_seconds_per_step", r["seconds_per_step"]) for r in results):
        lines.append("(a mean 15 % above its median: a measured step compiled again or stalled; raise --warmup-steps)")
    from dflash.train.config import LoggingConfig

    default, logged = LoggingConfig.log_interval, min(r.get("log_interval", 1) for r in results)
    if logged < default and torch.cuda.is_available():  # (on a CPU a read waits for nothing)
        lines.append(f"(metrics read every {logged} step(s), dflash-train's default every {default}: each read waits for "
                     f"the GPU, so this times a slower loop; --warmup-steps and --steps in multiples of {default} time "
                     "the trainer's)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/dev/shm/dflash-bench", help="where the target, cache and run go")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                        help="8b: the Qwen3-8B-shaped drafter, one 3072-token sample per step; 27b: the drafter of a "
                             "Qwen3.6-27B target (hidden 5120, 24/4 heads of 256, MLP 17408, vocab 248,320), the same "
                             "steps; quality: the drafter "
                             "of bench/quality (hidden 384, 5 layers), 64 samples of 256 tokens per step, byte ids; "
                             "quality-bpe: the same over the BPE benchmark's 8,192 ids; 8b-chat: "
                             "the 8b drafter on 32 samples of 512 tokens a step (40 %% prompt: ~147K scored slots); "
                             "8b-8k, 8b-32k, 27b-8k, 27b-32k: one sample of 8,192 or 32,768 tokens a step (512 anchors), "
                             "a cache of 16 / 8 samples by default; small: a tiny shape on the CPU (a smoke run of the "
                             "bench); small-long: the same with one 2,048-token sample (the long shapes' smoke run)")
    parser.add_argument("--small", action="store_true", help="same as --shape small")
    parser.add_argument("--samples", type=int, default=None, help="cache samples (default 256; small: 32)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 100; small: 10)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="unmeasured first steps (default 20; small: 4)")
    parser.add_argument("--num-workers", type=int, default=None, help="DataLoader workers (default 8; small: 2; long samples: the trainer's default)")
    parser.add_argument("--writers", type=int, default=min(14, os.cpu_count() or 1), help="cache writer processes")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the drafter's forward (default: the trainer's, compiled on CUDA; "
                             "--train-arg compile_mode=reduce-overhead adds CUDA graphs)")
    parser.add_argument("--trace-steps", type=int, default=0,
                        help="after the measured steps, profile this many more with torch.profiler and print "
                             "the top GPU kernels and the fraction of wall time the GPU was busy")
    parser.add_argument("--profile-interval", type=int, default=0,
                        help="the trainer's own per-section step profile every N steps (synchronizes CUDA)")
    parser.add_argument("--drafter-type", default="dflash", metavar="{dflash,dflash2}[,...]",
                        help="the drafter trained (dflash2: the in-block convolutions and the candidate selector at "
                             "their defaults; the step time against a dflash run of the same shape is their cost); "
                             "several, comma-separated: each trained in turn in this process on the same cache, "
                             "and their figures printed side by side")
    parser.add_argument("--sliding-window", default="0", metavar="W[,W...]",
                        help="train the draft layers --layer-types with a sliding window of W tokens (the trainer's "
                             "--draft-layer-types sliding --draft-sliding-window W; sliding layers are causal, as the "
                             "engines serve them); 0: full layers; several, comma-separated: each drafter trained with "
                             "each in turn, side by side (e.g. 0,2048)")
    parser.add_argument("--head-kernels", default="compiled", metavar="{compiled,eager}[,...]",
                        help="the head's loss in a compiled run: compiled (the trainer's: each chunk's softmax, loss "
                             "and gradient fused, and DFlash2's selector as gather-reductions) or eager (the path "
                             "before them); both, comma-separated: each drafter run with each, side by side")
    parser.add_argument("--drafter-init-std", type=float, default=None, metavar="STD",
                        help="draw the drafter's weights with this standard deviation (default the trainer's 0.02). "
                             "A drafter drawn at 0.02 proposes nearly the same top-16 for every slot (DFlash2's "
                             "candidates: 8B widths, 32,768 ids: 46 distinct ids over 960 slots, one in every slot), which "
                             "DFlash2's selector kernels meet at an extreme; at 0.1 its candidates spread over the "
                             "vocabulary (3,948 distinct, the most frequent in 12 %% of slots; bench/profile_step.py "
                             "prints the spread), as a trained drafter's follow the text (how closely is not "
                             "measured)")
    parser.add_argument("--layer-types", default="sliding",
                        help="--draft-layer-types of the runs with a --sliding-window (default: every layer sliding; "
                             "e.g. sliding,sliding,sliding,sliding,full)")
    parser.add_argument("--train-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="override a TrainConfig field, e.g. --train-arg attention_backend=sdpa (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir (else the run and cache are deleted)")
    parser.add_argument("--resume-run", action="store_true",
                        help="continue the run a --keep run left in --workdir from its last checkpoint (on any "
                             "number of processes: a resume on another world size) for --warmup-steps + --steps "
                             "more steps, and measure those")
    parser.add_argument("--json", help="also write the figures (the JSON printed at the end) to this file")
    return parser


def main() -> None:
    parser = build_parser()
    a = parser.parse_args()

    from dflash.train.run.loop import train

    if a.small:
        a.shape = "small"
    a.small = a.shape in CPU_SHAPES
    shape, batch = SHAPES[a.shape], BATCH[a.shape]
    # A long sample's states are 0.3 (8K) to 1.3 GiB (32K) at the 8B shape: a small cache, re-read every epoch,
    # few batches in flight (prefetch 2), and the trainer's own worker count (one fewer than the cores, at most
    # 4): a worker decodes about 1 GB/s of bf16 states, and 2 of them held the 8K step back (docs/BENCHMARKS.md).
    long = shape.seq_len > 4096
    samples = a.samples or (32 if a.small else (8 if shape.seq_len > 16384 else 16) if long else max(256, 8 * batch))
    steps, warmup = a.steps or (10 if a.small else 100), a.warmup_steps or (4 if a.small else 20)
    workers = a.num_workers if a.num_workers is not None else (2 if a.small else None if long else 8)
    try:
        windows = [int(w) for w in a.sliding_window.split(",") if w.strip()] or [0]
    except ValueError:
        parser.error(f"--sliding-window {a.sliding_window!r}: window sizes in tokens, comma-separated (0: full layers).")
    if any(w < 0 for w in windows):
        parser.error(f"--sliding-window {a.sliding_window!r}: a window is 1 token or more (0: full layers).")
    work = Path(a.workdir)
    target, cache, run = work / "target", work / "cache", work / "run"
    # Under torchrun (DDP over the GPUs of one host) rank 0 prepares the data, the others wait.
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    resumed_from = 0
    if a.resume_run:
        saved = sorted((run / "checkpoints").glob("step-*")) if (run / "checkpoints").is_dir() else []
        if not saved:
            parser.error(f"--resume-run: {run / 'checkpoints'} holds no checkpoint; run the bench with --keep first.")
        resumed_from = int(saved[-1].name.removeprefix("step-"))
    elif rank == 0:
        shutil.rmtree(run, ignore_errors=True)
    ready = work / f"ready-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"
    start = time.perf_counter()
    if rank == 0:
        if not (target / "model.safetensors").exists():
            write_target(target, shape)
        # a cache is reused only when a run of this shape and size finished writing it (a run stopped
        # while writing, or one of another --samples, leaves one that is written again)
        written = cache / f"written-{a.shape}-{samples}"
        if not written.exists():
            shutil.rmtree(cache, ignore_errors=True)
            write_cache(cache, shape, samples, per_part=8 if not a.small else 4,
                        writers=min(a.writers, max(1, samples // 8)) if long else a.writers,
                        prompt=PROMPT[a.shape])
            written.touch()
        ready.touch()
    while not ready.exists():
        time.sleep(0.5)
    prepared = time.perf_counter() - start
    print(f"target + cache ready in {prepared:.1f} s ({cache})", flush=True)

    kinds = [k.strip() for k in a.drafter_type.split(",") if k.strip()]
    if not kinds or set(kinds) - {"dflash", "dflash2"}:
        parser.error(f"--drafter-type {a.drafter_type!r}: dflash, dflash2, or both comma-separated.")
    kernels = [k.strip() for k in a.head_kernels.split(",") if k.strip()]
    if not kernels or set(kernels) - {"compiled", "eager"}:
        parser.error(f"--head-kernels {a.head_kernels!r}: compiled, eager, or both comma-separated.")
    variants = [(kind, window, kernel) for kind in kinds for window in windows for kernel in kernels]
    if a.resume_run and len(variants) > 1:
        parser.error("--resume-run continues one run: give one --drafter-type and one --sliding-window.")
    results = []
    from dflash.train.loss import head_loss

    if a.drafter_init_std is not None:
        draw_drafters_at(a.drafter_init_std)
    for kind, window, kernel in variants:
        head_loss.COMPILED_KERNELS = kernel == "compiled"
        runs = run if len(variants) == 1 else work / f"run-{kind}-{window or 'full'}-{kernel}"
        config = train_config(a, parser, shape, batch, cache=cache, target=target, run=runs, workers=workers,
                              steps=steps, warmup=warmup, resumed_from=resumed_from, kind=kind, window=window)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # each drafter's own peak
        train_start = time.perf_counter()
        if a.trace_steps:
            traced_train(config, skip=warmup + steps, warm=2, active=a.trace_steps)
        else:
            train(config)
        trained = time.perf_counter() - train_start
        if rank == 0:
            result = summarize(runs, config, shape, a.shape, warmup=resumed_from + warmup, steps=steps, world=world)
            result.update(prepare_seconds=prepared, train_seconds_incl_startup_and_final_checkpoint=trained,
                          head_kernels=kernel, drafter_init_std=a.drafter_init_std or 0.02)
            if a.resume_run:
                result["resumed_from_step"] = resumed_from
                print(f"resumed from step {resumed_from} on {world} process(es)", flush=True)
            print(json.dumps(result, indent=1), flush=True)
            results.append(result)
        if len(variants) > 1:
            import gc

            torch._dynamo.reset()  # the next drafter compiles afresh, not against this one's guards
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if rank == 0 and not a.keep:
                shutil.rmtree(runs, ignore_errors=True)
    if rank != 0:
        return
    ready.unlink(missing_ok=True)
    if len(results) > 1:
        print(side_by_side(results), flush=True)
    if a.json:
        Path(a.json).write_text("".join(json.dumps({"bench": "train", "shape_name": a.shape, **r}) + "\n"
                                        for r in results))
    if not a.keep:
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
