"""Hidden-state codecs: how captured activations become stored bytes and back.

Three codecs, chosen per cache:
  bf16  lossless: bf16 bits stored as uint16, Blosc zstd with byte shuffle in large blocks.
  fp8   lossy: e4m3 with one float32 scale per (token, layer), then Blosc zstd, no shuffle.
  raw   no compression: bf16 bits as uint16.
Every chunk of every array also carries a crc32c checksum (zarr's crc32c codec). The Blosc
chunks are c-blosc's own, written through numcodecs exactly as zarr's BloscCodec writes them;
the level and block size are the ones that store a trained model's activations in the fewest
bytes at the throughput extraction needs (docs/BENCHMARKS.md, bench/bench_codecs.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numcodecs.blosc
import numpy as np
import torch
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from .errors import CacheError

CODEC_NAMES = ("bf16", "fp8", "raw")
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
EMPTY_CHUNK = 2**64 - 1  # a zarr shard index entry (offset and size) of a chunk that is not stored

# Codec fields of earlier versions, which chose how the chunks were packed (zstd frames written
# by the project's own Blosc encoder). Any Blosc decoder reads those chunks; the fields are
# accepted in a manifest and ignored.
LEGACY_FIELDS = ("zstd_hash_log", "zstd_min_match", "zstd_literals_only")


@dataclass(frozen=True, kw_only=True)
class HiddenCodec:
    """How hidden-state arrays are stored."""

    name: str = "bf16"
    """One of bf16 (lossless), fp8 (e4m3 + per-token-per-layer scale), raw (uncompressed)."""
    clevel: int = 1
    """zstd level inside Blosc (1-22): higher stores fewer bytes and encodes slower; decoding
    speed barely depends on it."""
    blocksize: int = 1 << 20
    """Blosc block size in bytes: each block is compressed on its own, so larger blocks let
    zstd find more of the exponent bytes' repetition (0: c-blosc's automatic size)."""

    def __post_init__(self) -> None:
        if self.name not in CODEC_NAMES:
            raise CacheError(
                f"Unknown codec {self.name!r}: choose one of {', '.join(CODEC_NAMES)} "
                "(bf16 is lossless, fp8 halves the size again at ~2-3 % error, raw is uncompressed)."
            )
        if not 0 <= self.clevel <= 22:
            raise CacheError(f"Codec level {self.clevel} is out of range: zstd takes 0..22.")
        if not 0 <= self.blocksize < 2**31:
            raise CacheError(f"Blosc block size {self.blocksize} must be 0 (automatic) or a positive byte count.")

    @property
    def storage_dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.name == "fp8" else np.dtype(np.uint16)

    @property
    def has_scale(self) -> bool:
        return self.name == "fp8"

    @property
    def shuffle(self) -> bool:
        """Byte shuffle groups the high (sign/exponent) bytes of bf16 together; for 1-byte fp8
        it would be a no-op, so it is left off there."""
        return self.storage_dtype.itemsize > 1

    def zarr_compressors(self) -> list:
        if self.name == "raw":
            return [Crc32cCodec()]
        blosc = BloscCodec(
            typesize=self.storage_dtype.itemsize, cname="zstd", clevel=self.clevel,
            shuffle="shuffle" if self.shuffle else "noshuffle", blocksize=self.blocksize,
        )
        return [blosc, Crc32cCodec()]

    def compress(self, data: np.ndarray) -> bytes:
        """One stored chunk's body (before its crc32c): the Blosc chunk that zarr's BloscCodec
        of `zarr_compressors` writes for `data` (C-contiguous), or the raw bytes for raw."""
        if self.name == "raw":
            return data.tobytes()
        shuffle = numcodecs.blosc.SHUFFLE if self.shuffle else numcodecs.blosc.NOSHUFFLE
        return numcodecs.blosc.compress(data, b"zstd", self.clevel, shuffle, self.blocksize,
                                        self.storage_dtype.itemsize)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HiddenCodec:
        """Manifest form -> codec; the fields of earlier versions in LEGACY_FIELDS are ignored."""
        unknown = set(data) - set(cls.__dataclass_fields__) - set(LEGACY_FIELDS)
        if unknown:
            raise CacheError(f"Unknown codec parameters {sorted(unknown)} in the manifest.")
        return cls(**{k: v for k, v in data.items() if k not in LEGACY_FIELDS})


# Fields of a manifest's codec that change how chunks are packed but never what they decode to:
# a cache may hold parts packed either way (e.g. extracted in two runs of different versions),
# so they are left out of its identity.
PACKING_ONLY = ("clevel", "blocksize", *LEGACY_FIELDS)


def small_array_compressors() -> list:
    """Codecs of the per-token metadata arrays (ids, masks, offsets, scales)."""
    return [ZstdCodec(level=3), Crc32cCodec()]


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


def bf16_to_storage(hidden: torch.Tensor) -> np.ndarray:
    """A bf16 tensor as uint16 numpy bits (zarr v3 has no bfloat16 dtype); a free view."""
    if hidden.dtype != torch.bfloat16:
        hidden = hidden.to(torch.bfloat16)
    return hidden.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def encode_hidden(
    hidden: torch.Tensor, codec: HiddenCodec, num_layers: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Turn [T, K*D] activations into (stored array, scale array or None) for `codec`."""
    if codec.has_scale:
        q, scale = quantize_fp8(hidden, num_layers)
        return q.cpu().numpy(), scale.cpu().numpy()
    return bf16_to_storage(hidden), None
