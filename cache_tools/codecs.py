"""Hidden-state codecs: how captured activations become stored bytes and back.

A codec is one class registered by name (`register_codec`, as zarr's codecs are); the
manifest records its `to_dict()` and a reader rebuilds it with `HiddenCodec.from_dict`. Four
are shipped:
  bf16  lossless: bf16 bits stored as uint16, Blosc zstd with byte shuffle in large blocks.
  fp8   lossy: e4m3 with one float32 scale per (token, layer), then Blosc zstd, no shuffle.
  nf4   lossy: 4-bit NF4 codes with one bf16 scale per 32 values, codes and scales in one
        uint8 row per token, then Blosc zstd, no shuffle (0.28x of bf16 before compression).
  raw   no compression: bf16 bits as uint16.
A codec declares its stored form (storage dtype, a separate scale array or not, the stored row
width), checks the widths it can store, and encodes and decodes on the host with numpy. Every
chunk of every array also carries a crc32c checksum (zarr's crc32c codec). The Blosc chunks
are c-blosc's own, written through numcodecs exactly as zarr's BloscCodec writes them; the
level and block size are the ones that store a trained model's activations in the fewest bytes
at the throughput extraction needs (docs/BENCHMARKS.md, bench/bench_codecs.py).
This module is the format and imports no torch: the GPU-fused encoders are the extraction
engine's (`dflash.extract.codecs`), the device decoders the trainer's (`dflash.train.data.codecs`),
each registered under the codec's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numcodecs.blosc
import numpy as np
from dflash.runtime.findings import Finding
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from .errors import CacheError

_REGISTRY: dict[str, type[HiddenCodec]] = {}

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
# fp8: the largest finite e4m3 (float8_e4m3fn) value, and how many scales per (token, layer)
# the quantizer tries, between absmax/448 and twice that.
FP8_MAX = 448.0
FP8_SCALE_CANDIDATES = 8

# Codec fields of earlier versions, which chose how the chunks were packed (zstd frames written
# by the project's own Blosc encoder). Any Blosc decoder reads those chunks; the fields are
# accepted in a manifest and ignored.
LEGACY_FIELDS = ("zstd_hash_log", "zstd_min_match", "zstd_literals_only")
_TINY = np.finfo(np.float32).tiny


def register_codec(cls: type[HiddenCodec]) -> type[HiddenCodec]:
    """Class decorator: make `cls` the codec of its `name` (the default of its name field)."""
    name = cls.__dataclass_fields__["name"].default
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"a codec named {name!r} is registered already ({_REGISTRY[name].__qualname__})")
    _REGISTRY[name] = cls
    return cls


def codec_names() -> tuple[str, ...]:
    """The registered codecs' names, in registration order."""
    return tuple(_REGISTRY)


@dataclass(frozen=True, kw_only=True)
class HiddenCodec:
    """How hidden-state arrays are stored. `HiddenCodec(name=...)` (and `from_dict`) make the
    registered codec of that name; a codec's class declares its stored form."""

    name: str = "bf16"
    """The registered codec (codec_names(): bf16 lossless, fp8 e4m3 + per-token-per-layer
    scale, nf4 4-bit codes + a scale per 32 values, raw uncompressed)."""
    clevel: int = 1
    """zstd level inside Blosc (1-22): higher stores fewer bytes and encodes slower; decoding
    speed barely depends on it."""
    blocksize: int = 1 << 20
    """Blosc block size in bytes: each block is compressed on its own, so larger blocks let
    zstd find more of the exponent bytes' repetition (0: c-blosc's automatic size)."""

    storage_dtype: ClassVar[np.dtype] = np.dtype(np.uint16)
    """The dtype of the stored hidden rows."""
    has_scale: ClassVar[bool] = False
    """A float32 scale array (one per token and layer) beside each hidden array."""
    packed: ClassVar[bool] = False
    """Rows are not one stored item per value (stored_width(W) != W)."""
    lossless: ClassVar[bool] = True
    packing_only: ClassVar[tuple[str, ...]] = ("clevel", "blocksize")
    """Fields that change how chunks are packed but never what they decode to: a cache may
    hold parts packed either way, so they stay out of its identity."""
    summary: ClassVar[str] = ""
    """What the codec trades, for the message that lists the codecs."""

    def __new__(cls, **fields: Any) -> HiddenCodec:
        if cls is HiddenCodec:  # HiddenCodec(name=...): the registered class of that name
            cls = codec_class(fields.get("name", "bf16"))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if _REGISTRY.get(self.name) is not type(self):
            raise CacheError(Finding("cache.codec-name", codec_class=type(self).__name__,
                                     named=type(self).__dataclass_fields__["name"].default, name=self.name))
        if not 0 <= self.clevel <= 22:
            raise CacheError(Finding("cache.codec-level", clevel=self.clevel))
        if not 0 <= self.blocksize < 2**31:
            raise CacheError(Finding("cache.codec-blocksize", blocksize=self.blocksize))

    # -- what is stored ------------------------------------------------------------------------

    def validate(self, width: int) -> None:
        """Raise CacheError when rows of `width` values (one layer's hidden size) cannot be stored."""

    def stored_width(self, width: int) -> int:
        """Stored row width (in storage_dtype items) of `width` hidden values."""
        self.validate(width)
        return width

    def bytes_per_token(self, width: int, num_layers: int) -> int:
        """Stored bytes (before compression) of one token's `width` values over `num_layers`
        layers, its scales included."""
        scales = 4 * num_layers if self.has_scale else 0
        return self.stored_width(width) * self.storage_dtype.itemsize + scales

    def identity(self) -> dict[str, Any]:
        """What of the codec enters the cache identity (two caches whose parts may mix)."""
        return codec_identity(self.to_dict())

    @property
    def stored_form(self) -> str:
        """What a stored row means: two codecs of one stored form store the same rows (and
        scales) for the same values, so a recompress between them copies the rows as they are.
        A codec's own name unless it declares that it shares another's."""
        return self.name

    def count_nonfinite(self, stored: np.ndarray) -> int:
        """How many of the stored rows' values decode to NaN or infinity (verify's check of a
        chunk whose checksum holds); 0 for a codec that stores no such value."""
        return 0

    # -- host encode and decode (numpy) --------------------------------------------------------

    def encode(self, values: np.ndarray, num_layers: int) -> tuple[np.ndarray, np.ndarray | None]:
        """[T, K*D] float32 values -> ([T, stored_width] storage_dtype rows, [T, K] float32
        scales or None)."""
        raise NotImplementedError

    def decode(self, stored: np.ndarray, scale: np.ndarray | None, out: np.ndarray) -> np.ndarray:
        """Stored rows (and scales) -> bf16 bits (uint16) written into `out` [T, width]."""
        raise NotImplementedError

    def decode_rows(self, read_stored: Callable[[np.ndarray], None], scale: np.ndarray | None,
                    out: np.ndarray) -> np.ndarray:
        """Decode `out.shape[0]` stored rows into `out` (bf16 bits); `read_stored(buffer)` fills
        a [rows, stored_width] storage_dtype buffer with them (a codec whose stored rows are
        the bits reads them straight into `out`)."""
        stored = np.empty((out.shape[0], self.stored_width(out.shape[1])), dtype=self.storage_dtype)
        read_stored(stored)
        return self.decode(stored, scale, out)

    # -- compression of the stored chunks ------------------------------------------------------

    @property
    def shuffle(self) -> bool:
        """Byte shuffle groups the high (sign/exponent) bytes of bf16 together; for 1-byte fp8
        it would be a no-op, so it is left off there."""
        return self.storage_dtype.itemsize > 1

    def zarr_compressors(self) -> list:
        blosc = BloscCodec(
            typesize=self.storage_dtype.itemsize, cname="zstd", clevel=self.clevel,
            shuffle="shuffle" if self.shuffle else "noshuffle", blocksize=self.blocksize,
        )
        return [blosc, Crc32cCodec()]

    def compress(self, data: np.ndarray) -> bytes:
        """One stored chunk's body (before its crc32c): the Blosc chunk that zarr's BloscCodec
        of `zarr_compressors` writes for `data` (C-contiguous)."""
        shuffle = numcodecs.blosc.SHUFFLE if self.shuffle else numcodecs.blosc.NOSHUFFLE
        return numcodecs.blosc.compress(data, b"zstd", self.clevel, shuffle, self.blocksize,
                                        self.storage_dtype.itemsize)

    # -- the manifest's form -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HiddenCodec:
        """Manifest form -> codec; the fields of earlier versions in LEGACY_FIELDS are ignored."""
        codec = codec_class(data.get("name", "bf16"))
        unknown = set(data) - set(codec.__dataclass_fields__) - set(LEGACY_FIELDS)
        if unknown:
            raise CacheError(Finding("cache.codec-parameters", unknown=sorted(unknown)))
        return codec(**{k: v for k, v in data.items() if k not in LEGACY_FIELDS})


def codec_class(name: str) -> type[HiddenCodec]:
    """The registered codec class of `name` (CacheError naming the choices for another)."""
    codec = _REGISTRY.get(name)
    if codec is None:
        raise CacheError(Finding("cache.codec-unknown", name=name,
                                 choices=[[n, c.summary] for n, c in _REGISTRY.items()]))
    return codec


def codec_identity(data: dict[str, Any]) -> dict[str, Any]:
    """A manifest's codec dict less the fields that only change how chunks are packed (its
    class's `packing_only`, and LEGACY_FIELDS)."""
    codec = _REGISTRY.get(data.get("name", "bf16"))
    dropped = {*LEGACY_FIELDS, *(codec.packing_only if codec is not None else HiddenCodec.packing_only)}
    return {k: v for k, v in data.items() if k not in dropped}


def bf16_bits(values: np.ndarray, out: np.ndarray | None = None, *, quiet_nans: bool = False) -> np.ndarray:
    """float32 values -> their bf16 bits (uint16), rounded to nearest, ties to even (as torch
    rounds to bfloat16; a NaN stays a NaN). `values` is consumed (used as scratch).
    `quiet_nans`: the caller knows any NaN is a quiet one with an empty payload (a product of
    table values), which rounds to a NaN as it is: the pass that looks for NaNs is skipped."""
    bits = values.view(np.uint32)
    nan = None if quiet_nans else np.isnan(values)
    bits += 0x7FFF + ((bits >> 16) & 1)
    if out is None:
        out = np.empty(values.shape, dtype=np.uint16)
    np.right_shift(bits, 16, out=out, casting="unsafe")
    if nan is not None and nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> their float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@register_codec
@dataclass(frozen=True, kw_only=True)
class Bf16Codec(HiddenCodec):
    """bf16 bits as uint16: lossless, Blosc zstd with byte shuffle."""

    name: str = "bf16"
    summary: ClassVar[str] = "lossless"

    @property
    def stored_form(self) -> str:
        return "bf16"  # the bits (raw stores the same ones, uncompressed)

    def count_nonfinite(self, stored: np.ndarray) -> int:
        return int(np.count_nonzero((stored & 0x7F80) == 0x7F80))  # exponent all ones

    def encode(self, values: np.ndarray, num_layers: int) -> tuple[np.ndarray, None]:
        return bf16_bits(np.array(values, dtype=np.float32, order="C")), None

    def decode(self, stored: np.ndarray, scale: np.ndarray | None, out: np.ndarray) -> np.ndarray:
        out[...] = stored
        return out

    def decode_rows(self, read_stored: Callable[[np.ndarray], None], scale: np.ndarray | None,
                    out: np.ndarray) -> np.ndarray:
        read_stored(out)  # the stored rows are the bits
        return out


@register_codec
@dataclass(frozen=True, kw_only=True)
class Fp8Codec(HiddenCodec):
    """e4m3 bytes with one float32 scale per (token, layer): one outlier channel costs
    precision only inside its own row."""

    name: str = "fp8"
    storage_dtype: ClassVar[np.dtype] = np.dtype(np.uint8)
    has_scale: ClassVar[bool] = True

    def count_nonfinite(self, stored: np.ndarray) -> int:
        return int(np.count_nonzero((stored & 0x7F) == 0x7F))  # e4m3's NaN (it has no infinity)
    lossless: ClassVar[bool] = False
    summary: ClassVar[str] = "half of bf16 again at ~2-3 % error"

    def encode(self, values: np.ndarray, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
        """The extraction quantizer's algorithm (dflash.extract.codecs.quantize_fp8) on the
        host: of FP8_SCALE_CANDIDATES scales between absmax/448 and twice that, each row keeps
        the one with the smallest squared error (documented bound: 3 % per row)."""
        return encode_by_rows(self._encode_rows, values, num_layers)

    def _encode_rows(self, values: np.ndarray, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, width = values.shape
        x = np.asarray(values, dtype=np.float32).reshape(tokens, num_layers, width // num_layers)
        base = np.maximum(np.abs(x).max(axis=-1, keepdims=True) / np.float32(FP8_MAX), _TINY)
        best_q = best_scale = best_err = None
        for j in range(FP8_SCALE_CANDIDATES):
            scale = base * np.float32(2.0 ** (j / FP8_SCALE_CANDIDATES))
            q = e4m3_bits(np.clip(x / scale, -FP8_MAX, FP8_MAX))
            err = np.square(_E4M3_VALUES[q] * scale - x).sum(axis=-1, keepdims=True)
            if best_q is None:
                best_q, best_scale, best_err = q, scale, err
                continue
            better = err < best_err
            best_q = np.where(better, q, best_q)
            best_scale = np.where(better, scale, best_scale)
            best_err = np.where(better, err, best_err)
        return best_q.reshape(tokens, width), best_scale.reshape(tokens, num_layers)

    def decode(self, stored: np.ndarray, scale: np.ndarray | None, out: np.ndarray) -> np.ndarray:
        """value = e4m3(byte) * its row's scale, rounded to bf16 (what the GPU decoder computes)."""
        tokens, width = stored.shape
        layers = scale.shape[1]
        values = _E4M3_VALUES[stored]  # float32, exact
        values.reshape(tokens, layers, width // layers)[...] *= scale[:, :, None]
        return bf16_bits(values, out, quiet_nans=True)


ENCODE_BLOCK_BYTES = 16 * 2**20
"""float32 bytes of the rows a host quantizer takes at once: its search over scales makes a dozen
temporaries the size of its input, so a part's rows go through it a block at a time (memory
bounded by the block, not the part; a whole 65,536-token part of the 8B shape took 24 GB)."""


def encode_by_rows(encode_rows: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray | None]],
                   values: np.ndarray, num_layers: int) -> tuple[np.ndarray, np.ndarray | None]:
    """`encode_rows` (a codec whose rows are quantized each alone) over `values` [tokens, width] in
    blocks of ENCODE_BLOCK_BYTES: the same stored rows and scales as one call over all of them."""
    tokens, width = values.shape
    step = max(1, ENCODE_BLOCK_BYTES // (4 * max(1, width)))
    if tokens <= step:
        return encode_rows(values, num_layers)
    stored = scale = None
    for start in range(0, tokens, step):
        q, sc = encode_rows(values[start:start + step], num_layers)
        if stored is None:
            stored = np.empty((tokens, *q.shape[1:]), dtype=q.dtype)
            scale = None if sc is None else np.empty((tokens, *sc.shape[1:]), dtype=sc.dtype)
        stored[start:start + len(q)] = q
        if scale is not None:
            scale[start:start + len(sc)] = sc
    return stored, scale


def e4m3_bits(x: np.ndarray) -> np.ndarray:
    """float32 values within +-448 -> float8_e4m3fn bytes, rounded to nearest, ties to even
    (subnormals below 2^-6 in steps of 2^-9; NaN to 0x7F)."""
    a = np.abs(x)
    bits = a.view(np.uint32)
    normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) >> 20).astype(np.int32) - (120 << 3)
    sub = np.rint(a * np.float32(512)).astype(np.int32)
    code = np.where(a < np.float32(2.0 ** -6), sub, normal)
    code = np.where(np.isnan(a), 0x7F, code).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 7)


def _e4m3_values() -> np.ndarray:
    code = np.arange(256)
    exp, man = (code >> 3) & 15, (code & 7).astype(np.float64)
    mag = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * 2.0 ** (exp - 7))
    mag = np.where((code & 127) == 127, np.nan, mag)
    return np.where(code & 128, -mag, mag).astype(np.float32)


_E4M3_VALUES = _e4m3_values()


@register_codec
@dataclass(frozen=True, kw_only=True)
class Nf4Codec(HiddenCodec):
    """4-bit NF4 codes with one bf16 scale per NF4_GROUP values, in one uint8 row per token."""

    name: str = "nf4"
    storage_dtype: ClassVar[np.dtype] = np.dtype(np.uint8)
    packed: ClassVar[bool] = True
    lossless: ClassVar[bool] = False
    summary: ClassVar[str] = "0.27x of bf16 at ~8-10 % error"

    def validate(self, width: int) -> None:
        if width % NF4_GROUP:
            raise CacheError(Finding("cache.codec-nf4-width", group=NF4_GROUP, width=width))

    def stored_width(self, width: int) -> int:
        self.validate(width)
        return width // 2 + 2 * (width // NF4_GROUP)

    def count_nonfinite(self, stored: np.ndarray) -> int:
        """Every code is a value; a group's bf16 scale must be finite and not negative."""
        scales = nf4_scale_bits(stored)
        return int(np.count_nonzero(((scales & 0x7F80) == 0x7F80) | (scales >= 0x8000)))

    def encode(self, values: np.ndarray, num_layers: int) -> tuple[np.ndarray, None]:
        """The extraction quantizer's algorithm (dflash.extract.codecs.quantize_nf4) on the host:
        each group of NF4_GROUP values keeps, of NF4_SCALE_CANDIDATES fractions of its absmax
        (rounded to bf16 first), the scale with the smallest squared error."""
        self.validate(values.shape[1])
        return encode_by_rows(self._encode_rows, values, num_layers)

    def _encode_rows(self, values: np.ndarray, num_layers: int) -> tuple[np.ndarray, None]:
        tokens, width = values.shape
        g = np.asarray(values, dtype=np.float32).reshape(tokens, width // NF4_GROUP, NF4_GROUP)
        absmax = np.abs(g).max(axis=-1, keepdims=True)
        best_code = best_scale = best_err = None
        for factor in NF4_SCALE_CANDIDATES:
            scale_bits = bf16_bits(np.maximum(absmax * np.float32(factor), _TINY))
            scale = (scale_bits.astype(np.uint32) << 16).view(np.float32)
            y = g / scale
            code = np.zeros(y.shape, dtype=np.uint8)
            for m in _NF4_MIDS:  # nearest level: count the midpoints below
                code += y > m
            err = np.square(NF4_LEVELS[code] - y).sum(axis=-1, keepdims=True) * np.square(scale)
            if best_code is None:
                best_code, best_scale, best_err = code, scale_bits, err
                continue
            better = err < best_err
            best_code = np.where(better, code, best_code)
            best_scale = np.where(better, scale_bits, best_scale)
            best_err = np.where(better, err, best_err)
        codes = best_code.reshape(tokens, width // 2, 2)
        packed = codes[..., 0] | (codes[..., 1] << 4)
        scale_bytes = np.ascontiguousarray(best_scale.reshape(tokens, width // NF4_GROUP)).astype("<u2").view(np.uint8)
        return np.concatenate([packed, scale_bytes], axis=1), None

    def decode(self, stored: np.ndarray, scale: np.ndarray | None, out: np.ndarray) -> np.ndarray:
        return decode_nf4(stored, out.shape[1], out=out)


@register_codec
@dataclass(frozen=True, kw_only=True)
class RawCodec(Bf16Codec):
    """bf16 bits as uint16, uncompressed (each chunk still checksummed)."""

    name: str = "raw"
    summary: ClassVar[str] = "uncompressed bf16"

    def zarr_compressors(self) -> list:
        return [Crc32cCodec()]

    def compress(self, data: np.ndarray) -> bytes:
        return data.tobytes()


CODEC_NAMES = codec_names()  # the shipped codecs (a test may register more)


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
_NF4_MIDS = [(float(a) + float(b)) / 2 for a, b in zip(NF4_LEVELS[:-1], NF4_LEVELS[1:])]


def small_array_compressors() -> list:
    """Codecs of the per-token metadata arrays (ids, masks, offsets, scales)."""
    return [ZstdCodec(level=3), Crc32cCodec()]
