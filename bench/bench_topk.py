"""What the target's top-k log-probs of every token cost on the GPU, per extraction batch: the
final norm, the 151,936-id head and the reduction to the top-k (and the top-1), over one batch
of last hidden states [32768 x 4096] in bf16 (a Qwen3-8B-shaped head, random init), for:

  head alone      norm + head in 2,048-row chunks, the logits thrown away: the matmul's floor
  old             the formula before (`old_next_token_outputs`, kept here as the reference):
                  per 2,048-row chunk a float32 copy of the logits, their log_softmax, its topk
                  and the argmax
  new eager       extract/target.py's next_token_outputs, uncompiled (the CPU's and a failed
                  compile's path): topk on the bf16 logits, the log_softmax gathered at its ids
  new             the same, its reduction fused by torch.compile as ExtractionEngine runs it
                  (one read of the bf16 logits for the max, the sum of exponentials, the argmax)

Each is timed with CUDA events (mean of --repeats after a warm-up) with its peak memory above
the inputs; the figures are compared as ratios (old / new), and every variant's top-k is checked
against the old formula's (ids, log-probs, top-1). --chunk-tokens sweeps the new path's row
chunk. --small runs a tiny head on the CPU (a smoke run; its times mean nothing).

    python3 bench/bench_topk.py                       # one GPU, the 8B shape
    python3 bench/bench_topk.py --chunk-tokens 1024,2048,4096,8192
    python3 bench/bench_topk.py --small               # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from dflash.cache_tools.schema import TOP1_IDS, TOPK_IDS, TOPK_LOGPROBS, top1_dtype
from dflash.extract.engine import _compiled_head
from dflash.extract.target import _final_norm_and_head, head_reducer, next_token_outputs
from dflash.runtime.logits import apply_post_head, post_head_steps


@torch.inference_mode()
def old_next_token_outputs(model, last_hidden: torch.Tensor, *, topk: int = 0, top1: str | None = None,
                           chunk_tokens: int = 2048, **_ignored) -> dict[str, torch.Tensor]:
    """next_token_outputs as it was before the chunk reduction (the reference of the old
    path): per chunk the float32 logits, their log_softmax over the vocabulary and its topk."""
    norm, head = _final_norm_and_head(model, "--store-topk")
    steps = post_head_steps(model.config)
    raw_argmax = not topk and not any(v is not None for v in steps.values())
    ids_k, lp_k, ids_1 = [], [], []
    for start in range(0, last_hidden.shape[0], chunk_tokens):
        logits = head(norm(last_hidden[start:start + chunk_tokens]))
        if not raw_argmax:
            logits = apply_post_head(logits.float(), **steps)
        if topk:
            lp, ids = torch.log_softmax(logits, dim=-1).topk(topk, dim=-1)
            ids_k.append(ids.to(torch.int32))
            lp_k.append(lp)
        if top1:
            ids = logits.argmax(dim=-1)
            ids_1.append(torch.where(ids >= 1 << 15, ids - (1 << 16), ids).to(torch.int16) if top1 == "uint16"
                         else ids.to(torch.int32))
    out = {}
    if topk:
        out[TOPK_IDS], out[TOPK_LOGPROBS] = torch.cat(ids_k), torch.cat(lp_k)
    if top1:
        out[TOP1_IDS] = torch.cat(ids_1)[:, None]
    return out


@torch.inference_mode()
def head_alone(model, last_hidden: torch.Tensor, *, chunk_tokens: int = 2048, **_ignored) -> dict:
    """The final norm and the head in row chunks, nothing kept: the floor of every variant."""
    norm, head = _final_norm_and_head(model, "the bench")
    for start in range(0, last_hidden.shape[0], chunk_tokens):
        head(norm(last_hidden[start:start + chunk_tokens]))
    return {}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device: torch.device, repeats: int) -> tuple[float, float, dict]:
    """(ms per call, peak bytes above what was allocated before, the last call's outputs)."""
    for _ in range(2):  # warm-up: compiles, autotunes, grows the allocator's cache
        out = fn()
        del out
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    sync(device)
    ms = (time.perf_counter() - t) / repeats * 1e3
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0.0
    return ms, peak, out


def agreement(got: dict, ref: dict) -> str:
    """How a variant's top-k matches the old formula's: ids, log-probs, top-1."""
    if not got:
        return "-"
    same = (got[TOPK_IDS] == ref[TOPK_IDS]).float().mean().item()
    lp = (got[TOPK_LOGPROBS].float() - ref[TOPK_LOGPROBS].float()).abs().max().item()
    top1 = (got[TOP1_IDS] == ref[TOP1_IDS]).float().mean().item()
    return f"ids {same:.6%} equal, log-probs within {lp:.1e}, top-1 {top1:.6%} equal"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, help="Tokens of the batch [32768; small: 512].")
    ap.add_argument("--topk", type=int, default=8, help="The top-k stored [8, dflash-extract's default].")
    ap.add_argument("--chunk-tokens", default="2048",
                    help="Row chunks of the new path, comma-separated for a sweep [2048, the product's]; "
                         "the old formula keeps its 2,048.")
    ap.add_argument("--repeats", type=int, default=5, help="Timed calls per variant after one warm-up [5].")
    ap.add_argument("--small", action="store_true", help="A tiny head on the CPU (smoke run).")
    ap.add_argument("--json", help="Also write the figures (the last line of the output) to this file.")
    return ap


def main() -> None:
    # Here, not at the top: bench_extract imports this file.
    from bench_extract import FULL, SMALL, build_config, build_model

    args = build_parser().parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    shape = {**(SMALL if args.small else FULL), "num_hidden_layers": 1}  # the head is what is measured
    rows = args.rows or (512 if args.small else 32768)
    model = build_model(build_config("Qwen3ForCausalLM", shape), device)
    vocab = shape["vocab_size"]
    top1 = top1_dtype(vocab)
    gen = torch.Generator(device=device).manual_seed(0)
    # (the final norm scales each row to unit RMS: the random head's logits have a std of ~1.3)
    hidden = torch.randn(rows, shape["hidden_size"], device=device, generator=gen).to(torch.bfloat16)
    reduce = head_reducer(model, topk=args.topk, top1=True)
    fused = _compiled_head(reduce, device, vocab, torch.bfloat16) if device.type == "cuda" else reduce
    chunks = [int(c) for c in args.chunk_tokens.split(",")]
    kw = dict(topk=args.topk, top1=top1)
    variants = [("head alone (norm + head, 2,048-row chunks)", lambda: head_alone(model, hidden)),
                ("old: float32 log_softmax + topk (2,048-row chunks)", lambda: old_next_token_outputs(model, hidden, **kw)),
                ("new eager (2,048-row chunks)", lambda: next_token_outputs(model, hidden, reduce=reduce, **kw))]
    variants += [(f"new ({c:,}-row chunks)", lambda c=c: next_token_outputs(model, hidden, reduce=fused,
                                                                             chunk_tokens=c, **kw)) for c in chunks]
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"{rows} tokens x hidden {shape['hidden_size']} -> vocab {vocab}, bf16, top-{args.topk} and top-1; "
          f"torch {torch.__version__}", flush=True)
    figures, ref = {}, None
    for name, fn in variants:
        ms, peak, out = measure(fn, device, args.repeats)
        if name.startswith("old"):
            ref = out
        figures[name] = {"ms": ms, "peak_gib": peak / 2**30, "check": agreement(out, ref) if ref else "-"}
        print(f"{name:52s} {ms:9.2f} ms  peak +{peak / 2**30:6.2f} GiB  {figures[name]['check']}", flush=True)
        del out
    old = figures[variants[1][0]]
    floor = figures[variants[0][0]]["ms"]
    print(f"\n{'variant':52s} {'ms':>9s} {'old / this':>10s} {'over the head':>14s} {'peak GiB':>9s}")
    for name, f in figures.items():
        over = "-" if name == variants[0][0] else f"{f['ms'] - floor:.2f} ms"
        print(f"{name:52s} {f['ms']:9.2f} {old['ms'] / f['ms']:9.2f}x {over:>14s} {f['peak_gib']:9.2f}")
    result = {"bench": "topk", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "rows": rows, "hidden": shape["hidden_size"], "vocab": vocab,
              "topk": args.topk, "small": args.small, "variants": figures}
    if args.json:
        Path(args.json).write_text(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
