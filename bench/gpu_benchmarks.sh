#!/usr/bin/env bash
# Every GPU figure of docs/BENCHMARKS.md, in as few GPU runs as possible.
# Usage (from the repository root, on a GPU host with the project installed):
#   bash bench/gpu_benchmarks.sh extract   # ~3.5 min: prefill, stop-after-last-layer (also over the extraction's own batches), bf16 and fp8 extraction, 1M tokens
#                                          # (EXTRACT_TOKENS=2097152: 2M tokens, ~5.5 min, 59 GB of cache in SCRATCH)
#   bash bench/gpu_benchmarks.sh seed27b   # ~7 min at 65K tokens (EXTRACT_TOKENS=65536 FORWARD_TOKENS=32768; the 256K default is longer): the Qwen3.6-27B-shaped hybrid target's extraction (flash-linear-attention
#                                          # wheels needed), its drafter's training step, and the GPU-hours table of both;
#                                          # the figures as JSON in RESULTS (default $OUT, else /tmp/dflash-seed27b);
#                                          # SEED27B_SHAPE=27b-dense extracts a dense Qwen3 of that size instead, SKIP_TRAIN=1
#                                          # extracts only (then `python3 bench/gpu_hours.py EXTRACT.json TRAIN.json` makes the table)
#   bash bench/gpu_benchmarks.sh fp8       # ~1.5 min: the fp8 and nf4 quantizers eager and fused, on one batch
#   bash bench/gpu_benchmarks.sh nf4       # ~3.5 min: bf16 and nf4 extraction of the 8B shape against the bare forward, 1M tokens
#   bash bench/gpu_benchmarks.sh codec4    # ~3 min: 4-bit candidates (int4, e2m1, NF4; group sizes, scale forms) and the shipped nf4
#                                          # codec on a trained model's activations (bench/bench_codec4.py): bytes vs bf16, error
#   bash bench/gpu_benchmarks.sh quality-nf4  # ~14 min: the quality benchmark on a bf16 and on an nf4 cache (prep + main "2",
#                                          # block 16; WORKDIR prefix QUALITY_WORKDIR, default /dev/shm/dflash-quality): nf4's tau cost
#   bash bench/gpu_benchmarks.sh colocate  # ~4 min: extraction and training at once on one GPU (two processes) against each alone
#   bash bench/gpu_benchmarks.sh train     # ~3 min: Qwen3-8B-shaped drafter step, FLOP/s, data wait, memory
#   bash bench/gpu_benchmarks.sh train2    # ~4 min, 2 GPUs: the same on 1 GPU, then DDP on 2 (scaling)
#   bash bench/gpu_benchmarks.sh scale     # 2-8 GPUs of one host (GPUS, default: all visible): extraction on 1 and GPUS ranks into
#                                          # a shared cache, one rank SIGKILLed and rerun (bench/bench_scale.py), the drafter on 1 GPU,
#                                          # DDP and FSDP2 on GPUS, the FSDP2 run resumed on GPUS/2 (grad_accum 2: the same global
#                                          # batch), each scaling efficiency and the measured GPU-hours table; SCALE_SHAPE=27b: the
#                                          # Qwen3.6-27B-shaped hybrid target and its drafter (default 8b); figures as JSON in RESULTS
#   bash bench/gpu_benchmarks.sh cache     # ~1 min: bytes/token and speeds of zstd levels and block sizes on a trained model's
#                                          # activations, the shipped codecs end to end (BASELINE=<an older cache_tools
#                                          # directory> adds that version's codecs: bench/bench_codecs.py says how)
#   bash bench/gpu_benchmarks.sh eval      # ~6 min: demo target + drafter on CPU, then dflash-eval on the GPU
#                                          # (DEMO_DIR=<an earlier dflash-demo --workdir>: ~1 min, eval only)
# SCRATCH (default /dev/shm/dflash-bench) holds the data; it is removed at the end.
# DFLASH_SYNC_DEBUG=1 makes the extraction loop and the training step warn at every place
# where the host waits for the GPU (torch.cuda.set_sync_debug_mode("warn")).
set -euo pipefail
scratch=${SCRATCH:-/dev/shm/dflash-bench}
mkdir -p "$scratch"
trap 'rm -rf "$scratch"' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers, zarr; print('torch', torch.__version__, 'transformers', transformers.__version__, 'zarr', zarr.__version__)"
git rev-parse --short HEAD 2>/dev/null || true
for what in "$@"; do
  case "$what" in
    extract) DFLASH_PROFILE_EXTRACT=1 python3 bench/bench_extract.py --output "$scratch/extract" \
      ${EXTRACT_TOKENS:+--tokens "$EXTRACT_TOKENS"} ;;
    seed27b)
      results=${RESULTS:-${OUT:-/tmp/dflash-seed27b}}; mkdir -p "$results"
      shape=${SEED27B_SHAPE:-27b-hybrid}  # 27b-dense: a dense Qwen3 of the same size (no linear-attention kernels)
      python3 bench/bench_extract.py --shape "$shape" --output "$scratch/extract27" --json "$results/extract-$shape.json" \
        ${EXTRACT_TOKENS:+--tokens "$EXTRACT_TOKENS"} ${FORWARD_TOKENS:+--forward-tokens "$FORWARD_TOKENS"}
      rm -rf "$scratch/extract27"
      if [ -n "${SKIP_TRAIN:-}" ]; then continue; fi
      python3 bench/bench_train.py --shape 27b --workdir "$scratch/train27" --samples 64 --steps 40 --warmup-steps 8 \
        --compile --json "$results/train-27b.json"
      rm -rf "$scratch/train27"
      python3 bench/gpu_hours.py "$results/extract-$shape.json" "$results/train-27b.json" | tee "$results/gpu-hours-$shape.md" ;;
    scale)
      n=${GPUS:-$(nvidia-smi -L | wc -l)}
      if [ "$n" -lt 2 ]; then echo "scale needs 2 or more GPUs (GPUS=$n)" >&2; exit 2; fi
      results=${RESULTS:-${OUT:-/tmp/dflash-scale}}; mkdir -p "$results"
      case "${SCALE_SHAPE:-8b}" in
        8b) xshape=8b; tshape=8b ;;
        27b) xshape=27b-hybrid; tshape=27b ;;
        *) echo "SCALE_SHAPE is 8b or 27b" >&2; exit 2 ;;
      esac
      python3 bench/bench_scale.py --gpus "$n" --shape "$xshape" ${SCALE_TOKENS:+--tokens-per-gpu "$SCALE_TOKENS"} \
        --workdir "$scratch/scale" --json "$results/extract-scale-$n.json"
      t=(--shape "$tshape" --workdir "$scratch/ts" --samples 96 --steps 40 --warmup-steps 8 --compile --keep)
      python3 bench/bench_train.py "${t[@]}" --json "$results/train-1.json"
      torchrun --standalone --nproc_per_node "$n" bench/bench_train.py "${t[@]}" --json "$results/train-$n-ddp.json"
      torchrun --standalone --nproc_per_node "$n" bench/bench_train.py "${t[@]}" --train-arg parallel=fsdp \
        --json "$results/train-$n-fsdp.json"
      torchrun --standalone --nproc_per_node $((n / 2)) bench/bench_train.py "${t[@]}" --resume-run \
        --train-arg parallel=fsdp --train-arg grad_accum=2 --warmup-steps 4 --steps 8 --json "$results/train-resumed.json"
      python3 - "$results" "$n" <<'PY'
import json, sys
from pathlib import Path
r, n = Path(sys.argv[1]), int(sys.argv[2])
one = json.loads((r / "train-1.json").read_text())["context_tokens_per_second"]
for mode in ("ddp", "fsdp"):
    f = json.loads((r / f"train-{n}-{mode}.json").read_text())
    print(f"train {mode} on {n} GPUs: {f['context_tokens_per_second']:,.0f} context tokens/s = "
          f"{f['context_tokens_per_second'] / (n * one):.1%} of {n} x {one:,.0f} (1 GPU); "
          f"{f['fraction_of_peak']:.1%} of peak per GPU, {f['peak_gpu_memory_gib']:.1f} GiB")
f = json.loads((r / "train-resumed.json").read_text())
print(f"resumed the {n}-GPU FSDP2 run at step {f['resumed_from_step']} on {f['processes']} process(es): "
      f"{f['context_tokens_per_second']:,.0f} context tokens/s")
PY
      python3 bench/gpu_hours.py "$results/extract-scale-$n.json" "$results/train-$n-ddp.json" | tee "$results/gpu-hours-$n.md"
      rm -rf "$scratch/ts" ;;
    fp8) (cd bench && python3 bench_fp8.py) ;;
    nf4) DFLASH_PROFILE_EXTRACT=1 python3 bench/bench_extract.py --output "$scratch/extract" --codecs bf16,nf4 \
      ${EXTRACT_TOKENS:+--tokens "$EXTRACT_TOKENS"} ;;
    codec4) python3 bench/bench_codec4.py ;;
    quality-nf4)
      qbase=${QUALITY_WORKDIR:-/dev/shm/dflash-quality}
      qres=${RESULTS:-${OUT:-/tmp/dflash-quality}}
      for codec in bf16 nf4; do
        WORKDIR="$qbase-$codec" RESULTS="$qres/$codec" QUALITY_SETS="--set extract_args=--store-topk,8,--codec,$codec" \
          bash bench/quality/device.sh prep
        WORKDIR="$qbase-$codec" RESULTS="$qres/$codec" EVAL_BLOCKS=16 bash bench/quality/device.sh main "2"
      done
      for codec in bf16 nf4; do echo "== $codec cache"; WORKDIR="$qbase-$codec" bash bench/quality/device.sh table; done ;;
    colocate)
      results=${RESULTS:-${OUT:-/tmp/dflash-colocate}}; mkdir -p "$results"
      python3 bench/bench_colocate.py --workdir "$scratch/colocate" --json "$results/colocate.json" ;;
    train) python3 bench/bench_train.py --workdir "$scratch/train" --samples 96 --steps 40 --warmup-steps 8 --compile --trace-steps 3 ;;
    train2)
      python3 bench/bench_train.py --workdir "$scratch/train" --samples 96 --steps 40 --warmup-steps 8 --compile --keep
      torchrun --standalone --nproc_per_node 2 bench/bench_train.py --workdir "$scratch/train" --samples 96 \
        --steps 40 --warmup-steps 8 --compile ;;
    cache)
      base=${BASELINE:+--compare-with "$BASELINE"}
      python3 bench/bench_codecs.py --workdir "$scratch" --tokens 32768 --train-steps 200 --levels 1,2,3,4,5 \
        --blocksizes 1048576,4194304 --timed-tokens 4096 $base ;;
    eval)
      demo=${DEMO_DIR:-$scratch/demo}
      [ -d "$demo/run/final" ] || dflash-demo --workdir "$demo"
      for batch in 1 4; do
        dflash-eval --target-model "$demo/target" --drafter "$demo/run/final" \
          --prompts "$demo/heldout_prompts.jsonl" --device cuda --dtype float32 \
          --batch-size "$batch" --block-size 8
      done ;;
    *) echo "unknown benchmark '$what' (extract, seed27b, scale, fp8, nf4, codec4, quality-nf4, colocate, train, train2, cache, eval)" >&2; exit 2 ;;
  esac
done
