"""The compute side of the hidden-state codecs: fp8 quantization and bf16 bits.

The cache format (`dflash.cache_tools.codecs`) says how stored bytes are laid out and
compressed; these functions turn activations into those bytes and back, on whatever device the
tensors are on (the GPU during extraction and training). They import torch; the format layer
does not, so that `dflash-cache info` and other format-only tools start without it.
"""

from __future__ import annotations

import numpy as np
import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


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
