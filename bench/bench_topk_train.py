"""The top-K of DFlash2's training step: torch.topk against the two-stage exact top-K
(train/heads/dflash2/modules.py `exact_topk`) over the head's logits of a step's scored slots.

At the 8B shape a step scores 512 anchors x 15 slots = 7,680 rows of 151,936 logits (bf16 under
autocast, float32 on the chunked head path); the quality benchmark's small drafter about 150K rows of
8,192. Each variant's values are checked against torch.topk's before it is timed; the row-wise max
(`amax`, one read of the logits) is timed beside them as the floor of any top-K that reads every logit.
Each width is also timed with its segment maxima given ("maxima given"): what is left of the top-K
where a compiled drafter's chunk function computes them (train/loss/head_loss.py), the figure that
chooses the width for that path.

    python bench/bench_topk_train.py                           # one GPU: 7,680 x 151,936 and 153,600 x 8,192
    python bench/bench_topk_train.py --rows 64 --vocab 151936  # a CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiling import report_rows, timed  # noqa: E402


def measure(rows: int, vocab: int, k: int, dtype: torch.dtype, device: torch.device, segments: list[int],
            repeats: int) -> list[dict]:
    from dflash.train.heads.dflash2.modules import exact_topk, segment_maxima, topk_segment

    g = torch.Generator(device=device).manual_seed(0)
    logits = (3 * torch.randn(rows, vocab, generator=g, device=device)).to(dtype)
    want = torch.topk(logits, k, dim=-1).values
    base = timed(lambda: torch.topk(logits, k, dim=-1), device, repeats)
    shape = {"rows": rows, "vocab": vocab, "k": k, "dtype": str(dtype).removeprefix("torch."), "device": str(device)}
    out = [{**shape, "variant": "torch.topk", "ms": base, "vs_torch_topk": 1.0}]
    default, given = topk_segment(vocab, k), topk_segment(vocab, k, maxima_given=True)
    for segment in [default] + [s for s in dict.fromkeys([given, *segments]) if s != default]:
        if not segment or vocab // segment <= k:
            continue
        if not torch.equal(exact_topk(logits, k, segment)[0], want):
            raise SystemExit(f"exact_topk with segments of {segment} ids differs from torch.topk: a bug.")
        ms = timed(lambda s=segment: exact_topk(logits, k, s), device, repeats)
        name = f"two-stage, segments of {segment}" + (" (the default)" if segment == default else "")
        out.append({**shape, "variant": name, "segment": segment, "ms": ms, "vs_torch_topk": ms / base})
        maxima = segment_maxima(logits, segment)
        if not torch.equal(exact_topk(logits, k, segment, maxima)[0], want):
            raise SystemExit(f"exact_topk with segments of {segment} ids and their maxima given differs: a bug.")
        ms = timed(lambda s=segment, m=maxima: exact_topk(logits, k, s, m), device, repeats)
        name = "  the same, maxima given" + (" (the compiled path's default)" if segment == given else "")
        out.append({**shape, "variant": name, "segment": segment, "ms": ms,
                    "vs_torch_topk": ms / base, "maxima_given": True})
    ms = timed(lambda: logits.amax(-1), device, repeats)
    out.append({**shape, "variant": "amax (one read of the logits)", "ms": ms, "vs_torch_topk": ms / base})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=None, help="rows of logits (default: both shapes above)")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--k", type=int, default=16, help="DFlash2's selector_top_k (default 16)")
    parser.add_argument("--dtype", choices=("bf16", "fp32", "both"), default="both")
    parser.add_argument("--segments", default="32,64,128,256,512", help="segment widths tried beside the default")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the rows to this file (JSON lines)")
    a = parser.parse_args()
    device = torch.device(a.device)
    shapes = [(a.rows, a.vocab)] if a.rows else [(512 * 15, 151_936), (153_600, 8192)]
    dtypes = {"bf16": [torch.bfloat16], "fp32": [torch.float32], "both": [torch.bfloat16, torch.float32]}[a.dtype]
    segments = [int(s) for s in a.segments.split(",") if s]
    results = []
    for rows, vocab in shapes:
        for dtype in dtypes:
            for r in measure(rows, vocab, a.k, dtype, device, segments, a.repeats):
                results.append(r)
                print(f"{r['rows']:>7} x {r['vocab']:>7} {r['dtype']:>8} top-{r['k']}  {r['variant']:<54} "
                      f"{r['ms']:9.3f} ms  {r['vs_torch_topk']:.3f}x torch.topk", flush=True)
    report_rows("topk_train", device, results, a.json)

if __name__ == "__main__":
    main()
