"""Hidden-state codecs: how captured activations become stored bytes and back.

Three codecs, chosen per cache:
  bf16  lossless: bf16 bits stored as uint16, Blosc zstd with byte shuffle in large blocks.
  fp8   lossy: e4m3 with one float32 scale per (token, layer), then Blosc zstd, no shuffle.
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

CODEC_NAMES = ("bf16", "fp8", "raw")
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
