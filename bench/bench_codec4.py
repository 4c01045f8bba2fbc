"""4-bit hidden-state codecs compared on real activations: bytes against raw bf16, and error.

Candidates (each quantizes groups of --group-sizes consecutive values of one (token, layer)
row with one scale; the scale is stored as bf16 bits, e8m0 (a power of two, one byte) or
e4m3 (one byte, under a float32 scale per (token, layer) row), and rounded to that stored
form before the values are quantized, so the error printed is the error a reader sees):
  int4    symmetric integers -7..7, scale absmax/7
  fp4     e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), scale absmax/6
  nf4     the 16 quantiles of a normal distribution (QLoRA's NF4), scale absmax
  "+search" tries --scale-candidates scales between 0.7x and 1x of the absmax scale per group
  and keeps the one with the smallest squared error (what fp8's per-row search does)

For each it prints bytes per token (4-bit codes packed two per byte, plus scales, through
Blosc zstd-1 without shuffle as the cache stores them) as a fraction of raw bf16, and the error
per (token, layer) row: relative L2 error (mean, p99.9, max) and cosine (mean, min). The
activations are those of bench_codecs.py: a small Qwen3 trained briefly (--kinds model) or
synthetic ones with outlier channels (--kinds synthetic).

    python bench/bench_codec4.py                  # full size (a GPU trains the model quickly)
    python bench/bench_codec4.py --small          # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numcodecs.blosc
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_codecs import model_activations, synthetic_activations  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])


def levels(kind: str) -> torch.Tensor:
    """The 16 (or 15) values a code decodes to, before the scale, ascending."""
    if kind == "int4":
        return torch.arange(-7, 8, dtype=torch.float32)
    if kind == "fp4":
        return torch.cat([-E2M1.flip(0)[:-1], E2M1])
    return NF4


def round_scale(scale: torch.Tensor, form: str, row_max: torch.Tensor) -> torch.Tensor:
    """The scale as it is stored (and decoded): bf16, a power of two, or e4m3 under a row scale."""
    tiny = torch.finfo(torch.float32).tiny
    if form == "bf16":
        return scale.to(torch.bfloat16).float().clamp_min(tiny)
    if form == "e8m0":
        return torch.exp2(torch.ceil(torch.log2(scale.clamp_min(tiny))))
    row = (row_max / 448.0).clamp_min(tiny)  # e4m3: scale / row in [0, 448]
    return ((scale / row).clamp(0, 448).to(torch.float8_e4m3fn).float() * row).clamp_min(tiny)


def quantize(x: torch.Tensor, kind: str, group: int, form: str, candidates: int) -> torch.Tensor:
    """[rows, width] float -> the decoded [rows, width] float32 of the candidate codec."""
    lv = levels(kind).to(x.device)
    top = float(lv.abs().max())
    g = x.float().reshape(x.shape[0], -1, group)
    absmax = g.abs().amax(dim=-1, keepdim=True)
    row_max = absmax.amax(dim=1, keepdim=True) / top
    mids = (lv[1:] + lv[:-1]) / 2
    best = best_err = None
    for j in range(max(1, candidates)):
        factor = 1.0 - 0.3 * j / max(1, candidates - 1) if candidates > 1 else 1.0
        scale = round_scale(absmax / top * factor, form, row_max)
        idx = (g / scale).unsqueeze(-1).gt(mids).sum(-1)  # nearest level (ties up)
        dec = lv[idx] * scale
        err = (dec - g).square().sum(-1, keepdim=True)
        if best is None:
            best, best_err = dec, err
            continue
        better = err < best_err
        best, best_err = torch.where(better, dec, best), torch.where(better, err, best_err)
    return best.reshape(x.shape)


def stored_bytes(rows: int, width: int, group: int, form: str, layers: int, codes: np.ndarray) -> float:
    """Bytes per token: packed codes and scales, each through Blosc zstd-1 (no shuffle)."""
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    body = sum(len(numcodecs.blosc.compress(packed[s: s + 128].copy(), b"zstd", 1, numcodecs.blosc.NOSHUFFLE,
                                            1 << 20, 1)) + 20 for s in range(0, rows, 128))
    scale_bytes = width // group * (2 if form == "bf16" else 1) + (4 * layers if form == "e4m3" else 0)
    return body / rows + scale_bytes


def row_errors(x: torch.Tensor, dec: torch.Tensor, layers: int) -> dict[str, float]:
    a = x.float().reshape(x.shape[0] * layers, -1)
    b = dec.reshape(a.shape)
    rel = (b - a).norm(dim=1) / a.norm(dim=1).clamp_min(1e-12)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1)
    return {"rel_mean": float(rel.mean()), "rel_p999": float(rel.quantile(0.999)), "rel_max": float(rel.max()),
            "cos_mean": float(cos.mean()), "cos_min": float(cos.min())}


def codes_for(x: torch.Tensor, kind: str, group: int) -> np.ndarray:
    """Representative 4-bit codes of the activations (absmax scale) for the byte count."""
    lv = levels(kind)
    g = x.float().reshape(x.shape[0], -1, group)
    scale = (g.abs().amax(-1, keepdim=True) / lv.abs().max()).clamp_min(1e-30)
    idx = (g / scale).unsqueeze(-1).gt((lv[1:] + lv[:-1]) / 2).sum(-1)
    return idx.reshape(x.shape).numpy().astype(np.uint8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="smoke-test sizes: K=2, hidden 256, 4096 tokens, 30 steps")
    p.add_argument("--kinds", default="model,synthetic")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--train-steps", type=int, default=1500)
    p.add_argument("--group-sizes", default="16,32,64")
    p.add_argument("--quantizers", default="int4,fp4,nf4")
    p.add_argument("--scale-forms", default="bf16,e8m0,e4m3")
    p.add_argument("--scale-candidates", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.small:
        args.layers, args.hidden, args.tokens, args.train_steps = 2, 256, 4096, 30
    groups = [int(g) for g in args.group_sizes.split(",")]
    for kind in args.kinds.split(","):
        if kind == "model":
            acts, desc = model_activations(args.tokens, args.layers, args.hidden, args.train_steps, args.seed)
        else:
            acts = synthetic_activations(args.tokens, args.layers, args.hidden, args.seed)
            desc = f"synthetic, K={args.layers}, D={args.hidden}"
        k, width = args.layers, acts.shape[1]
        raw = width * 2
        print(f"\n{kind}: {desc}; {acts.shape[0]} tokens, raw bf16 {raw:,} bytes/token")
        print(f"{'codec':<28} {'bytes/tok':>10} {'x bf16':>7} {'rel mean':>9} {'p99.9':>7} {'max':>7} "
              f"{'cos mean':>9} {'cos min':>8}")
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for qkind in args.quantizers.split(","):
            codes = {g: codes_for(acts[: min(8192, acts.shape[0])], qkind, g) for g in groups}
            for group in groups:
                for form in args.scale_forms.split(","):
                    if form == "bf16" and group < 32:
                        continue  # 0.25 + 2/16/2 > 0.30x: over the byte budget
                    for cands in sorted({1, args.scale_candidates}):
                        dec = torch.cat([quantize(acts[s: s + 4096].to(dev), qkind, group, form, cands).cpu()
                                         for s in range(0, acts.shape[0], 4096)])
                        e = row_errors(acts, dec, k)
                        nb = stored_bytes(codes[group].shape[0], width, group, form, k, codes[group])
                        name = f"{qkind} g{group} {form}" + (" +search" if cands > 1 else "")
                        print(f"{name:<28} {nb:>10,.0f} {nb / raw:>7.3f} {e['rel_mean']:>9.4f} "
                              f"{e['rel_p999']:>7.4f} {e['rel_max']:>7.4f} {e['cos_mean']:>9.5f} {e['cos_min']:>8.5f}",
                              flush=True)
        shipped(acts, k, raw, dev)


def shipped(acts: torch.Tensor, k: int, raw: int, dev: str) -> None:
    """The cache's nf4 codec itself: quantize_nf4 (as extraction runs it), its stored chunks
    (Blosc as the writer stores them, crc32c and index entries), decode_nf4 (as the reader)."""
    from dflash.cache_tools.codecs import HiddenCodec, decode_nf4
    from dflash.extract.codecs import quantize_nf4

    width = acts.shape[1]
    rows = torch.cat([quantize_nf4(acts[s: s + 4096].to(dev)).cpu() for s in range(0, acts.shape[0], 4096)]).numpy()
    codec = HiddenCodec(name="nf4")
    nb = sum(len(codec.compress(rows[s: s + 128].copy())) + 20 for s in range(0, rows.shape[0], 128)) / rows.shape[0]
    dec = torch.from_numpy(decode_nf4(rows, width).view(np.int16)).view(torch.bfloat16).float()
    e = row_errors(acts, dec, k)
    print(f"{'shipped nf4 (cache codec)':<28} {nb:>10,.0f} {nb / raw:>7.3f} {e['rel_mean']:>9.4f} "
          f"{e['rel_p999']:>7.4f} {e['rel_max']:>7.4f} {e['cos_mean']:>9.5f} {e['cos_min']:>8.5f}", flush=True)


if __name__ == "__main__":
    main()
