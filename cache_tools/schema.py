"""What a part holds: its arrays, their dtypes and widths, how they are chunked and compressed.

The one declaration of the part layout (docs/cache-format.md, "Parts"). The writer, the
reader, `verify`, recompress/merge, extraction's part buffers and the trainer's loader all
iterate over a `PartSchema` built from the cache header, instead of naming arrays themselves.

Per token (T rows):
  hidden            [T, K*D] storage dtype of the codec (uint16 bf16 bits, uint8 fp8 bits)
  hidden_scale      [T, K]   float32, fp8 only: one scale per (token, layer)
  last_hidden       [T, D]   as hidden, with --store-last-hidden
  last_hidden_scale [T, 1]   float32, fp8 with --store-last-hidden
  topk_ids          [T, k]   int32, with --store-topk k
  topk_logprobs     [T, k]   float32, with --store-topk k
  top1_ids          [T, 1]   uint16 (vocab <= 65,536) or int32: the target's greedy next token
                             (argmax), by default (--no-store-top1 leaves it out; older caches lack it);
                             with extras.top1_share F < 1 only for the samples of score below F
                             (sample_scores.top1_selected), 0 in every row of the others
  input_ids         [T]      int32
  loss_mask         [T]      uint8
Per sample (S of them):
  offsets           [S+1]    int64, CSR: sample i is rows offsets[i]:offsets[i+1]
  sample_ids        [S]      int64, the global id of each sample (its source record)
The commit record (manifest.PartRecord) lists the sample ids again and each sample's split key,
a hash of its prompt (sample_scores.prompt_split_key), recomputable from input_ids and loss_mask,
or of its record's "group" (group_split_key) for the samples the record lists as `grouped`.

Storage: the hidden arrays (`HIDDEN_ARRAYS`) are sharded along rows (`shard_rows` rows of
`chunk_rows`-row chunks, full width) with the header's codec; the top-k arrays likewise with
the small-array codecs; every other array is one chunk per part with the small-array codecs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

HIDDEN = "hidden"
HIDDEN_SCALE = "hidden_scale"
LAST_HIDDEN = "last_hidden"
LAST_HIDDEN_SCALE = "last_hidden_scale"
TOPK_IDS = "topk_ids"
TOPK_LOGPROBS = "topk_logprobs"
TOP1_IDS = "top1_ids"
TOP1_KNOWN = "top1_known"  # not an array: the reader's flag of a sample whose top1_ids hold its top-1
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
OFFSETS = "offsets"
SAMPLE_IDS = "sample_ids"
SPLIT_KEYS = "split_keys"  # not an array: the commit record's hash of each sample's prompt (sample_scores)

HIDDEN_ARRAYS = (HIDDEN, LAST_HIDDEN)
"""Arrays of hidden states: stored with the cache's codec, decoded to bf16 by readers."""
TOPK_ARRAYS = (TOPK_IDS, TOPK_LOGPROBS)
TOP1_DTYPES = ("uint16", "int32")
"""Storage dtypes of top1_ids (the header's extras.top1): the smallest that holds the vocabulary."""


def top1_dtype(vocab_size: int) -> str:
    """The top1_ids dtype for a target of `vocab_size` ids."""
    return "uint16" if vocab_size <= 1 << 16 else "int32"

# Where an array's rows come from.
TARGET = "target"  # computed by the target's forward (extraction's part buffers hold these)
DATA = "data"  # the tokenized records
INDEX = "index"  # the part's sample index

# How an array is stored.
HIDDEN_CHUNKS = "hidden"  # sharded row chunks, the header's codec (written by part_layout.write_shards)
ROW_CHUNKS = "rows"  # sharded row chunks, the small-array codecs
ONE_CHUNK = "one"  # one chunk per part, the small-array codecs (read whole, once per part)


def scale_of(name: str) -> str:
    """The fp8 scale array of a hidden array ('hidden' -> 'hidden_scale')."""
    return f"{name}_scale"


@dataclass(frozen=True)
class ArraySpec:
    """One array of a part: its name, row kind, width (None: 1-D), dtype, source and storage."""

    name: str
    per: str  # "token" (T rows), "sample" (S rows) or "boundary" (S+1 rows)
    width: int | None
    dtype: np.dtype
    source: str
    storage: str

    @property
    def chunked(self) -> bool:
        """Sharded in row chunks of the header's chunk_rows/shard_rows (else one chunk per part)."""
        return self.storage != ONE_CHUNK

    @property
    def row_shape(self) -> tuple[int, ...]:
        return () if self.width is None else (self.width,)

    def rows(self, tokens: int, samples: int) -> int:
        return {"token": tokens, "sample": samples, "boundary": samples + 1}[self.per]

    def shape(self, tokens: int, samples: int) -> tuple[int, ...]:
        return (self.rows(tokens, samples), *self.row_shape)


def _unpacked(width: int) -> int:
    return width


class PartSchema:
    """The arrays of every part of one cache, in the order they are written."""

    def __init__(self, *, num_layers: int, hidden_size: int, storage_dtype: Any, has_scale: bool,
                 last_hidden: bool, topk: int, chunk_rows: int = 128, shard_rows: int = 8192,
                 top1: str | None = None, stored_width: Callable[[int], int] | None = None):
        self.num_layers, self.hidden_size = int(num_layers), int(hidden_size)
        # A packed codec (nf4) stores a row of W values in stored_width(W) items.
        self.stored_width = stored_width or _unpacked
        self.storage_dtype = np.dtype(storage_dtype)
        self.has_scale, self.last_hidden, self.topk = bool(has_scale), bool(last_hidden), int(topk)
        if top1 is not None and top1 not in TOP1_DTYPES:
            raise ValueError(f"top1 dtype {top1!r} is not one of {', '.join(TOP1_DTYPES)}.")
        self.top1 = top1
        self.chunk_rows, self.shard_rows = int(chunk_rows), int(shard_rows)
        f32, sd = np.dtype(np.float32), self.storage_dtype
        packed = self.stored_width
        specs = [ArraySpec(HIDDEN, "token", packed(self.num_layers * self.hidden_size), sd, TARGET, HIDDEN_CHUNKS)]
        if self.has_scale:
            specs.append(ArraySpec(HIDDEN_SCALE, "token", self.num_layers, f32, TARGET, ONE_CHUNK))
        if self.last_hidden:
            specs.append(ArraySpec(LAST_HIDDEN, "token", packed(self.hidden_size), sd, TARGET, HIDDEN_CHUNKS))
            if self.has_scale:
                specs.append(ArraySpec(LAST_HIDDEN_SCALE, "token", 1, f32, TARGET, ONE_CHUNK))
        if self.topk:
            specs += [ArraySpec(TOPK_IDS, "token", self.topk, np.dtype(np.int32), TARGET, ROW_CHUNKS),
                      ArraySpec(TOPK_LOGPROBS, "token", self.topk, f32, TARGET, ROW_CHUNKS)]
        if self.top1:
            specs.append(ArraySpec(TOP1_IDS, "token", 1, np.dtype(self.top1), TARGET, ROW_CHUNKS))
        specs += [
            ArraySpec(INPUT_IDS, "token", None, np.dtype(np.int32), DATA, ONE_CHUNK),
            ArraySpec(LOSS_MASK, "token", None, np.dtype(np.uint8), DATA, ONE_CHUNK),
            ArraySpec(OFFSETS, "boundary", None, np.dtype(np.int64), INDEX, ONE_CHUNK),
            ArraySpec(SAMPLE_IDS, "sample", None, np.dtype(np.int64), INDEX, ONE_CHUNK),
        ]
        self._specs = {s.name: s for s in specs}

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> PartSchema:
        """The schema a cache header declares (widths from its layer count and hidden size)."""
        from .codecs import HiddenCodec  # (the codec's compressors need zarr: imported on use)

        hidden = header["hidden"]
        codec = HiddenCodec.from_dict(hidden["codec"])
        extras = header.get("extras", {})
        return cls(num_layers=len(header["target_layer_ids"]), hidden_size=hidden["hidden_size"],
                   storage_dtype=codec.storage_dtype, has_scale=codec.has_scale,
                   last_hidden=bool(extras.get("last_hidden")), topk=int(extras.get("topk", 0)),
                   chunk_rows=hidden.get("chunk_rows", 128), shard_rows=hidden.get("shard_rows", 8192),
                   top1=extras.get("top1") or None, stored_width=codec.stored_width)

    def __iter__(self) -> Iterator[ArraySpec]:
        return iter(self._specs.values())

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __getitem__(self, name: str) -> ArraySpec:
        return self._specs[name]

    @property
    def names(self) -> list[str]:
        return list(self._specs)

    def from_target(self) -> list[ArraySpec]:
        """The arrays the target's forward computes (what extraction's part buffers hold)."""
        return [s for s in self if s.source == TARGET]

    def hidden_arrays(self) -> list[ArraySpec]:
        """The hidden-state arrays this cache stores (hidden, and last_hidden when kept)."""
        return [self[n] for n in HIDDEN_ARRAYS if n in self]

    def value_width(self, name: str) -> int:
        """Values per row of hidden array `name` once decoded (K*D for hidden, D for last_hidden)."""
        return self.num_layers * self.hidden_size if name == HIDDEN else self.hidden_size

    def scale_width(self, name: str) -> int:
        """Columns of the fp8 scale of hidden array `name` (its layer count)."""
        return self.num_layers if name == HIDDEN else 1

    def chunking(self, spec: ArraySpec, rows: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(zarr chunk shape, shard shape or None) of an array of `rows` rows."""
        if not spec.chunked:
            return (rows, *spec.row_shape), None
        return (self.chunk_rows, *spec.row_shape), (self.shard_rows, *spec.row_shape)

    def compressors(self, spec: ArraySpec, codec: Any) -> list:
        """zarr bytes-to-bytes codecs of an array: the cache codec's for hidden states."""
        from .codecs import small_array_compressors

        return codec.zarr_compressors() if spec.storage == HIDDEN_CHUNKS else small_array_compressors()


def shard_key(shard: int, ndim: int) -> str:
    """The file of shard (or chunk) `shard` of an ndim-array, relative to its directory: 'c/3/0'."""
    return f"c/{shard}" + "/0" * (ndim - 1)


def sample_offsets(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """CSR offsets [S+1] (int64) of samples of these token counts."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=out[1:])
    return out
