"""Cache maintenance: info, verify, stats, prune (recompress and merge: `rewrite`).

The logic behind `dflash-cache`, importable without click. Every function takes a cache
directory, raises `DflashError` subclasses for problems that stop it (missing directory, not
a cache, mismatched caches), and returns plain data that the CLI prints. `verify_cache` is
the exception to "stop at the first problem": it collects every problem it finds.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from dflash.runtime.findings import Finding, render
from dflash.runtime.fsio import file_lock
from tqdm import tqdm

from .codecs import bf16_values
from .errors import CacheCorruptError
from .eviction import EVICTION_FILE, EvictionLog, refuse_evicted
from .manifest import (
    LOCK_FILE,
    LOG_FILE,
    PARTS_DIR,
    Manifest,
    PartRecord,
    decode_log_line,
    read_header,
)
from .orphans import find_orphans, orphan_name, remove_orphans
from .part_files import PartFiles
from .plan import unfinished_extraction
from .reader import CacheReader
from .sample_scores import prompt_split_key
from .schema import (
    HIDDEN,
    HIDDEN_ARRAYS,
    INPUT_IDS,
    LOSS_MASK,
    OFFSETS,
    SAMPLE_IDS,
    SPLIT_KEYS,
    PartSchema,
    sample_offsets,
    scale_of,
    shard_key,
)
from .shard_format import EMPTY


def progress_bar(total: int, desc: str, unit: str, progress: bool | None) -> tqdm:
    """A progress bar on stderr; progress=None shows it only on a terminal."""
    return tqdm(total=total, desc=desc, unit=unit, disable=None if progress is None else not progress,
                leave=False, dynamic_ncols=True)


# -- verify -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One thing verify found wrong: the part and array, and a `cache.verify-*` finding whose
    fields say what and where inside them (chunk, rows, file, line)."""

    part: str | None  # None: the cache as a whole (manifest, commit log)
    array: str | None
    finding: Finding

    @property
    def where(self) -> str:
        """Where inside the part, e.g. "chunk 3 (rows 384-511) in shard file hidden/c/0/0"."""
        from .messages import verify_location

        return verify_location(**{k: self.finding.fields.get(k) for k in ("chunk", "rows", "shard_file", "file", "line")})

    def __str__(self) -> str:
        loc = " ".join(x for x in (self.part or "cache", self.array, self.where) if x)
        return f"{loc}: {render(self.finding)}"


@dataclass
class VerifyReport:
    cache_dir: Path
    fast: bool
    parts: int = 0
    chunks: int = 0
    problems: list[Problem] = field(default_factory=list)
    notes: list[Finding] = field(default_factory=list)
    """What verify tells beside the problems (`cache.verify-*` notices), rendered where printed."""
    planned: int | None = None
    """Parts the extraction's plan promises when more than are committed (an unfinished cache)."""
    evicted: list[str] = field(default_factory=list)
    """Committed parts not checked: evicted under a disk budget (their files deleted by design)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_parts(self) -> list[str]:
        return sorted({p.part for p in self.problems if p.part})


@dataclass(frozen=True)
class _Expected:
    rows: int
    width: tuple[int, ...]
    dtype: np.dtype
    chunked: bool  # sharded with the cache's chunk/shard rows; else one chunk per part


def expected_arrays(m: Manifest, rec: PartRecord) -> dict[str, _Expected]:
    """The arrays a part must hold, with their shapes and dtypes (the part schema)."""
    return {spec.name: _Expected(spec.rows(rec.tokens, rec.samples), spec.row_shape, spec.dtype, spec.chunked)
            for spec in PartSchema.from_header(m.header)}


def _unreadable(e: CacheCorruptError, **where: Any) -> Finding:
    """A part file the reader refused (its finding, which verify renders as the reason only)."""
    return Finding("cache.verify-unreadable", error=e.finding if e.finding is not None else str(e), **where)


def _read_log_tolerant(cache_dir: Path, report: VerifyReport) -> list[PartRecord]:
    """Commit records in order; damaged lines become problems instead of stopping."""
    try:
        data = (cache_dir / LOG_FILE).read_bytes()
    except FileNotFoundError:
        return []
    records: dict[str, PartRecord] = {}
    end = data.rfind(b"\n") + 1
    if end != len(data):
        report.notes.append(Finding("cache.verify-log-torn", file=LOG_FILE))
    for i, line in enumerate(data[:end].splitlines(keepends=True), 1):
        try:
            rec = decode_log_line(line, f"{LOG_FILE}, line {i}")
        except (CacheCorruptError, ValueError, KeyError, TypeError) as e:
            error = e.finding if isinstance(e, CacheCorruptError) and e.finding is not None else str(e)
            report.problems.append(Problem(None, None, Finding("cache.verify-commit-line", file=LOG_FILE, line=i,
                                                               error=error)))
            continue
        records[rec.name] = rec
    return list(records.values())


def _check_structure(
    pf: PartFiles, m: Manifest, name: str, exp: _Expected, report: VerifyReport
) -> tuple[Any, set[int]]:
    """Metadata, files and shard indexes of one array; returns (meta or None, bad shards)."""
    rec = pf.record
    bad = lambda finding: report.problems.append(Problem(rec.name, name, finding))  # noqa: E731
    try:
        meta = pf.array_meta(name)
    except CacheCorruptError as e:
        bad(_unreadable(e, file="zarr.json"))
        return None, set()
    shape = (exp.rows, *exp.width)
    if tuple(meta.shape) != shape or meta.dtype != exp.dtype:
        bad(Finding("cache.verify-metadata-shape", shape=list(meta.shape), dtype=str(meta.dtype),
                    expected_shape=list(shape), expected_dtype=str(exp.dtype)))
        return None, set()
    if not exp.chunked:
        path = pf.dir / name / shard_key(0, len(shape))
        if not path.is_file() or path.stat().st_size == 0:
            bad(Finding("cache.verify-file-missing", file=f"{name}/{shard_key(0, len(shape))}"))
            return None, set()
        return meta, set()
    if meta.chunk_rows != m.chunk_rows or meta.shard_rows != m.shard_rows:
        bad(Finding("cache.verify-metadata-chunks", chunk_rows=meta.chunk_rows, shard_rows=meta.shard_rows,
                    expected_chunk_rows=m.chunk_rows, expected_shard_rows=m.shard_rows))
        return None, set()
    bad_shards = set()
    for s in range(math.ceil(exp.rows / m.shard_rows)):
        key = shard_key(s, len(shape))
        try:
            _, idx = pf.shard_index(name, s, meta)
        except CacheCorruptError as e:
            if e.code == "cache.chunk-checksum":  # the index's own checksum
                bad(Finding("cache.verify-shard-index", shard_file=f"{name}/{key}"))
            else:
                bad(_unreadable(e, shard_file=f"{name}/{key}"))
            bad_shards.add(s)
            continue
        rows_here = min(m.shard_rows, exp.rows - s * m.shard_rows)
        missing = [i for i in range(math.ceil(rows_here / m.chunk_rows)) if idx[i, 0] == EMPTY]
        if missing:
            first = s * m.shard_rows // m.chunk_rows
            bad(Finding("cache.verify-chunks-not-indexed", shard_file=f"{name}/{key}",
                        chunks=[first + i for i in missing]))
            bad_shards.add(s)
    return meta, bad_shards


def _check_chunks(
    pf: PartFiles, m: Manifest, name: str, exp: _Expected, meta: Any, bad_shards: set[int],
    report: VerifyReport, bar: tqdm,
) -> None:
    """Decode every chunk of a chunked array (checks each crc32c), collecting failures."""
    cr = m.chunk_rows
    scratch = np.empty((cr, *exp.width), dtype=exp.dtype)
    for c in range(math.ceil(exp.rows / cr)):
        lo, hi = c * cr, min(exp.rows, (c + 1) * cr)
        shard = lo // m.shard_rows
        bar.update(1)
        if shard in bad_shards:
            continue
        where = dict(chunk=c, rows=[lo, hi - 1], shard_file=f"{name}/{shard_key(shard, len(meta.shape))}")
        try:
            pf.read_rows(name, lo, hi, scratch[: hi - lo])
        except CacheCorruptError as e:
            report.problems.append(Problem(pf.record.name, name, _unreadable(e, **where)))
            continue
        report.chunks += 1
        if name in HIDDEN_ARRAYS:  # (the codec knows which stored values decode to NaN or infinity)
            if nonfinite := m.codec.count_nonfinite(scratch[: hi - lo]):
                report.problems.append(Problem(pf.record.name, name, Finding("cache.verify-values-not-finite",
                                                                             values=nonfinite, **where)))


def _check_contents(pf: PartFiles, m: Manifest, arrays: dict[str, _Expected], ok: set[str], report: VerifyReport) -> None:
    """Offsets vs the manifest's lengths, unique sample ids, token ids < vocab, masks, scales."""
    rec = pf.record
    small: dict[str, np.ndarray] = {}
    for name in (n for n, e in arrays.items() if not e.chunked and n in ok):
        try:
            small[name] = pf.small_array(name)
        except CacheCorruptError as e:
            report.problems.append(Problem(rec.name, name, _unreadable(e, file=f"{name}/{shard_key(0, 1)}")))

    def bad(array: str, finding: Finding) -> None:
        report.problems.append(Problem(rec.name, array, finding))

    if OFFSETS in small and not np.array_equal(small[OFFSETS], sample_offsets(rec.lengths)):
        bad(OFFSETS, Finding("cache.verify-offsets", log=LOG_FILE))
    if SAMPLE_IDS in small:
        ids, counts = np.unique(small[SAMPLE_IDS], return_counts=True)
        if np.any(counts > 1):
            bad(SAMPLE_IDS, Finding("cache.verify-sample-ids-repeated", ids=ids[counts > 1][:10].tolist()))
    vocab = m.header["target"].get("vocab_size")
    for name in (INPUT_IDS,):
        if name in small and vocab is not None:
            x = small[name]
            wrong = np.flatnonzero((x < 0) | (x >= int(vocab)))
            if wrong.size:
                bad(name, Finding("cache.verify-token-ids", count=int(wrong.size), vocab_size=int(vocab),
                                  row=int(wrong[0]), token=int(x[wrong[0]])))
    if LOSS_MASK in small and np.any(small[LOSS_MASK] > 1):
        bad(LOSS_MASK, Finding("cache.verify-loss-mask"))
    if rec.split_keys is not None and INPUT_IDS in small and LOSS_MASK in small:
        off = sample_offsets(rec.lengths)
        keys = [prompt_split_key(small[INPUT_IDS][a:b], small[LOSS_MASK][a:b]) for a, b in zip(off[:-1], off[1:])]
        grouped = set(rec.grouped or ())  # keyed by their record's group, which the part does not hold
        wrong = [j for j, (k, want) in enumerate(zip(keys, rec.split_keys)) if k != want and j not in grouped]
        if wrong:
            bad(SPLIT_KEYS, Finding("cache.verify-split-keys", samples=len(wrong), first=wrong[0]))
    for name in map(scale_of, HIDDEN_ARRAYS):
        if name in small and not np.all(np.isfinite(small[name]) & (small[name] >= 0)):
            bad(name, Finding("cache.verify-scales"))


def verify_cache(cache_dir: str | os.PathLike, *, fast: bool = False, progress: bool | None = None) -> VerifyReport:
    """Check every committed part; collect all problems instead of stopping at the first.

    fast=True checks structure only: part directories and files present, array metadata
    against the manifest, shard indexes (their crc32c and offsets), sizes on disk. The full
    check also decodes every chunk of every array (each chunk's crc32c) and checks contents.
    """
    cache_dir = Path(cache_dir)
    header = read_header(cache_dir)
    report = VerifyReport(cache_dir=cache_dir, fast=fast)
    records = _read_log_tolerant(cache_dir, report)
    m = Manifest(cache_dir=cache_dir, header=header, parts=records)
    reader = CacheReader(cache_dir, manifest=m, verify_checksums=True, max_open_parts=1, check_metadata=False)
    total_chunks = 0 if fast else sum(
        math.ceil(e.rows / m.chunk_rows) for rec in records for e in expected_arrays(m, rec).values() if e.chunked
    )
    evicted = EvictionLog(cache_dir).refresh()  # parts evicted under a disk budget are not damage
    with progress_bar(len(records) if fast else total_chunks, "verify", "part" if fast else "chunk", progress) as bar:
        for i, rec in enumerate(records):
            report.parts += 1
            pf = reader.part_arrays(i)
            if evicted.is_evicted(rec.name) and not pf.dir.is_dir():
                report.evicted.append(rec.name)
                continue
            if not pf.dir.is_dir():
                report.problems.append(Problem(rec.name, None, Finding("cache.verify-part-missing", dir=str(pf.dir))))
                continue
            if rec.samples != len(rec.lengths) or rec.tokens != sum(rec.lengths):
                report.problems.append(Problem(rec.name, None, Finding("cache.verify-record-counts")))
            size = sum(f.stat().st_size for f in pf.dir.rglob("*") if f.is_file())
            if size != rec.nbytes:
                report.problems.append(Problem(rec.name, None, Finding("cache.verify-part-size", size=size,
                                                                       nbytes=rec.nbytes)))
            arrays = expected_arrays(m, rec)
            ok: set[str] = set()
            for name, exp in arrays.items():
                meta, bad_shards = _check_structure(pf, m, name, exp, report)
                if meta is None:
                    if exp.chunked and not fast:
                        bar.update(math.ceil(exp.rows / m.chunk_rows))
                    continue
                ok.add(name)
                if exp.chunked and not fast:
                    _check_chunks(pf, m, name, exp, meta, bad_shards, report, bar)
            if not fast:
                _check_contents(pf, m, arrays, ok, report)
            else:
                bar.update(1)
            pf.close()
    if (left := unfinished_extraction(cache_dir, header, {r.name for r in records})) is not None:
        report.planned = left.planned
        report.notes.append(Finding("cache.verify-unfinished", **left.fields()))
    if gone := report.evicted:
        states = evicted.evicted()
        report.notes.append(Finding("cache.verify-parts-evicted", parts=gone, file=EVICTION_FILE,
                                    nbytes=sum(states[n].nbytes for n in gone if n in states)))
    if (cache_dir / PARTS_DIR).is_dir():
        names = {r.name for r in records}
        extra = [p.name for p in (cache_dir / PARTS_DIR).iterdir() if p.name not in names]
        if extra:
            report.notes.append(Finding("cache.verify-uncommitted", entries=len(extra), dir=PARTS_DIR))
    return report


# -- stats --------------------------------------------------------------------------------
def _length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """Counts of sample lengths in power-of-two bins [lo, hi]."""
    if not lengths.size:
        return []
    out = []
    top = int(math.ceil(math.log2(int(lengths.max()) + 1)))
    for b in range(top + 1):
        lo, hi = (1 << b), (1 << (b + 1)) - 1
        n = int(np.count_nonzero((lengths >= lo) & (lengths <= hi)))
        if n or out:
            out.append((lo, hi, n))
    while out and out[-1][2] == 0:
        out.pop()
    return out


def cache_stats(
    cache_dir: str | os.PathLike, *, num_tokens: int = 4096, seed: int = 0, outlier_sigma: float = 6.0,
    top_channels: int = 3, progress: bool | None = None,
) -> dict[str, Any]:
    """Per-layer value statistics over `num_tokens` random tokens, and sample lengths.

    An outlier is a value whose magnitude exceeds `outlier_sigma` times the RMS of its own
    (token, layer) row: the values that stretch a per-row fp8 scale.
    """
    reader = CacheReader(cache_dir)
    refuse_evicted(cache_dir, "stats")
    m = reader.manifest
    k, d, cr = m.num_layers, m.hidden_size, m.chunk_rows
    total = reader.num_tokens
    n = min(num_tokens, total)
    rng = np.random.default_rng(seed)
    picks = np.sort(rng.choice(total, size=n, replace=False)) if n else np.zeros(0, np.int64)
    part_start = np.concatenate([[0], np.cumsum([p.tokens for p in m.parts])])
    part_of = np.searchsorted(part_start, picks, side="right") - 1
    local = picks - part_start[part_of]
    sums = np.zeros(k)
    sumsq = np.zeros(k)
    absmax = np.zeros(k)
    outliers = np.zeros(k)
    chan_sq = np.zeros((k, d))
    mask_on = 0
    groups: dict[tuple[int, int], list[int]] = {}
    for p, t in zip(part_of.tolist(), local.tolist()):
        groups.setdefault((p, t // cr), []).append(t)
    with progress_bar(n, "stats", "tok", progress) as bar:
        for (p, c), rows in groups.items():
            lo, hi = c * cr, min((c + 1) * cr, m.parts[p].tokens)
            got = reader.read_tokens(p, lo, hi)
            sel = np.asarray(rows) - lo
            x = bf16_values(got[HIDDEN][sel]).reshape(len(rows), k, d).astype(np.float64)
            mask_on += int(got[LOSS_MASK][sel].sum())
            sums += x.sum(axis=(0, 2))
            sumsq += (x * x).sum(axis=(0, 2))
            absmax = np.maximum(absmax, np.abs(x).max(axis=(0, 2)))
            rms = np.sqrt((x * x).mean(axis=2, keepdims=True))
            outliers += (np.abs(x) > outlier_sigma * rms).sum(axis=(0, 2))
            chan_sq += (x * x).sum(axis=0)
            bar.update(len(rows))
    layers = []
    count = max(n * d, 1)
    for i, layer_id in enumerate(m.target_layer_ids):
        mean = sums[i] / count
        chan_rms = np.sqrt(chan_sq[i] / max(n, 1))
        median = float(np.median(chan_rms)) or 1.0
        top = np.argsort(chan_rms)[::-1][:top_channels]
        layers.append({
            "layer_id": layer_id,
            "mean": float(mean),
            "std": float(math.sqrt(max(sumsq[i] / count - mean * mean, 0.0))),
            "absmax": float(absmax[i]),
            "outlier_fraction": float(outliers[i] / count),
            "top_channels": [{"channel": int(ch), "rms_over_median": float(chan_rms[ch] / median)} for ch in top],
        })
    return {
        "cache_dir": str(m.cache_dir),
        "sampled_tokens": int(n),
        "seed": seed,
        "outlier_sigma": outlier_sigma,
        "loss_mask_fraction": mask_on / n if n else 0.0,
        "layers": layers,
        "length_histogram": [{"min": lo, "max": hi, "samples": c} for lo, hi, c in _length_histogram(reader.lengths)],
    }


# -- prune --------------------------------------------------------------------------------
def _tree_size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def prune_cache(cache_dir: str | os.PathLike, *, dry_run: bool = False) -> list[tuple[str, int]]:
    """Remove temporary parts of dead writers and part directories that no commit names.

    Runs under the cache lock; temporary parts whose writer is alive are kept. Returns
    (entry name under parts/, bytes) for what was (or, with dry_run, would be) removed.
    """
    cache_dir = Path(cache_dir)
    read_header(cache_dir)  # a clear error for a missing or non-cache directory
    with file_lock(cache_dir / LOCK_FILE):
        sizes: dict[str, int] = {}
        for path in find_orphans(cache_dir):
            sizes[orphan_name(path)] = sizes.get(orphan_name(path), 0) + _tree_size(path)
        removed = list(sizes) if dry_run else remove_orphans(cache_dir)
    return [(n, sizes.get(n, 0)) for n in removed]
