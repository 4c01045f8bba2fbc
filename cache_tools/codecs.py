"""Hidden-state codecs: how captured activations become stored bytes and back.

Four codecs, chosen per cache:
  bf16  lossless: bf16 bits stored as uint16, Blosc zstd with byte shuffle in large blocks.
  fp8   lossy: e4m3 with one float32 scale per (token, layer), then Blosc zstd, no shuffle.
  nf4   lossy: 4-bit NF4 codes with one bf16 scale per 32 values, codes and scales in one
        uint8 row per token, then Blosc zstd, no shuffle (0.28x of bf16 before compression).
  raw   no compression: bf16 bits as uint16.
Every chunk of every array also carries a crc32c checksum (zarr's crc32c codec). The Blosc
chunks are c-blosc's own, written through numcodecs exactly as zarr's BloscCodec writes them;
the level and block size are the ones that store a trained model's activations in the fewest
bytes at the throughput extraction needs (docs/BENCHMARKS.md, bench/bench_codecs.py).
This module is the format only and imports no torch: the quantization itself (compute, on the
GPU during extraction) is `dflash.runtime.quantize`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numcodecs.blosc
import numpy as np
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from .errors import CacheError

CODEC_NAMES = ("bf16", "fp8", "nf4", "raw")

# nf4: the 16 values a code decodes to before its group's scale (QLoRA's NormalFloat4, the
# quantiles of a normal distribution, exact zero included), the number of values that share one
# scale, and the scale candidates the quantizer tries per group (fractions of the absmax scale).
# bench/bench_codec4.py chose these against int4 and e2m1 (fp4) on a trained model's activations.
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], dtype=np.float32)
NF4_GROUP = 32
NF4_SCALE_CANDIDATES = (1.0, 0.9, 0.8, 0.7)

# Codec fields of earlier versions, which chose how the chunks were packed (zstd frames written
# by the project's own Blosc encoder). Any Blosc decoder reads those chunks; the fields are
# accepted in a manifest and ignored.
LEGACY_FIELDS = ("zstd_hash_log", "zstd_min_match", "zstd_literals_only")


@dataclass(frozen=True, kw_only=True)
class HiddenCodec:
    """How hidden-state arrays are stored."""

    name: str = "bf16"
    """One of bf16 (lossless), fp8 (e4m3 + per-token-per-layer scale), nf4 (4-bit codes + a
    scale per 32 values), raw (uncompressed)."""
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
                "(bf16 is lossless, fp8 halves the size again at ~2-3 % error, nf4 stores 0.27x of "
                "bf16 at ~8-10 % error, raw is uncompressed)."
            )
        if not 0 <= self.clevel <= 22:
            raise CacheError(f"Codec level {self.clevel} is out of range: zstd takes 0..22.")
        if not 0 <= self.blocksize < 2**31:
            raise CacheError(f"Blosc block size {self.blocksize} must be 0 (automatic) or a positive byte count.")

    @property
    def storage_dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.name in ("fp8", "nf4") else np.dtype(np.uint16)

    @property
    def has_scale(self) -> bool:
        """A separate scale array beside each hidden array (fp8; nf4 keeps its scales in the row)."""
        return self.name == "fp8"

    @property
    def packed(self) -> bool:
        """Rows are not one stored value per value (nf4: packed codes, then the group scales)."""
        return self.name == "nf4"

    def stored_width(self, width: int) -> int:
        """Stored row width (in storage_dtype items) of `width` hidden values."""
        if self.name != "nf4":
            return width
        if width % NF4_GROUP:
            raise CacheError(f"The nf4 codec needs hidden widths that are multiples of {NF4_GROUP}; "
                             f"this one has {width}. Use fp8 or bf16 for this target.")
        return width // 2 + 2 * (width // NF4_GROUP)

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


def decode_nf4(rows: np.ndarray, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """nf4 stored rows [n, stored_width(width)] uint8 -> [n, width] uint16 bf16 bits.

    A row is width/2 bytes of codes (value 2i in the low nibble of byte i, value 2i+1 in the
    high one), then width/32 little-endian bf16 scales, one per 32 consecutive values; a value
    is NF4_LEVELS[code] * scale, rounded to bf16 (to nearest, ties to even).
    """
    n, half = rows.shape[0], width // 2
    pairs = _NF4_PAIRS[rows[:, :half]]  # [n, half, 2] float32: both nibbles of every byte
    scales = np.ascontiguousarray(rows[:, half:]).view("<u2").astype(np.uint32) << 16
    values = pairs.reshape(n, width // NF4_GROUP, NF4_GROUP) * scales.view(np.float32)[:, :, None]
    bits = values.reshape(n, width).view(np.uint32)
    bits += 0x7FFF + ((bits >> 16) & 1)
    if out is None:
        out = np.empty((n, width), dtype=np.uint16)
    np.right_shift(bits, 16, out=out, casting="unsafe")
    return out


def nf4_scale_bits(rows: np.ndarray) -> np.ndarray:
    """The bf16 bits (uint16) of the group scales of nf4 stored rows [n, W/2 + W/16]."""
    return np.ascontiguousarray(rows[:, rows.shape[1] * 8 // 9:]).view("<u2")


_NF4_PAIRS = np.stack([NF4_LEVELS[np.arange(256) & 15], NF4_LEVELS[np.arange(256) >> 4]], axis=1)


def small_array_compressors() -> list:
    """Codecs of the per-token metadata arrays (ids, masks, offsets, scales)."""
    return [ZstdCodec(level=3), Crc32cCodec()]
