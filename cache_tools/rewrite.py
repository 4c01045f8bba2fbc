"""Caches written anew from others: `recompress` (another codec) and `merge` (several
caches of the same target and settings into one).

Part of the logic behind `dflash-cache` (see `maintenance`): the functions raise `CacheError`
subclasses for problems that stop them and return a `CopyReport` that the CLI prints. Both
commit part by part through `CacheWriter`, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from dflash.runtime.findings import Finding
from dflash.runtime.locks import same_path

from .cache_set import check_distinct_data
from .codecs import HiddenCodec
from .errors import CacheError, CacheNotFoundError, CacheStorageError, ConfigMismatchError
from .eviction import refuse_evicted
from .identity import Purpose
from .maintenance import progress_bar
from .manifest import HEADER_FILE, IDENTITY_KEYS, identity_differences
from .plan import unfinished_extraction
from .reader import CacheReader
from .schema import SAMPLE_IDS, sample_offsets
from .summary import raw_bf16_bytes
from .writer import CacheWriter, PartWriter


def _iter_part_samples(reader: CacheReader, part_idx: int, dst_codec: HiddenCodec) -> Iterator[tuple[int, dict[str, Any]]]:
    """(sample_id, add_sample keyword arguments) for every sample of one part, in order.

    When both codecs store the same thing (`HiddenCodec.stored_form`: bf16 bits, or fp8 bytes
    with their scales) the stored arrays pass through untouched, so a copy is exact; otherwise samples are decoded
    to bf16 and re-encoded by the writer.
    """
    pf = reader.part_arrays(part_idx)
    rec = reader.parts[part_idx]
    passthrough = reader.manifest.codec.stored_form == dst_codec.stored_form  # (bf16 and raw: the same bits)
    per_token = [spec for spec in reader.schema if spec.per == "token"]
    offsets = sample_offsets(rec.lengths)
    for j, sid in enumerate(pf.small_array(SAMPLE_IDS).tolist()):
        start, stop = int(offsets[j]), int(offsets[j + 1])
        if passthrough:
            kw: dict[str, Any] = {}
            for spec in per_token:
                if spec.chunked:
                    kw[spec.name] = np.empty((stop - start, *spec.row_shape), dtype=spec.dtype)
                    pf.read_rows(spec.name, start, stop, kw[spec.name])
                else:
                    kw[spec.name] = pf.small_array(spec.name)[start:stop]
        else:  # decoded to bf16 (no scales), re-encoded by the writer
            kw = dict(reader.read_tokens(part_idx, start, stop))
        yield sid, kw


def _copy_part(reader: CacheReader, part_idx: int, pw: PartWriter, dst_codec: HiddenCodec) -> None:
    keys = reader.parts[part_idx].split_keys  # kept as they are (none: the copy splits by id, as its source)
    grouped = set(reader.parts[part_idx].grouped or ())
    for j, (sid, kw) in enumerate(_iter_part_samples(reader, part_idx, dst_codec)):
        pw.add_sample(sid, **kw, split_key=None if keys is None else keys[j], grouped=j in grouped)
    pw.stats.update(reader.parts[part_idx].stats)


@dataclass
class CopyReport:
    """What recompress or merge did: parts written now, parts already there, sizes."""

    dst: Path
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    src_bytes: int = 0
    dst_bytes: int = 0
    dst_tokens: int = 0
    raw_bf16_bytes: int = 0


def _copy_parts(
    jobs: list[tuple[CacheReader, int, str]], writer: CacheWriter, report: CopyReport, desc: str,
    progress: bool | None,
) -> None:
    done = writer.committed()
    with progress_bar(sum(r.parts[i].tokens for r, i, _ in jobs), desc, "tok", progress) as bar:
        for reader, i, name in jobs:
            if name in done:
                report.skipped.append(name)
            else:
                try:
                    with writer.part_writer(name) as pw:
                        _copy_part(reader, i, pw, writer.codec)
                except OSError as e:  # a full disk: its OSError names no file (a write's)
                    raise CacheStorageError(Finding("cache.part-write-failed", part=name, cache=str(writer.cache_dir),
                                                    error=str(e.strerror or e),
                                                    file=e.filename and str(e.filename))) from e
                (report.written if pw.committed else report.skipped).append(name)
            reader.part_arrays(i).close()
            bar.update(reader.parts[i].tokens)
    final = writer.manifest()
    report.dst_bytes, report.dst_tokens, report.raw_bf16_bytes = final.nbytes, final.num_tokens, raw_bf16_bytes(final)


def _check_distinct(dst: Path, srcs: list[Path]) -> None:
    """The destination is none of the sources, and no source is given twice (also through links)."""
    for i, s in enumerate(srcs):
        if same_path(dst, s):
            raise CacheError(Finding("cache.destination-is-source", dst=str(dst), src=None if dst == s else str(s)))
        for earlier in srcs[:i]:
            if same_path(earlier, s):
                raise CacheError(Finding("cache.source-twice", src=str(s), also=None if earlier == s else str(earlier)))


def recompress_cache(
    src: str | os.PathLike, dst: str | os.PathLike, *, codec: str, clevel: int = 1, force: bool = False,
    progress: bool | None = None,
) -> CopyReport:
    """Write a copy of `src` with another hidden-state codec: same parts, same sample ids.

    Resumable: parts already committed in `dst` are skipped, so rerunning after an
    interruption finishes the job. A `dst` written with other settings is refused.
    """
    src, dst = Path(src), Path(dst)
    _check_distinct(dst, [src])
    reader = CacheReader(src)
    refuse_evicted(src, "recompress")
    new_codec = HiddenCodec(name=codec, clevel=clevel)
    header = copy.deepcopy(reader.manifest.header)
    header["hidden"]["codec"] = new_codec.to_dict()
    header["hidden"]["storage_dtype"] = new_codec.storage_dtype.name
    earlier = header.get("producer", {})
    # Every codec the values went through, oldest first: a lossy one (fp8, nf4) sets their precision
    # whatever the codec now (an older recompress recorded only its own source).
    history = earlier.get("codec_history") or (
        [earlier["recompressed_from"]["name"]] if isinstance(earlier.get("recompressed_from"), dict) else [])
    header["producer"] = {**earlier, "recompressed_from": reader.manifest.codec.to_dict(),
                          "codec_history": [*history, reader.manifest.codec.name]}
    writer = CacheWriter(dst, header, force=force, sole_writer="recompress", purpose="recompress")
    report = CopyReport(dst=dst, src_bytes=reader.manifest.nbytes)
    jobs = [(reader, i, p.name) for i, p in enumerate(reader.parts)]
    _copy_parts(jobs, writer, report, "recompress", progress)
    return report


def merge_caches(
    dst: str | os.PathLike, srcs: list[str | os.PathLike], *, force: bool = False, progress: bool | None = None,
) -> CopyReport:
    """Merge caches of the same target, layers, codec and settings into one new cache.

    Part `p` of the i-th source becomes `s{i}-p`; sample ids are kept (the part prefix tells
    the source). The merged header's data section lists the sources. Resumable like recompress.
    """
    dst, paths = Path(dst), [Path(s) for s in srcs]
    if not paths:
        raise CacheError(Finding("cache.merge-no-source"))
    _check_distinct(dst, paths)
    readers = []
    for p in paths:
        try:
            readers.append(CacheReader(p))
        except CacheNotFoundError as e:
            if not (dst / HEADER_FILE).exists():
                raise
            raise CacheNotFoundError(Finding("cache.merge-source-missing", missing=e.finding or str(e),
                                             dst=str(dst))) from None
    for p, r in zip(paths, readers):
        refuse_evicted(p, "merge")
        if (left := unfinished_extraction(p, r.manifest.header, {q.name for q in r.parts})) is not None:
            raise CacheError(Finding("cache.merge-unfinished", cache=str(p), **left.fields()))
    first = readers[0].manifest
    keys = tuple(k for k in IDENTITY_KEYS if k != "data")  # each source has its own data
    for p, r in zip(paths[1:], readers[1:]):
        diffs = identity_differences(first.header, r.manifest.header, Purpose.MERGE, keys=keys)
        if diffs:
            raise ConfigMismatchError(Finding("cache.merge-settings-differ", cache=str(p), first=str(paths[0]),
                                              differences=[[key, repr(a), repr(b)] for key, a, b in diffs[:6]],
                                              more=len(diffs) > 6))
    check_distinct_data(readers, "merge")  # (after the identity: other targets' say so first)
    header = copy.deepcopy(first.header)
    header["provenance"] = {"merged_from": [r.manifest.header.get("provenance", {}) for r in readers]}
    header["data"] = {"merged_from": [
        {"prefix": f"s{i}", "source": str(p.resolve()), "data": r.manifest.header.get("data", {}),
         "parts": len(r.parts), "samples": r.manifest.num_samples, "tokens": r.manifest.num_tokens}
        for i, (p, r) in enumerate(zip(paths, readers))
    ]}
    writer = CacheWriter(dst, header, force=force, sole_writer="merge", purpose="merge")
    report = CopyReport(dst=dst, src_bytes=sum(r.manifest.nbytes for r in readers))
    jobs = [(r, j, f"s{i}-{rec.name}") for i, r in enumerate(readers) for j, rec in enumerate(r.parts)]
    _copy_parts(jobs, writer, report, "merge", progress)
    return report
