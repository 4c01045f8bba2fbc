"""The extraction engine's side of the hidden-state codecs: each codec's encoder on the device
(the GPU during extraction), registered under the codec's name.

The format (`dflash.cache_tools.codecs`) says how stored rows are laid out and decoded, and
encodes on the host with numpy; these torch functions compute the same stored rows where the
activations are, so that only the stored bytes cross to the host. A lossy codec's encoder is
elementwise work and one reduction per candidate scale: `fused` asks the engine to compile it
(torch.compile), which turns its several passes over the batch into a few kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from dflash.cache_tools.codecs import (
    FP8_MAX,
    FP8_SCALE_CANDIDATES,
    NF4_GROUP,
    NF4_LEVELS,
    NF4_SCALE_CANDIDATES,
    HiddenCodec,
)

Encode = Callable[[torch.Tensor, int], "tuple[torch.Tensor, torch.Tensor | None]"]
"""[T, K*D] activations, K -> ([T, stored width] stored rows, [T, K] float32 scales or None)."""

# nf4's levels as Python floats, and the midpoints between neighbours: constants to
# torch.compile, so the quantizer traces into one graph.
_NF4_LEVELS = [float(v) for v in NF4_LEVELS]
_NF4_MIDS = [(a + b) / 2 for a, b in zip(_NF4_LEVELS[:-1], _NF4_LEVELS[1:])]


@dataclass(frozen=True)
class DeviceEncoder:
    encode: Encode
    fused: bool = False
    """Compile it before the loop (a lossy codec's scale search)."""


_ENCODERS: dict[str, DeviceEncoder] = {}


def register_device_encoder(name: str, *, fused: bool = False) -> Callable[[Encode], Encode]:
    """Decorator: the device encoder of the codec `name`."""
    def register(fn: Encode) -> Encode:
        _ENCODERS[name] = DeviceEncoder(fn, fused)
        return fn
    return register


def device_encoder(codec: HiddenCodec) -> DeviceEncoder:
    """The device encoder registered for `codec` (ValueError naming the codec without one)."""
    found = _ENCODERS.get(codec.name)
    if found is None:
        raise ValueError(f"the {codec.name} codec has no device encoder for extraction "
                         "(dflash.extract.codecs.register_device_encoder)")
    return found


@register_device_encoder("bf16")
@register_device_encoder("raw")
def encode_bf16(hidden: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, None]:
    """bf16 bits, as int16 (the host reads them as uint16)."""
    return hidden.to(torch.bfloat16).view(torch.int16), None


@register_device_encoder("fp8", fused=True)
def quantize_fp8(
    hidden: torch.Tensor, num_layers: int, *, scale_candidates: int = FP8_SCALE_CANDIDATES
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


@register_device_encoder("nf4", fused=True)
def quantize_nf4_rows(hidden: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, None]:
    """quantize_nf4 with the encoders' signature (its scales are inside the rows)."""
    return quantize_nf4(hidden), None
