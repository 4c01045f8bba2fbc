"""Input of the extraction: tokenized completions as JSONL, validated and grouped into parts.

A record is one JSON object per line, read and validated by runtime/records.py (input_ids and
one of loss_mask, labels, prompt_len; an optional "id").

Every non-blank line is a record and gets the next sample id (0, 1, 2, ... over the files in
sorted order), whether it is kept or skipped, so a cached sample id always names one line.
Parts are cut from the data alone, so that the same data gives the same parts whatever the
number of ranks: consecutive records form sort windows of up to `window_tokens` tokens; the
samples of a window are sorted by length (longest first) and cut, in that order, into parts
of up to `part_tokens` tokens. Forward batches of similar lengths then waste little padding,
and a batch spans at most the end of one part and the start of the next.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from dflash.cache_tools.errors import ConfigMismatchError
from dflash.cache_tools.manifest import HEADER_FILE, PARTS_DIR
from dflash.cache_tools.sample_scores import group_split_key, prompt_split_key
from dflash.runtime.errors import InputError
from dflash.runtime.findings import Finding
from dflash.runtime.records import (
    SIDECAR_SUFFIXES,
    BadRecord,
    PrefixReader,
    iter_lines,
    json_document,
    parse_sample,
    read_rendering,
)

DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".json")
# Suffixes that say JSON Lines; a .json (.json.gz) file is one record a line (as Hugging Face's
# Dataset.to_json writes) or one JSON document (config.json, dataset_info.json, stats.json).
JSON_LINES_SUFFIXES = (".jsonl", ".jsonl.gz")
MAX_SKIPS_LISTED = 50  # per part, in the manifest's part stats


def list_data_files(data: str | Path, *, exclude: tuple[str | Path, ...] = (),
                    skipped: list[Path] | None = None, repeated: list[Path] | None = None,
                    documents: list[tuple[Path, str]] | None = None) -> list[Path]:
    """The input files: `data` itself, or the JSONL files of a directory in sorted order.

    A directory's scan skips dflash caches (a cache kept inside its data directory: its
    manifest and part metadata are .json files, not data) and the directories in `exclude`
    (this run's --output); `skipped` receives the other files it leaves out (not one of
    DATA_SUFFIXES: `.bz2`, `.JSONL`, ...), but for hidden files and sidecars, and `documents`
    the .json (.json.gz) files that are not JSON Lines of records, each with what it holds
    (`records.json_document`). Symbolic links are followed, but every directory and file is
    read once: a second path to one already reached (`latest -> v2` beside `v2`, a link to a
    parent) goes to `repeated`, not into the data twice. A file given as `data` that is not JSON
    Lines, or a *.jsonl file of the scan that is one JSON document, is an InputError."""
    path = Path(data)
    if path.is_file():
        if what := json_document(path, records_only=not path.name.endswith(JSON_LINES_SUFFIXES)):
            raise InputError(Finding("extract.data-not-json-lines", file=str(path), what=what, in_scan=False))
        return [path]
    if not path.exists():
        raise InputError(Finding("extract.data-missing", file=str(path)))
    excluded = {Path(p).resolve() for p in exclude}
    found: list[Path] = []
    walked: set[Path] = set()
    for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
        here = Path(dirpath)
        if here.resolve() in walked:  # reached again through a link: its files are read once
            dirnames[:] = []
            if repeated is not None:
                repeated.append(here)
            continue
        walked.add(here.resolve())
        dirnames[:] = sorted(d for d in dirnames if (here / d).resolve() not in excluded
                             and not _is_cache_dir(here / d))
        found += [here / n for n in filenames if n.endswith(DATA_SUFFIXES) and not n.endswith(SIDECAR_SUFFIXES)]
        if skipped is not None:
            skipped += [here / n for n in filenames if not n.endswith(DATA_SUFFIXES) and not n.startswith(".")
                        and not n.endswith(SIDECAR_SUFFIXES)]
    files, real, left_out = [], set(), []
    for file in sorted(found):  # the first path of each file in sorted order reads it
        if file.resolve() in real:
            if repeated is not None:
                repeated.append(file)
            continue
        real.add(file.resolve())
        named_lines = file.name.endswith(JSON_LINES_SUFFIXES)
        if what := json_document(file, records_only=not named_lines):
            if named_lines:  # named as JSON Lines: data that cannot be read, not a file to pass over
                raise InputError(Finding("extract.data-not-json-lines", file=str(file), what=what, in_scan=True))
            left_out.append((file, what))
            continue
        files.append(file)
    if documents is not None:
        documents += left_out
    if not files:
        raise InputError(Finding("extract.data-no-files", dir=str(path), documents=_documents(path, left_out)))
    return files


def _documents(data: str | Path, documents: list[tuple[Path, str]]) -> list[list[str]]:
    """[name relative to `data`, what it holds] of the .json files a scan left out, sorted."""
    return [[str(p.relative_to(data)), what] for p, what in sorted(documents)]


def json_documents_note(data: str | Path, documents: list[tuple[Path, str]]) -> Finding | None:
    """The finding naming the .json files a directory scan left out as not JSON Lines, or None."""
    if not documents:
        return None
    return Finding("extract.data-json-documents-left-out", dir=str(data), documents=_documents(data, documents))


def skipped_files_note(data: str | Path, skipped: list[Path]) -> Finding | None:
    """The finding naming the files a directory scan left out, or None."""
    if not skipped:
        return None
    return Finding("extract.data-files-skipped", dir=str(data), files=[str(p.relative_to(data)) for p in sorted(skipped)],
                   suffixes=list(DATA_SUFFIXES))


def repeated_files_note(data: str | Path, repeated: list[Path]) -> Finding | None:
    """The finding naming the paths a directory scan reached a second time through symbolic
    links (and read once), or None."""
    if not repeated:
        return None
    return Finding("extract.data-paths-repeated", dir=str(data), paths=[str(p.relative_to(data)) for p in sorted(repeated)])


def _is_cache_dir(path: Path) -> bool:
    """A dflash cache (its manifest beside its parts/ directory), as cache_tools lays it out."""
    return (path / HEADER_FILE).is_file() and (path / PARTS_DIR).is_dir()


@dataclass
class DataSnapshot:
    """The input files as this run reads them: each file's size and mtime when the run started
    and the sha256 of those first bytes (the manifest's `data.files` entries). The run reads
    only those bytes and hashes them again as it reads (`lines`), so the cache holds what its
    manifest fingerprints: lines appended meanwhile are left out, an edit in place is named."""

    files: list[Path]
    entries: list[dict[str, Any]]  # per file: path (relative to --data), bytes, sha256[, rendering]
    records: int  # non-blank lines within those bytes (the progress bar's total)
    stats: dict[Path, tuple[int, int]]  # (size, mtime_ns) when the run started
    notes: list[Finding] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.entries, sort_keys=True).encode()).hexdigest()

    def __iter__(self) -> Iterator[Path]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index):
        return self.files[index]

    def lines(self) -> Iterator[tuple[str, bytes]]:
        prefixes = {f: (e["bytes"], e["sha256"]) for f, e in zip(self.files, self.entries, strict=True)}
        return iter_lines(self.files, prefixes=prefixes)

    def changes_since_start(self) -> list[Finding]:
        """A finding per file whose size or mtime is no longer the one at the start."""
        out = []
        for f, entry in zip(self.files, self.entries, strict=True):
            try:
                st = f.stat()
                now = (st.st_size, st.st_mtime_ns)
            except OSError:
                now = None
            if now != self.stats[f]:
                out.append(Finding("extract.data-changed-during-run", file=str(f), bytes_now=None if now is None else now[0],
                                   bytes_at_start=self.stats[f][0], bytes_read=entry["bytes"]))
        return out


def snapshot_data(files: list[Path], root: str | Path, *, recorded: dict[str, Any] | None = None,
                  left_out: Sequence[tuple[Path, str]] = ()) -> DataSnapshot:
    """Fingerprint the input files as they are now (see DataSnapshot).

    `recorded`: the `data` section of the cache this run resumes. A file that has grown since
    (its recorded bytes still its first ones) is read up to its recorded size, with a note;
    a file edited, shortened, added or removed since is a ConfigMismatchError naming it (a
    recorded file the scan left out as not JSON Lines, `left_out` of list_data_files, with why)."""
    root = Path(root)
    entries, records, stats = [], 0, {}
    old = {e.get("path"): e for e in (recorded or {}).get("files", []) if isinstance(e, dict)}
    notes, changed = [], []
    for f in files:
        name = f.name if f == root else str(f.relative_to(root))
        try:
            st = f.stat()
            stats[f] = (st.st_size, st.st_mtime_ns)
            prefix = old.get(name, {}).get("bytes") if old else None
            nbytes = prefix if isinstance(prefix, int) and prefix < st.st_size else st.st_size
            reader = PrefixReader(f, nbytes)
            with reader:
                records += sum(1 for line in reader.lines() if line.strip())
                digest = reader.hexdigest()
        except (OSError, EOFError) as e:
            raise InputError(Finding("extract.data-unreadable", file=str(f), error=str(e))) from e
        entry = {"path": name, "bytes": nbytes, "sha256": digest}
        rendering = read_rendering(f)
        if rendering:
            entry["rendering"] = rendering
        entries.append(entry)
        if old:
            was = old.get(name)
            if was is None:
                changed.append({"file": str(f), "change": "added"})
            elif (was.get("bytes"), was.get("sha256")) != (nbytes, digest):
                changed.append({"file": str(f), "change": "edited", "bytes": nbytes})
            elif nbytes < st.st_size:
                notes.append(Finding("extract.data-grown", file=str(f), grown=st.st_size - nbytes, bytes_read=nbytes))
    if old:
        names = {e["path"] for e in entries}
        base = root if root.is_dir() else root.parent
        why = {str(p.relative_to(base)): what for p, what in left_out}
        changed += [{"file": str(base / n), "change": "left-out", "what": why[n]} if n in why else
                    {"file": str(base / n), "change": "gone"} for n in old if n not in names]
    if changed:
        raise ConfigMismatchError(Finding("extract.data-differs", changes=changed))
    return DataSnapshot(list(files), entries, records, stats, notes)


def fingerprint_data(files: list[Path], root: str | Path) -> dict[str, Any]:
    """Names (relative to `root`), sizes and sha256 of the input files, plus one overall hash and
    the count of records (non-blank lines): the manifest's `data` section (see snapshot_data)."""
    snap = snapshot_data(files, root)
    return {"files": snap.entries, "sha256": snap.sha256, "records": snap.records}


@dataclass
class Sample:
    sample_id: int
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # uint8 [T]
    group: str | int | None = None  # the record's "group", if it names one

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def split_key(self) -> int:
        """The hash of its record's group (sample_scores.group_split_key) when it names one, else of
        its prompt as the cache stores it (prompt_split_key): the samples of one group, and the
        answers of one prompt, share it, so the held-out split and the top-1 selection keep them together."""
        if self.group is not None:
            return group_split_key(self.group)
        return prompt_split_key(self.input_ids, self.loss_mask)


@dataclass
class PartPlan:
    """The samples of one part, plus what was skipped or truncated on the way."""

    index: int
    window: int = 0  # the sort window the part was cut from
    samples: list[Sample] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=lambda: {
        "records": 0, "skipped_bad": 0, "skipped_long": 0, "truncated": 0, "skips": [],
    })

    @property
    def name(self) -> str:
        return f"part-{self.index:06d}"

    num_tokens: int = 0

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        self.num_tokens += sample.length

    def record_skip(self, sample_id: int, where: str, reason: str, key: str) -> None:
        self.stats[key] += 1
        if len(self.stats["skips"]) < MAX_SKIPS_LISTED:
            self.stats["skips"].append({"sample_id": sample_id, "where": where, "reason": reason})


@dataclass(frozen=True, kw_only=True)
class PartRules:
    """How records become parts; every field changes the content of the cache."""

    vocab_size: int
    max_seq_len: int
    long_samples: str  # truncate | skip
    skip_bad: bool
    part_tokens: int
    window_tokens: int = 0  # sort window; at most part_tokens: each window is one part
    length_limit: str = ""  # what max_seq_len stands for in a skip's reason, when not the flag


class BadRecordError(InputError):
    """A record that cannot be read (and no --skip-bad): names its file and line."""


def plan_windows(files: list[Path] | DataSnapshot, rules: PartRules) -> Iterator[list[PartPlan]]:
    """Stream the input as sort windows, each the list of its parts (see the module docstring).

    A window closes before the sample that would take it past `window_tokens` (at least
    `part_tokens`); its samples, sorted longest first (ties in record order), are cut into
    parts, each closing before the sample that would take it past `part_tokens` (a single
    longer sample forms a part of its own). Skipped records are counted in the first part of
    their window; trailing skips after the last sample go to the last window's first part.
    """
    window_tokens = max(rules.window_tokens, rules.part_tokens)
    window, tokens, first_index, number = [], 0, 0, 0
    skips = PartPlan(-1)  # the current window's skipped records
    lines = files.lines() if isinstance(files, DataSnapshot) else iter_lines(files)
    for sample_id, (where, line) in enumerate(lines):
        try:
            ids, mask, group = parse_sample(line, rules.vocab_size)
        except BadRecord as e:
            if not rules.skip_bad:
                raise BadRecordError(Finding("extract.bad-record", where=where,
                                             problem=e.finding if e.finding is not None else str(e))) from None
            skips.stats["records"] += 1
            skips.record_skip(sample_id, where, str(e), "skipped_bad")
            continue
        if ids.size > rules.max_seq_len:
            if rules.long_samples == "skip":
                skips.stats["records"] += 1
                skips.record_skip(
                    sample_id, where, f"{ids.size} tokens > {rules.length_limit or f'max_seq_len {rules.max_seq_len}'}",
                    "skipped_long",
                )
                continue
            ids, mask = ids[: rules.max_seq_len], mask[: rules.max_seq_len]
            skips.stats["truncated"] += 1
        if window and tokens + ids.size > window_tokens:
            parts = _cut_window(window, skips, first_index, number, rules.part_tokens)
            yield parts
            first_index += len(parts)
            number += 1
            window, tokens, skips = [], 0, PartPlan(-1)
        window.append(Sample(sample_id, ids, mask, group))
        tokens += ids.size
    if not window:  # (a window always holds the sample that opened it: only an input without any ends empty)
        raise InputError(Finding("extract.no-usable-sample", files=[str(f) for f in files[:3]], count=len(files),
                                 skipped=skips.stats["records"]))
    yield _cut_window(window, skips, first_index, number, rules.part_tokens)


def _cut_window(window: list[Sample], skips: PartPlan, first_index: int, number: int,
                part_tokens: int) -> list[PartPlan]:
    """A window's samples, longest first (stable), cut into consecutive parts."""
    parts = [PartPlan(first_index, window=number)]
    for sample in sorted(window, key=lambda s: -s.length):
        current = parts[-1]
        if current.samples and current.num_tokens + sample.length > part_tokens:
            current = PartPlan(current.index + 1, window=number)
            parts.append(current)
        current.stats["records"] += 1
        current.add(sample)
    _merge_skips(parts[0], skips)
    return parts


def _merge_skips(into: PartPlan, tail: PartPlan) -> None:
    for key in ("records", "skipped_bad", "skipped_long", "truncated"):
        into.stats[key] += tail.stats[key]
    into.stats["skips"] = (into.stats["skips"] + tail.stats["skips"])[:MAX_SKIPS_LISTED]
