"""The input record and its sidecar: what dflash-prepare / dflash-generate write, dflash-extract
caches and dflash-eval takes prompts from.

A record is one JSON object per line of a JSONL file (optionally gzipped):
  {"input_ids": [...], "loss_mask": [0/1 ...]}      or
  {"input_ids": [...], "labels": [-100 | id ...]}   (loss where labels != -100)   or
  {"input_ids": [...], "prompt_len": P}             (loss on tokens P..end)
plus an optional "id" and an optional "group" (a string or an integer: records of one group, such as
the chunks or prompts cut from one document, are held out together by the trainer's split, so its
held-out estimate reads text the drafter never trained on). The first of loss_mask, labels,
prompt_len present is used.

A prepared file's sidecar `<file>.meta.json` records how its records were rendered (chat
template sha256 and kwargs, loss_on, the tokenizer), what produced them and the counts of the
run; dflash-extract copies its rendering keys into the cache manifest (docs/prepare.md).

Torch-free (numpy only): every stage reads its input here without loading a model stack.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError
from .findings import Finding, render
from .fsio import atomic_write_json

META_SUFFIX = ".meta.json"  # the sidecar: how the records were rendered
SKIPPED_SUFFIX = ".skipped.jsonl"  # dflash-generate's ids dropped for good
SIDECAR_SUFFIXES = (META_SUFFIX, SKIPPED_SUFFIX)  # written beside a data file; not data
META_VERSION = 1
# What a prepared file's sidecar says about its rendering, copied into the manifest per file.
RENDERING_KEYS = ("producer", "chat_template_sha256", "chat_template_kwargs", "chat_template_source",
                  "loss_on", "supervise_empty_reasoning", "tokenizer", "generation")


class BadRecord(Exception):
    """A record failed validation; the message is the reason, without the location.

    Built from a `Finding` (a `runtime.record-*` code), it carries it (`finding`, `code`,
    `fields`) and reads as its rendered reason; built from text, `finding` is None."""

    def __init__(self, *args: object):
        self.finding = args[0] if args and isinstance(args[0], Finding) else None
        super().__init__(*args)

    @property
    def code(self) -> str | None:
        return self.finding.code if self.finding is not None else None

    @property
    def fields(self) -> dict:
        return dict(self.finding.fields) if self.finding is not None else {}

    def __str__(self) -> str:
        return render(self.finding) if self.finding is not None else super().__str__()


class NotJson(BadRecord):
    """A line that is not valid UTF-8 JSON; `detail` is the decoder's reason."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail


# -- reading lines ----------------------------------------------------------------------------


def open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


class FileChangedError(InputError):
    """A file's bytes, hashed as they were read, are not the ones fingerprinted before."""


class PrefixReader(io.RawIOBase):
    """The first `nbytes` bytes of a file (what a run fingerprinted at its start: lines appended
    later are not read), hashed as they are read; `lines()` decompresses a .gz file."""

    def __init__(self, path: Path, nbytes: int):
        super().__init__()
        self.path, self.left = Path(path), nbytes
        self.sha256 = hashlib.sha256()
        self._fh = open(path, "rb")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._fh.read(min(len(buffer), self.left))
        buffer[:len(data)] = data
        self.left -= len(data)
        self.sha256.update(data)
        return len(data)

    def lines(self) -> Iterator[bytes]:
        # (kept: a buffer freed with its iterator would close this reader before hexdigest)
        self._buffered = io.BufferedReader(self, buffer_size=1 << 20)
        return iter(gzip.GzipFile(fileobj=self._buffered) if self.path.suffix == ".gz" else self._buffered)

    def hexdigest(self) -> str:
        """The sha256 of the prefix (read to its end first: gzip may stop short of it)."""
        while self.left > 0 and self.readinto(bytearray(min(self.left, 1 << 20))):
            pass
        return self.sha256.hexdigest()

    def close(self) -> None:
        self._fh.close()
        super().close()


def iter_lines(files: Iterable[Path], *, prefixes: Mapping[Path, tuple[int, str]] | None = None
               ) -> Iterator[tuple[str, bytes]]:
    """(where, line) for every non-blank line of `files` in order, where = 'file, line N'.

    `prefixes`: (bytes, sha256) per file, as fingerprinted: only those bytes are read, and a
    file whose bytes hash otherwise as they are read raises FileChangedError (edited in place)."""
    for f in files:
        prefix = (prefixes or {}).get(f)
        try:
            reader = PrefixReader(f, prefix[0]) if prefix else None
            with reader or open_binary(f) as fh:
                for line_no, line in enumerate(reader.lines() if reader else fh, 1):
                    if line.strip():
                        yield f"{f}, line {line_no}", line
                if reader and reader.hexdigest() != prefix[1]:
                    raise FileChangedError(Finding("runtime.file-changed-while-read", file=str(f), nbytes=prefix[0]))
        except (OSError, EOFError) as e:
            raise InputError(Finding("runtime.file-unreadable", file=str(f), error=str(e))) from e


def read_json(line: bytes) -> Any:
    """The JSON value of one line; raises NotJson. A UTF-8 byte order mark before it (an editor's,
    at the start of a file) is left out, as dflash-prepare's reader does."""
    try:
        text = line.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise NotJson(Finding("runtime.record-not-utf8", offset=e.start),
                      f"not UTF-8: bad byte at offset {e.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise NotJson(Finding("runtime.record-not-json", error=e.msg, column=e.colno), e.msg) from None


DOCUMENT_READ_LIMIT = 64 << 20  # bytes of a file read whole to tell one JSON document spanning lines


def json_document(path: Path, *, records_only: bool = False) -> str | None:
    """What `path` holds, in a few words, when it is not JSON Lines; None when it reads as JSON
    Lines, or cannot be told from JSON Lines with a damaged line (reading it names that line).

    Not JSON Lines: one JSON document spanning lines (a pretty-printed config.json,
    dataset_info.json or stats.json), told by its first non-blank line, which is no JSON value on
    its own while the file as a whole is one, or which only opens one (`{` or `[`). With
    `records_only`, also a file whose first line is a JSON value but not a record (an object with
    input_ids): a one-line dataset_info.json, an array of records, a line of another schema."""
    try:
        with open_binary(path) as fh:
            number, first = next(((n, line) for n, line in enumerate(fh, 1) if line.strip()), (0, b""))
            if not first:
                return None
            try:
                value = read_json(first)
            except NotJson:
                fh.seek(0)
                head = fh.read(DOCUMENT_READ_LIMIT + 1)
            else:
                return _not_a_record(value, number) if records_only else None
    except (OSError, EOFError):
        return None  # reading it names the problem
    try:
        document = json.loads(head.decode("utf-8-sig")) if len(head) <= DOCUMENT_READ_LIMIT else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        document = None
    if isinstance(document, dict | list):
        lines = head.rstrip().count(b"\n") + 1
        return f"one JSON document spanning {lines:,} lines ({_shape(document)})"
    opening = first.decode("utf-8-sig", errors="replace").strip()
    if opening in ("{", "["):
        return f"one JSON document spanning lines (its line {number} is a lone {opening})"
    return None


def _not_a_record(value: Any, number: int) -> str | None:
    if isinstance(value, dict) and "input_ids" in value:
        return None
    if isinstance(value, list):
        return f"one JSON document on line {number} ({_shape(value)}), not one record a line"
    return f"line {number} is {_shape(value)}, not a record (a JSON object with input_ids)"


def _shape(value: Any, shown: int = 5) -> str:
    if isinstance(value, dict):
        keys = list(value)
        return ("an object with keys " + ", ".join(keys[:shown]) + (", ..." if len(keys) > shown else "")
                if keys else "an empty object")
    if isinstance(value, list):
        return f"an array of {len(value):,} item{'' if len(value) == 1 else 's'}"
    kind = {str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")
    return f"a JSON {kind}"


def format_record(record: dict[str, Any]) -> str:
    """One record as its JSONL line (compact, without the newline)."""
    return json.dumps(record, separators=(",", ":"))


# -- validating a record ----------------------------------------------------------------------


def _int_array(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, list):
        raise BadRecord(Finding("runtime.record-not-int-list", key=name, got=type(value).__name__))
    if any(isinstance(v, bool) for v in value):  # (JSON true/false would read as 1/0)
        raise BadRecord(Finding("runtime.record-booleans", key=name))
    arr = np.asarray(value) if value else np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise BadRecord(Finding("runtime.record-not-flat", key=name))
    return arr.astype(np.int64)


def parse_record(line: bytes, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """One JSONL line -> (input_ids int64 [T], loss_mask uint8 [T]); raises BadRecord."""
    ids, mask, _ = parse_sample(line, vocab_size)
    return ids, mask


def record_group(rec: Mapping[str, Any]) -> str | int | None:
    """A record's "group" (None without one); raises BadRecord for another type."""
    group = rec.get("group")
    if group is None:
        return None
    if isinstance(group, bool) or not isinstance(group, str | int):
        raise BadRecord(Finding("runtime.record-group-type", value=json.dumps(group)[:40]))
    return group


def parse_sample(line: bytes, vocab_size: int) -> tuple[np.ndarray, np.ndarray, str | int | None]:
    """parse_record, plus the record's group (`record_group`)."""
    rec = read_json(line)
    if not isinstance(rec, dict):
        raise BadRecord(Finding("runtime.record-not-object"))
    if "input_ids" not in rec:
        raise BadRecord(Finding("runtime.record-no-input-ids"))
    ids = _int_array(rec["input_ids"], "input_ids")
    if ids.size == 0:
        raise BadRecord(Finding("runtime.record-empty"))
    if ids.min() < 0:
        raise BadRecord(Finding("runtime.record-token-negative", token=int(ids.min())))
    if ids.max() >= vocab_size:
        raise BadRecord(Finding("runtime.record-token-out-of-vocab", token=int(ids.max()), vocab_size=vocab_size))
    if "id" in rec and not isinstance(rec["id"], str | int):
        raise BadRecord(Finding("runtime.record-id-type"))
    group = record_group(rec)
    n = ids.size
    if "loss_mask" in rec:
        mask = _int_array(rec["loss_mask"], "loss_mask")
        if mask.size != n:
            raise BadRecord(Finding("runtime.record-length-mismatch", key="loss_mask", entries=int(mask.size), tokens=n))
        if mask.size and (mask.min() < 0 or mask.max() > 1):
            raise BadRecord(Finding("runtime.record-mask-values"))
        return ids, mask.astype(np.uint8), group
    if "labels" in rec:
        labels = _int_array(rec["labels"], "labels")
        if labels.size != n:
            raise BadRecord(Finding("runtime.record-length-mismatch", key="labels", entries=int(labels.size), tokens=n))
        return ids, (labels != -100).astype(np.uint8), group
    if "prompt_len" in rec:
        p = rec["prompt_len"]
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p <= n:
            raise BadRecord(Finding("runtime.record-prompt-len", tokens=n))
        mask = np.ones(n, dtype=np.uint8)
        mask[:p] = 0
        return ids, mask, group
    raise BadRecord(Finding("runtime.record-no-loss-mask"))


def completion_start(record: dict[str, Any]) -> int | None:
    """Where a record's completion starts, if it says so: the first 1 of `loss_mask`, the first
    label that is not -100, or `prompt_len`, the first of them present (as parse_record reads
    them, so a prompt ends where the extraction's loss starts)."""
    if isinstance(record.get("loss_mask"), list):
        return next((i for i, m in enumerate(record["loss_mask"]) if m), None)
    if isinstance(record.get("labels"), list):
        return next((i for i, lab in enumerate(record["labels"]) if lab != -100), None)
    if record.get("prompt_len") is not None:
        return int(record["prompt_len"])
    return None


# -- the sidecar ------------------------------------------------------------------------------


def sidecar_path(data_file: str | Path) -> Path:
    """`<data_file>.meta.json`."""
    data_file = Path(data_file)
    return data_file.with_name(data_file.name + META_SUFFIX)


def write_sidecar(data_file: str | Path, meta: dict[str, Any]) -> Path:
    path = sidecar_path(data_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"meta_version": META_VERSION, **meta})
    return path


def read_sidecar(data_file: str | Path) -> dict[str, Any] | None:
    """The sidecar of `data_file`, or None when it has none; an unreadable one is an InputError."""
    side = sidecar_path(data_file)
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(Finding("runtime.sidecar-unreadable", file=str(side), error=str(e))) from e
    if not isinstance(meta, dict):
        raise InputError(Finding("runtime.sidecar-not-object", file=str(side)))
    return meta


def read_rendering(data_file: str | Path) -> dict[str, Any] | None:
    """The rendering keys of `data_file`'s sidecar (chat template sha256, kwargs, ...)."""
    meta = read_sidecar(data_file)
    return None if meta is None else {k: meta[k] for k in RENDERING_KEYS if k in meta}
