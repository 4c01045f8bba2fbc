"""The trainer's side of the hidden-state codecs: stored rows decoded to bf16 on the training
device, one decoder registered per codec name.

A batch of a lossy codec travels from the loader's workers as its stored rows (a quarter to a
half of bf16's bytes) and is decoded where it is trained on (`dequantize_batch`); a codec
without a device decoder is decoded on the host by the reader (`dflash.cache_tools.codecs`,
numpy), bit for bit the values these compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from dflash.cache_tools.codecs import NF4_GROUP, NF4_LEVELS, HiddenCodec

Decode = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""([..., stored width] stored rows, [..., K] float32 scales or None) -> [..., W] bfloat16.
A batch's padding rows are zero bytes (and zero scales): they must decode to +0.0, as the
padding of a batch the host decoded is."""

_DECODERS: dict[str, Decode] = {}
_NF4_LEVELS = [float(v) for v in NF4_LEVELS]


def register_device_decoder(name: str) -> Callable[[Decode], Decode]:
    """Decorator: the device decoder of the codec `name` (its batches then travel stored)."""
    def register(fn: Decode) -> Decode:
        _DECODERS[name] = fn
        return fn
    return register


def device_decoder(codec: HiddenCodec | str) -> Decode | None:
    """The device decoder of `codec` (or of the codec of that name), None where the host
    decodes it (bf16: nothing to decode)."""
    return _DECODERS.get(codec if isinstance(codec, str) else codec.name)


@register_device_decoder("fp8")
def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """e4m3 rows and their per-layer scales ([..., K*D] uint8, [..., K] float32) -> [..., K*D]."""
    *lead, width = q.shape
    layers = scale.shape[-1]
    x = q.reshape(-1, layers, width // layers).view(torch.float8_e4m3fn).float()
    return (x * scale.reshape(-1, layers, 1)).reshape(*lead, width).to(out_dtype)


@register_device_decoder("nf4")
def dequantize_nf4(rows: torch.Tensor, scale: torch.Tensor | None = None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """nf4 rows (codes, then their bf16 group scales) [..., W/2 + W/16] uint8 -> [..., W], on the
    rows' device."""
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
