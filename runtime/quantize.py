"""The compute side of the hidden-state codecs: fp8 quantization and bf16 bits.

The cache format (`dflash.cache_tools.codecs`) says how stored bytes are laid out and
compressed; these functions turn activations into those bytes and back, on whatever device the
tensors are on (the GPU during extraction and training). They import torch; the format layer
does not, so that `dflash-cache info` and other format-only tools start without it.
"""

from __future__ import annotations

import numpy as np
import torch
from dflash.cache_tools.codecs import NF4_GROUP, NF4_LEVELS, NF4_SCALE_CANDIDATES

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# nf4's levels (the format's, cache_tools.codecs) as Python floats, and the midpoints between
# neighbours: constants to torch.compile, so the quantizer traces into one graph.
_NF4_LEVELS = [float(v) for v in NF4_LEVELS]
_NF4_MIDS = [(a + b) / 2 for a, b in zip(_NF4_LEVELS[:-1], _NF4_LEVELS[1:])]


def quantize_fp8(
    hidden: torch.Tensor, num_layers: int, *, scale_candidates: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K*D] float -> ([T, K*D] uint8 e4m3 bits, [T, K] float32 scales).

    One scale per (token, layer) so that one outlier channel only costs precision inside its
    own row. With e4m3's 3 mantissa bits the plain absmax scale is not the best one for every
    row; trying `scale_candidates` scales between absmax/448 and twice that and keeping, per
    row, the one with the smallest error keeps the worst rows within the documented bound of
    3 % per (token, layer) (docs/cache-format.md). Runs on whatever device `hidden` is on (the GPU during
    extraction), in a loop so that memory stays at a few copies of the input.
    """
    tokens, width = hidden.shape
    x = hidden.reshape(tokens, num_layers, width // num_layers).float()
    base = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    best_q = best_scale = best_err = None
    for j in range(max(1, scale_candidates)):
        scale = base * 2.0 ** (j / max(1, scale_candidates))
        q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        err = (q.float() * scale - x).square().sum(dim=-1, keepdim=True)
        if best_q is None:
            best_q, best_scale, best_err = q.view(torch.uint8), scale, err
            continue
        better = err < best_err
        best_q = torch.where(better, q.view(torch.uint8), best_q)
        best_scale = torch.where(better, scale, best_scale)
        best_err = torch.where(better, err, best_err)
    return best_q.reshape(tokens, width), best_scale.reshape(tokens, num_layers)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Inverse of quantize_fp8: ([T, K*D] uint8, [T, K] float32) -> [T, K*D] out_dtype."""
    tokens, width = q.shape
    num_layers = scale.shape[1]
    x = q.view(torch.float8_e4m3fn).reshape(tokens, num_layers, width // num_layers).float()
    return (x * scale.reshape(tokens, num_layers, 1)).reshape(tokens, width).to(out_dtype)


def bf16_bits(hidden: torch.Tensor) -> np.ndarray:
    """A bf16 tensor as uint16 numpy bits (zarr v3 has no bfloat16 dtype); a free view."""
    if hidden.dtype != torch.bfloat16:
        hidden = hidden.to(torch.bfloat16)
    return hidden.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def quantize_nf4(hidden: torch.Tensor) -> torch.Tensor:
    """[T, W] float -> [T, W/2 + W/16] uint8: nf4 codes and their bf16 group scales, one row per
    token in the layout `dflash.cache_tools.codecs.decode_nf4` reads.

    Each group of NF4_GROUP consecutive values (inside one layer: hidden sizes are multiples of
    the group) gets one scale; of the NF4_SCALE_CANDIDATES fractions of its absmax the group
    keeps the one with the smallest squared error (a little clipping of the largest value buys
    finer steps for the rest). The scale is rounded to bf16 before the codes are chosen, so the
    error measured here is the error a reader sees. Elementwise work and one reduction per
    candidate: torch.compile fuses it into a few kernels on the GPU (extraction's encode).
    """
    tokens, width = hidden.shape
    levels = torch.tensor(_NF4_LEVELS, device=hidden.device)
    g = hidden.reshape(tokens, width // NF4_GROUP, NF4_GROUP).float()
    absmax = g.abs().amax(dim=-1, keepdim=True)
    best_code = best_scale = best_err = None
    for factor in NF4_SCALE_CANDIDATES:
        scale = (absmax * factor).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)
        y = g / scale.float()
        code = torch.zeros_like(y, dtype=torch.uint8)
        for m in _NF4_MIDS:  # nearest level: count the midpoints below (15 compares, fused)
            code += (y > m).to(torch.uint8)
        err = (levels[code.long()] - y).square().sum(dim=-1, keepdim=True) * scale.float().square()
        if best_code is None:
            best_code, best_scale, best_err = code, scale, err
            continue
        better = err < best_err
        best_code = torch.where(better, code, best_code)
        best_scale = torch.where(better, scale, best_scale)
        best_err = torch.where(better, err, best_err)
    codes = best_code.reshape(tokens, width // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    scale_bytes = best_scale.reshape(tokens, width // NF4_GROUP).view(torch.uint8)
    return torch.cat([packed, scale_bytes], dim=1)


def dequantize_nf4(rows: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Inverse of quantize_nf4 on the rows' device: [..., W/2 + W/16] uint8 -> [..., W] out_dtype
    (the trainer decodes nf4 batches on the GPU: a quarter of bf16's bytes cross to it)."""
    stored = rows.shape[-1]
    width = stored * 16 // 9
    flat = rows.reshape(-1, stored)
    levels = torch.tensor(_NF4_LEVELS, device=rows.device)
    codes = flat[:, : width // 2]
    values = torch.stack([levels[(codes & 15).long()], levels[(codes >> 4).long()]], dim=-1)
    scales = flat[:, width // 2:].contiguous().view(torch.bfloat16).float()
    # + 0.0: padding rows (zero bytes: code 0 = -1.0 times scale 0) decode to +0.0, as padding is
    out = values.reshape(-1, width // NF4_GROUP, NF4_GROUP) * scales.unsqueeze(-1) + 0.0
    return out.reshape(*rows.shape[:-1], width).to(out_dtype)
