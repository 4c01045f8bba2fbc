"""The manifest: what a cache is (header) and which parts are committed (commit log).

A cache directory holds
  manifest.json        the header, written once at creation (atomically): format version,
                       target identity, layer ids, codec, data fingerprint, settings.
  manifest.parts.jsonl the commit log: one checksummed line per committed part (name,
                       sample and token counts, sample lengths, bytes). Appended under the
                       cache lock, so commits cost O(1) however many parts exist, and any
                       number of writers (ranks, machines) can commit without losing an update.
  parts/<name>/        one zarr v3 group per committed part.
Together the two manifest files tell a reader everything: it never lists the directory.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.runtime.findings import Finding

from .checksum import crc32c
from .codecs import HiddenCodec, codec_identity
from .errors import CacheCorruptError, CacheError, CacheNotFoundError, ConfigMismatchError
from .identity import Purpose, comparable, target_differences

FORMAT_VERSION = 1
HEADER_FILE = "manifest.json"
LOG_FILE = "manifest.parts.jsonl"
LOCK_FILE = ".lock"
WRITER_LOCK_FILE = ".writers.lock"  # held by every process writing the cache (runtime.locks)
PARTS_DIR = "parts"

# Header keys whose values decide the content of the cache: a writer resuming a cache, or a
# trainer reading several caches together, must agree on them. `target` holds the target's
# identity (cache_tools.identity); `provenance` (where the target was read from) and
# `producer` are records, never compared.
IDENTITY_KEYS = ("format_version", "target", "target_layer_ids", "hidden", "extras", "data", "settings")


@dataclass(frozen=True)
class PartRecord:
    """One committed part as the commit log records it."""

    name: str
    samples: int
    tokens: int
    lengths: tuple[int, ...]
    nbytes: int
    stats: dict[str, Any] = field(default_factory=dict)
    sample_ids: tuple[int, ...] | None = None
    """The part's sample ids in stored order (None: a record written before they were recorded;
    the part's sample_ids array holds them). A trainer orders its samples by id at startup: from
    the commit log that opens no part."""
    split_keys: tuple[int, ...] | None = None
    """The split key of each sample in stored order (sample_scores.prompt_split_key: a hash of
    its prompt), which the held-out split and the top-1 selection score; None in a record
    written before keys were stored, whose samples use their sample id as the key."""
    grouped: tuple[int, ...] | None = None
    """The positions (in stored order) of the samples whose split key hashes their record's
    "group" (sample_scores.group_split_key) rather than their prompt: `dflash-cache verify` cannot
    recompute those from the part. None: every key is its prompt's."""

    def to_json(self) -> dict[str, Any]:
        out = {
            "part": self.name, "samples": self.samples, "tokens": self.tokens,
            "lengths": list(self.lengths), "bytes": self.nbytes, "stats": self.stats,
        }
        if self.sample_ids is not None:
            out["sample_ids"] = list(self.sample_ids)
        if self.split_keys is not None:
            out["split_keys"] = list(self.split_keys)
        if self.grouped:
            out["grouped"] = list(self.grouped)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PartRecord:
        ids, keys = d.get("sample_ids"), d.get("split_keys")
        return cls(
            name=d["part"], samples=int(d["samples"]), tokens=int(d["tokens"]),
            lengths=tuple(int(x) for x in d["lengths"]), nbytes=int(d["bytes"]),
            stats=dict(d.get("stats", {})), sample_ids=None if ids is None else tuple(int(x) for x in ids),
            split_keys=None if keys is None else tuple(int(x) for x in keys),
            grouped=tuple(int(x) for x in d["grouped"]) if d.get("grouped") else None,
        )


def encode_log_line(record: PartRecord) -> bytes:
    body = json.dumps(record.to_json(), sort_keys=True, separators=(",", ":"))
    return f"{body} {crc32c(body.encode()):08x}\n".encode()


def decode_log_line(line: bytes, where: str) -> PartRecord:
    try:
        body, crc = line.rstrip(b"\n").rsplit(b" ", 1)
        ok = int(crc, 16) == crc32c(body)
    except ValueError:
        ok = False
    if not ok:
        raise CacheCorruptError(Finding("cache.commit-record-checksum", where=where))
    record = PartRecord.from_json(json.loads(body))
    keys = record.split_keys
    if keys is not None and (len(keys) != record.samples or any(not -(1 << 63) <= k < 1 << 63 for k in keys)
                             or any(not 0 <= j < record.samples for j in record.grouped or ())):
        raise CacheCorruptError(Finding("cache.commit-record-split-keys", where=where, part=record.name,
                                        keys=len(keys), samples=record.samples))
    return record


class CommitLog:
    """Incremental reader of manifest.parts.jsonl (reads only what was appended since)."""

    def __init__(self, cache_dir: Path):
        self.path = cache_dir / LOG_FILE
        self.records: dict[str, PartRecord] = {}
        self.order: list[str] = []
        self._offset = 0
        self._line_no = 0
        self._inode: int | None = None  # the log's file, which only grows while a cache is written

    def refresh(self) -> None:
        try:
            with open(self.path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if self._inode is not None and inode != self._inode:
                    raise CacheError(Finding("cache.log-replaced", file=str(self.path)))
                self._inode = inode
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a torn last line (writer killed mid-append) is not committed
        for line in data[:end].splitlines(keepends=True):
            self._line_no += 1
            rec = decode_log_line(line, f"{self.path}, line {self._line_no}")
            if rec.name not in self.records:
                self.order.append(rec.name)
            self.records[rec.name] = rec
        self._offset += end

    def parts(self) -> list[PartRecord]:
        return [self.records[n] for n in self.order]


def append_log_line(cache_dir: Path, record: PartRecord) -> None:
    """Append one commit record durably. Caller holds the cache lock."""
    path = cache_dir / LOG_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = keep = os.fstat(fd).st_size
        if size:
            # Drop a torn tail left by a writer killed mid-append, so the new line starts clean.
            tail = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
            keep = size - len(tail) + tail.rfind(b"\n") + 1
            if keep != size:
                os.ftruncate(fd, keep)
        line = encode_log_line(record)
        written = os.write(fd, line)
        if written != len(line):  # a full disk can write part of the line and return a short count
            os.ftruncate(fd, keep)
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a short write of the commit record of "
                          f"{record.name}: {written} of {len(line)} bytes)", str(path))
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Manifest:
    """A cache's header plus its committed parts, as read at one moment (a snapshot)."""

    cache_dir: Path
    header: dict[str, Any]
    parts: list[PartRecord]

    @property
    def codec(self) -> HiddenCodec:
        return HiddenCodec.from_dict(self.header["hidden"]["codec"])

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.header["target_layer_ids"])

    @property
    def num_layers(self) -> int:
        return len(self.header["target_layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.header["hidden"]["hidden_size"])

    @property
    def chunk_rows(self) -> int:
        return int(self.header["hidden"]["chunk_rows"])

    @property
    def shard_rows(self) -> int:
        return int(self.header["hidden"]["shard_rows"])

    @property
    def store_last_hidden(self) -> bool:
        return bool(self.header["extras"].get("last_hidden", False))

    @property
    def topk(self) -> int:
        return int(self.header["extras"].get("topk", 0))

    @property
    def top1(self) -> str | None:
        """The storage dtype of top1_ids (the target's greedy next token), None when not stored."""
        return self.header["extras"].get("top1") or None

    @property
    def top1_share(self) -> float:
        """The share of samples whose top1_ids hold the target's top-1 (header_top1_share)."""
        return header_top1_share(self.header)

    @property
    def num_samples(self) -> int:
        return sum(p.samples for p in self.parts)

    @property
    def num_tokens(self) -> int:
        return sum(p.tokens for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def identity(self) -> dict[str, Any]:
        return header_identity(self.header)


def chat_templates(header: dict[str, Any]) -> list[dict[str, Any]]:
    """The distinct renderings (chat template sha256, kwargs, ...) the cache's input files were
    made with, as dflash-prepare / dflash-generate recorded them (data.files[].rendering)."""
    out: list[dict[str, Any]] = []
    for entry in (header.get("data") or {}).get("files", []):
        rendering = entry.get("rendering") if isinstance(entry, dict) else None
        if rendering and rendering not in out:
            out.append(rendering)
    return out


def header_top1_share(header: dict[str, Any]) -> float:
    """The share of samples for which the cache stores the target's top-1: those whose score
    (sample_scores.top1_selected) is below it. 0 without top1_ids, 1 where the header records no
    share (every sample, as caches had before `extras.top1_share` existed)."""
    extras = header.get("extras") or {}
    if not extras.get("top1"):
        return 0.0
    return float(extras.get("top1_share", 1.0))


def header_identity(header: dict[str, Any]) -> dict[str, Any]:
    """What makes two caches' contents the same: the identity keys of a header, less the
    codec fields that only change how chunks are packed (they decode the same), and less the
    target's provenance (an older header's `target.path`)."""
    ident = {k: header.get(k) for k in IDENTITY_KEYS}
    ident["target"] = comparable(ident.get("target"))
    hidden = ident.get("hidden")
    if isinstance(hidden, dict) and isinstance(hidden.get("codec"), dict):
        ident["hidden"] = {**hidden, "codec": codec_identity(hidden["codec"])}
    return ident


def make_header(
    *,
    target: dict[str, Any],
    target_layer_ids: list[int],
    hidden_size: int,
    codec: HiddenCodec,
    chunk_rows: int = 128,
    shard_rows: int = 8192,
    store_last_hidden: bool = False,
    topk: int = 0,
    top1: str | None = None,
    top1_share: float = 1.0,
    data: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    producer: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a format-1 header; raises CacheError on inconsistent values."""
    if not target_layer_ids:
        raise CacheError(Finding("cache.header-no-layers"))
    if chunk_rows <= 0 or shard_rows <= 0 or shard_rows % chunk_rows:
        raise CacheError(Finding("cache.header-shard-rows", shard_rows=shard_rows, chunk_rows=chunk_rows))
    return {
        "format_version": FORMAT_VERSION,
        "target": dict(target),
        "target_layer_ids": [int(x) for x in target_layer_ids],
        "hidden": {
            "codec": codec.to_dict(),
            "dtype": "bfloat16",
            "storage_dtype": codec.storage_dtype.name,
            "layout": "tokens x (layers*hidden), layer-major",
            "num_layers": len(target_layer_ids),
            "hidden_size": int(hidden_size),
            "chunk_rows": int(chunk_rows),
            "shard_rows": int(shard_rows),
        },
        # top1 only when stored, its share only below 1: a header without them is the same as
        # before they existed (the share decides the bytes of top1_ids, so it is cache identity)
        "extras": {"last_hidden": bool(store_last_hidden), "topk": int(topk), **({"top1": top1} if top1 else {}),
                   **({"top1_share": float(top1_share)} if top1 and top1_share < 1 else {})},
        "data": dict(data or {}),
        "settings": dict(settings or {}),
        "producer": dict(producer or {"name": "dflash-pipeline"}),
        "provenance": dict(provenance or {}),
    }


def read_header(cache_dir: Path) -> dict[str, Any]:
    path = cache_dir / HEADER_FILE
    if not cache_dir.is_dir():
        raise CacheNotFoundError(Finding("cache.dir-missing", cache=str(cache_dir)))
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CacheNotFoundError(Finding("cache.no-manifest", cache=str(cache_dir), manifest=HEADER_FILE)) from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CacheCorruptError(Finding("cache.manifest-not-json", file=str(path), error=str(e))) from e
    version = header.get("format_version") if isinstance(header, dict) else None
    if version != FORMAT_VERSION:
        raise ConfigMismatchError(Finding("cache.format-version", file=str(path), version=version,
                                          supported=FORMAT_VERSION))
    missing = [k for k in ("target", "target_layer_ids", "hidden", "extras") if k not in header]
    if missing:
        raise CacheCorruptError(Finding("cache.manifest-lacks-keys", file=str(path), missing=missing))
    problem = header_problem(header)
    if problem:
        raise CacheCorruptError(Finding("cache.manifest-invalid", file=str(path), **problem))
    return header


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def header_problem(header: dict[str, Any]) -> dict[str, Any] | None:
    """What in a header's own format is wrong (a hand edit: a wrong type, a field that
    disagrees with another), or None; the parts are checked against a sound header elsewhere.
    As the fields of cache.manifest-invalid: the key, the problem's code (messages._HEADER_PROBLEMS),
    the value found (shortened) and what was expected there."""
    from .schema import TOP1_DTYPES

    def found(key: str, problem: str, value: Any, expected: Any = None) -> dict[str, Any]:
        return {"key": key, "problem": problem, "value": _short(value), "expected": expected}

    ids, hidden, extras = header["target_layer_ids"], header["hidden"], header["extras"]
    for key in ("target", "hidden", "extras", "data", "settings", "producer", "provenance"):
        if key in header and not isinstance(header[key], dict):
            return found(key, "not-an-object", header[key])
    if not isinstance(ids, list) or not ids or not all(_is_int(x) and x >= 0 for x in ids):
        return found("target_layer_ids", "not-layer-ids", ids)
    # Repeated or unsorted ids are not a hand edit: caches of the old layer rule hold them, and the
    # layer rule (layers.validate_target_layer_ids) refuses them where they are used, saying why.
    if not isinstance(hidden.get("codec"), dict):
        return found("hidden.codec", "not-an-object", hidden.get("codec"))
    try:
        codec = HiddenCodec.from_dict(hidden["codec"])
    except (CacheError, TypeError, ValueError) as e:  # the codec's own refusal, as its finding
        return found("hidden.codec", "codec-refused", hidden["codec"], getattr(e, "finding", None) or str(e))
    for key in ("hidden_size", "chunk_rows", "shard_rows"):
        if not _is_int(hidden.get(key)) or hidden[key] <= 0:
            return found(f"hidden.{key}", "not-positive", hidden.get(key))
    if hidden["shard_rows"] % hidden["chunk_rows"]:
        return found("hidden.shard_rows", "not-a-multiple", hidden["shard_rows"], hidden["chunk_rows"])
    if "num_layers" in hidden and hidden["num_layers"] != len(ids):
        return found("hidden.num_layers", "layer-count", hidden["num_layers"], len(ids))
    if "storage_dtype" in hidden and hidden["storage_dtype"] != codec.storage_dtype.name:
        return found("hidden.storage_dtype", "storage-dtype", hidden["storage_dtype"],
                     [codec.name, codec.storage_dtype.name])
    if not isinstance(extras.get("last_hidden", False), bool):
        return found("extras.last_hidden", "not-bool", extras["last_hidden"])
    if not _is_int(extras.get("topk", 0)) or extras.get("topk", 0) < 0:
        return found("extras.topk", "not-a-count", extras["topk"])
    if extras.get("top1") and extras["top1"] not in TOP1_DTYPES:
        return found("extras.top1", "not-top1-dtype", extras["top1"], list(TOP1_DTYPES))
    if "top1_share" in extras:
        share = extras["top1_share"]
        if not isinstance(share, int | float) or isinstance(share, bool) or not 0 < share < 1:
            return found("extras.top1_share", "not-a-share", share)
        if not extras.get("top1"):
            return found("extras.top1_share", "share-without-top1", share)
    return None


def read_manifest(cache_dir: str | os.PathLike) -> Manifest:
    """Read the header and the commit log: the only files a reader opens at startup."""
    cache_dir = Path(cache_dir)
    header = read_header(cache_dir)
    log = CommitLog(cache_dir)
    log.refresh()
    return Manifest(cache_dir=cache_dir, header=header, parts=log.parts())


def value_differences(a: Any, b: Any, prefix: str = "") -> list[list[str]]:
    """[dotted key, a's value, b's value] (values shortened) wherever two identities differ
    (recursing into dicts, and into lists of dicts of one length by index)."""
    name = prefix.rstrip(".")
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b))
                for d in value_differences(a.get(k), b.get(k), f"{name}.{k}" if name else str(k))]
    if (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
            and all(isinstance(x, dict) for x in a + b)):  # (a list of numbers reads best whole)
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in value_differences(x, y, f"{name}[{i}]")]
    return [] if a == b else [[name, _short(a), _short(b)]]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def identity_differences(expected: dict[str, Any], found: dict[str, Any], purpose: Purpose,
                         *, keys: tuple[str, ...] = IDENTITY_KEYS) -> list[tuple[str, Any, Any]]:
    """(dotted key, expected value, found value) wherever two headers' identities differ for
    `purpose`, over the identity `keys`: the target by `identity.target_differences` (the
    fields both record), the rest leaf by leaf."""
    a, b = header_identity(expected), header_identity(found)
    out = []
    if "target" in keys:
        out += [(f"target.{k}", x, y) for k, x, y in target_differences(a["target"], b["target"], purpose)]
    for key in (k for k in keys if k != "target"):
        out += _leaf_differences(a.get(key), b.get(key), key)
    return out


def _leaf_differences(a: Any, b: Any, key: str) -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _leaf_differences(a.get(k), b.get(k), f"{key}.{k}")]
    return [] if a == b else [(key, a, b)]


IDENTITY_CHECK_PURPOSES = ("extraction", "import", "recompress", "merge")  # what writes a cache and checks its identity


def check_identity(manifest: Manifest, expected_header: dict[str, Any], *, purpose: str) -> None:
    """Raise ConfigMismatchError when `expected_header` would produce a different cache than the
    one `purpose` (one of IDENTITY_CHECK_PURPOSES) goes on writing."""
    if purpose not in IDENTITY_CHECK_PURPOSES:
        raise ValueError(f"purpose {purpose!r} is not one of {IDENTITY_CHECK_PURPOSES}")
    found_diffs = identity_differences(expected_header, manifest.header, Purpose.RESUME)
    if found_diffs:
        paths = None
        if any(key.startswith("target.") for key, _, _ in found_diffs):
            paths = [h.get("provenance", {}).get("target_path", "?") for h in (manifest.header, expected_header)]
        raise ConfigMismatchError(Finding(
            "cache.settings-differ", cache=str(manifest.cache_dir), purpose=purpose,
            differences=[[key, _short(found), _short(want)] for key, want, found in found_diffs[:6]],
            more=len(found_diffs) > 6, target_paths=paths))
