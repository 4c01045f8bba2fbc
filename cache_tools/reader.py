"""The hot read path: decode exactly the chunks that cover a sample, straight from mmaps.

zarr writes the parts; CacheReader reads a cache's samples through one PartFiles per part
(part_files.py), without zarr's per-call machinery. Only the manifest is read at open; parts
are touched when a sample of theirs is requested. Forked or pickled copies (DataLoader workers)
drop the open maps and reopen lazily. Samples come out as numpy arrays (hidden states as bf16
bits, uint16, decoded by the cache's codec): this module imports no torch; the trainer views
them as tensors (`dflash.train.data.loader`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from .manifest import PARTS_DIR, Manifest, read_manifest
from .part_files import PartFiles, ScratchBuffer
from .sample_scores import top1_selected
from .schema import (
    DATA,
    HIDDEN_ARRAYS,
    INPUT_IDS,
    LOSS_MASK,
    SAMPLE_IDS,
    TOP1_IDS,
    TOP1_KNOWN,
    TOPK_LOGPROBS,
    PartSchema,
    sample_offsets,
    scale_of,
)


class CacheReader:
    """Random access to the samples of one cache, as numpy arrays.

    Opening reads the manifest only. `read_sample(i)` returns a dict with
      hidden      [T, K*D] uint16: bf16 bits (a lossy codec's rows decoded by the codec)
      input_ids   [T] int64, loss_mask [T] uint8, sample_id (int)
      last_hidden [T, D] uint16 bf16 bits, topk_ids [T, k] int64, topk_logprobs [T, k] float32,
                  top1_ids [T, 1] int64 when the cache stores them;
      top1_known  (bool, with top1_ids) whether top1_ids hold the target's top-1: a cache of
                  --top1-share F holds it for the samples whose split key scores below F
                  (sample_scores.top1_selected), zeros for the others.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike,
        *,
        verify_checksums: bool = True,
        max_open_parts: int = 64,
        manifest: Manifest | None = None,
        stage: Any = None,
        check_metadata: bool = True,
    ):
        """`check_metadata`: each array's metadata is checked against the manifest when the array
        is first read (off only for verify, which collects those problems itself)."""
        self.cache_dir = Path(cache_dir)
        self.check_metadata = check_metadata
        self.stage = stage  # a StagedCache whose directory cache_dir is: parts are fetched as read
        self.manifest = manifest if manifest is not None else read_manifest(self.cache_dir)
        self.verify_checksums = verify_checksums
        self.max_open_parts = max_open_parts
        self.parts = self.manifest.parts
        counts = np.array([p.samples for p in self.parts], dtype=np.int64)
        self._part_start = np.concatenate([[0], np.cumsum(counts)])
        self.lengths = (
            np.concatenate([np.asarray(p.lengths, dtype=np.int64) for p in self.parts])
            if self.parts else np.zeros(0, dtype=np.int64)
        )
        self._codec = self.manifest.codec
        self.schema = PartSchema.from_header(self.manifest.header)
        self._open: OrderedDict[int, PartFiles] = OrderedDict()
        self._scratch = ScratchBuffer()
        self._token_offsets: dict[int, np.ndarray] = {}
        self._pid = os.getpid()

    @property
    def top1_share(self) -> float:
        """The share of samples whose top1_ids hold the target's top-1 (0: none stored)."""
        return self.manifest.top1_share

    # Forked / pickled copies must not share maps or caches with their parent.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        state["_scratch"] = ScratchBuffer()
        return state

    def _part(self, part_idx: int) -> PartFiles:
        if self._pid != os.getpid():
            self._open = OrderedDict()
            self._scratch = ScratchBuffer()
            self._pid = os.getpid()
        pf = self._open.get(part_idx)
        if pf is None:
            record = self.parts[part_idx]
            pf = PartFiles(self.cache_dir / PARTS_DIR / record.name, record, self.verify_checksums,
                            self._scratch, self.stage, self.schema if self.check_metadata else None)
            self._open[part_idx] = pf
            if len(self._open) > self.max_open_parts:
                self._open.popitem(last=False)[1].close()
        else:
            self._open.move_to_end(part_idx)
        return pf

    def close(self) -> None:
        for pf in self._open.values():
            pf.close()
        self._open.clear()

    def close_part(self, part_idx: int) -> None:
        """Drop one part's maps (its files were evicted or replaced: a read opens them anew)."""
        pf = self._open.pop(part_idx, None)
        if pf is not None:
            pf.close()

    def __len__(self) -> int:
        return int(self._part_start[-1])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (part index, sample index inside the part)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for a cache of {len(self)} samples")
        part = int(np.searchsorted(self._part_start, index, side="right") - 1)
        return part, index - int(self._part_start[part])

    def _offsets(self, part_idx: int) -> np.ndarray:
        off = self._token_offsets.get(part_idx)
        if off is None:
            off = sample_offsets(self.parts[part_idx].lengths)
            self._token_offsets[part_idx] = off
        return off

    def read_sample(
        self, index: int, *, max_tokens: int | None = None, out: dict[str, np.ndarray] | None = None,
        dequantize: bool = True,
    ) -> dict[str, Any]:
        """Sample `index` (global order: parts in commit order), optionally its first max_tokens.

        `out` may hold preallocated uint16 arrays (bf16 bits) for "hidden" (and "last_hidden")
        with exactly the sample's rows, e.g. a view of a slice of a padded batch: chunks are
        decoded straight into them, which saves a copy and the page faults of a fresh buffer
        per sample. With dequantize=False the hidden arrays come as stored (the codec's
        storage dtype, with their "hidden_scale" float32 [T, K] where the codec keeps scales),
        for a decoder on the GPU (`dflash.train.data.codecs`); `out` then holds arrays of those dtypes.
        """
        part_idx, local, start, stop = self._sample_rows(index, max_tokens)
        result = self.read_tokens(part_idx, start, stop, out=out, dequantize=dequantize)
        result["sample_id"] = int(self._part(part_idx).small_array(SAMPLE_IDS)[local])
        if TOP1_IDS in result:  # --top1-share: the other samples' rows hold 0, not a top-1
            result[TOP1_KNOWN] = self.top1_known(part_idx, local, result["sample_id"])
        return result

    def read_ids(self, index: int, *, max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Sample `index`'s token ids (int64) and loss mask (bool) alone, optionally its first
        max_tokens: what statistics of the text read, without decoding its hidden states. The
        part's id and mask arrays stay decoded while the part is open (`close_part` drops them):
        read a part's samples together."""
        part_idx, _, start, stop = self._sample_rows(index, max_tokens)
        pf = self._part(part_idx)  # its arrays are decoded once and kept until the part is closed
        return (pf.small_array(INPUT_IDS)[start:stop].astype(np.int64),
                pf.small_array(LOSS_MASK)[start:stop].astype(bool))

    def read_top1_logprobs(self, index: int, *, max_tokens: int | None = None) -> np.ndarray | None:
        """Sample `index`'s top-1 log-prob of the target at each token (float32, the first of its
        stored top-k), optionally its first max_tokens, without its hidden states: how sure the
        target was of its text. None for a cache without top-k log-probs."""
        if TOPK_LOGPROBS not in self.schema:
            return None
        part_idx, _, start, stop = self._sample_rows(index, max_tokens)
        spec = self.schema[TOPK_LOGPROBS]
        rows = np.empty((stop - start, *spec.row_shape), dtype=spec.dtype)
        self._part(part_idx).read_rows(TOPK_LOGPROBS, start, stop, rows)
        return rows[:, 0].astype(np.float32)

    def _sample_rows(self, index: int, max_tokens: int | None) -> tuple[int, int, int, int]:
        """(part, index in it, first token row, end row) of sample `index`, cut at max_tokens."""
        part_idx, local = self.locate(index)
        off = self._offsets(part_idx)
        start, stop = int(off[local]), int(off[local + 1])
        return part_idx, local, start, stop if max_tokens is None else min(stop, start + max_tokens)

    def top1_known(self, part_idx: int, local: int, sample_id: int) -> bool:
        """Whether sample `local` of part `part_idx` has its top-1 in a cache of top-1 share below
        1: the score of its split key (its part's recorded key, else its sample id, as the
        extraction selected it) is below the share."""
        if self.top1_share >= 1:
            return True
        keys = self.parts[part_idx].split_keys
        key = sample_id if keys is None else keys[local]
        return bool(top1_selected(np.array([key], np.int64), self.top1_share)[0])

    def _read_hidden(self, pf: PartFiles, array: str, start: int, stop: int,
                     into: dict[str, np.ndarray], decode: bool) -> dict[str, np.ndarray]:
        """{array: bf16 bits} decoded by the codec, or with decode=False {array: stored rows,
        and its scale where the schema has one} for the caller to decode on its GPU."""
        n, spec, scale_name = stop - start, self.schema[array], scale_of(array)
        pf.array_meta(array)  # the hidden array's metadata is checked before its scale's
        scale = pf.small_array(scale_name)[start:stop] if scale_name in self.schema else None
        if not decode:
            got = {array: _out(into, array, (n, spec.width), spec.dtype)}
            pf.read_rows(array, start, stop, got[array])
            if scale is not None:
                got[scale_name] = _out(into, scale_name, scale.shape, scale.dtype)
                got[scale_name][...] = scale
            return got
        out = _out(into, array, (n, self.schema.value_width(array)), np.dtype(np.uint16))
        self._codec.decode_rows(lambda rows: pf.read_rows(array, start, stop, rows), scale, out)
        return {array: out}

    def read_tokens(self, part_idx: int, start: int, stop: int,
                    out: dict[str, np.ndarray] | None = None, *, dequantize: bool = True) -> dict[str, Any]:
        """Token rows [start, stop) of one part (any range, also across sample boundaries)."""
        pf = self._part(part_idx)
        into = out or {}
        rows: dict[str, Any] = {}
        for spec in self.schema:  # ids come out as int64 (what embeddings and losses index with)
            if spec.name in HIDDEN_ARRAYS:  # their scales are read with them
                rows.update(self._read_hidden(pf, spec.name, start, stop, into, dequantize))
            elif spec.per == "token" and spec.chunked:  # top-k, top-1
                arr = np.empty((stop - start, *spec.row_shape), dtype=spec.dtype)
                pf.read_rows(spec.name, start, stop, arr)
                rows[spec.name] = arr.astype(np.int64) if arr.dtype.kind in "iu" else arr
            elif spec.source == DATA:
                arr = pf.small_array(spec.name)[start:stop]
                rows[spec.name] = arr.astype(np.int64) if arr.dtype == np.int32 else arr.copy()
        return rows

    def part_arrays(self, part_idx: int) -> PartFiles:
        """Low-level access for tools (verify, stats)."""
        return self._part(part_idx)


def _out(into: dict[str, np.ndarray], name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The caller's buffer for `name` (checked: contiguous, this shape and dtype), or a new one."""
    out = into.get(name)
    if out is None:
        return np.empty(shape, dtype=dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"out[{name!r}] must be a contiguous {np.dtype(dtype).name} array of shape {tuple(shape)}")
    return out
