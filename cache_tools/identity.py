"""What makes two targets "the same": one definition, compared for an explicit purpose.

A cache header's `target` section holds the target's identity:

  architecture        the config's `architectures[0]` (the model class for in-memory models)
  hidden_size, num_hidden_layers, vocab_size
  config_hash         sha256 of the canonical JSON of its config.json (sorted keys, no
                      whitespace, `transformers_version` left out)
  tokenizer_hash      sha256 over the tokenizer files of the model directory (None: it has none)
  weights_hash        sha256 over the weight files of the model directory (name and content
                      sha256 of each *.safetensors, *.bin, *.pt, *.pth; None: in-memory model).
                      A file's sha256 is computed once (in 16 MB chunks) and reused while its
                      size and mtime hold, from the user's cache directory
                      ($XDG_CACHE_HOME or ~/.cache, dflash/weights-hashes.json)

Where the model lay is provenance, not identity: it goes to the header's `provenance`
section. The same files at two mount points, or a model directory moved between two runs,
are the same target: their caches resume, merge and train together.

Purposes (`Purpose`): `resume` (an extraction continues a cache), `merge` (caches become one),
`train-together` (caches feed one training run) compare every identity field, and so does
`drafter` (an exported drafter meets a target other than the one it was trained against:
dflash-eval measures it there, `dflash-train --init-drafter` starts a run from it; said, never
refused, since a drafter of a related target is a fair start); `train` (a cache
feeds a drafter of the target model given to the trainer) compares the same fields, read
from that model's directory, but for the weights: other weights of the same config are a
warning there (`weights_note`), since the drafter trains on the cache's hidden states and the
target gives only its embedding and head. Each comparison uses only the fields both sides
record: a cache written before `tokenizer_hash` or `weights_hash` existed still resumes, merges
and trains (its other fields must agree; `unrecorded_weights_note` says what was not checked),
and an older header's `target.path` is set aside as provenance.
"""

from __future__ import annotations

import hashlib
import json
import os
from enum import StrEnum
from pathlib import Path
from typing import Any

from dflash.runtime.findings import Finding

IDENTITY_FIELDS = ("architecture", "hidden_size", "num_hidden_layers", "vocab_size", "config_hash", "tokenizer_hash",
                   "weights_hash")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHTS_HASHES_FILE = "weights-hashes.json"  # in the user's cache directory: sha256 per weight file
HASH_CHUNK = 1 << 24
# Tokenizer files whose bytes decide what the token ids mean. tokenizer_config.json is hashed
# without its chat template: the template changes how text becomes a conversation, not the ids.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "special_tokens_map.json", "tokenizer_config.json")
_CONFIG_LEFT_OUT = ("transformers_version",)


class Purpose(StrEnum):
    """Why two targets are compared (the message names it)."""

    RESUME = "resume"
    MERGE = "merge"
    TRAIN_TOGETHER = "train-together"
    TRAIN = "train"
    DRAFTER = "drafter"


def _canonical_sha256(data: Any) -> str:
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def config_file_hash(model_dir: str | Path) -> str:
    """sha256 of the canonical JSON of `model_dir/config.json` (its content, never its path)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    for key in _CONFIG_LEFT_OUT:
        raw.pop(key, None)
    return _canonical_sha256(raw)


def config_object_hash(config: Any) -> str:
    """sha256 of an in-memory config's canonical JSON (for a model given without a directory)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for key in (*_CONFIG_LEFT_OUT, "_name_or_path"):
        data.pop(key, None)
    return _canonical_sha256(data)


def tokenizer_hash(model_dir: str | Path) -> str | None:
    """sha256 over the tokenizer files of a model directory (name and content); None without any."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        found = True
        data = path.read_bytes()
        if name == "tokenizer_config.json":
            try:
                parsed = json.loads(data)
                parsed.pop("chat_template", None)
                data = json.dumps(parsed, sort_keys=True, separators=(",", ":")).encode()
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                pass  # hashed as it is
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest() if found else None


def weights_hashes_path() -> Path:
    """Where each weight file's sha256 is kept (the model directory may be read-only)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash" / WEIGHTS_HASHES_FILE


def _read_known() -> dict[str, Any]:
    try:
        known = json.loads(weights_hashes_path().read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write_known(known: dict[str, Any]) -> None:
    """Best effort: a cache directory that cannot be written only costs the next run a rehash."""
    from dflash.runtime.fsio import atomic_write_json

    known = {k: v for k, v in known.items() if os.path.exists(k)}  # files since deleted go
    try:
        weights_hashes_path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(weights_hashes_path(), known)
    except OSError:
        pass


def file_sha256(path: Path, known: dict[str, Any]) -> str:
    """sha256 of a file's content: `known`'s entry while the file's size and mtime hold, else
    hashed in chunks (and entered in `known`)."""
    st = path.stat()
    key = str(path.resolve())
    entry = known.get(key)
    if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return entry["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
    known[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}
    return digest.hexdigest()


def weights_hash(model_dir: str | Path) -> str | None:
    """sha256 over the weight files of a model directory (name and content); None without any."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())
    if not files:
        return None
    known = _read_known()
    before = json.dumps(known, sort_keys=True)
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + bytes.fromhex(file_sha256(path, known)))
    if json.dumps(known, sort_keys=True) != before:
        _write_known(known)
    return digest.hexdigest()


def target_identity(config: Any, model_dir: str | Path | None, *, num_hidden_layers: int | None = None,
                    architecture: str | None = None) -> dict[str, Any]:
    """The identity fields of a target from its (text) config and, when it has one, its directory.

    `num_hidden_layers` overrides the config's count (the decoder layers actually found);
    `architecture` is the fallback name when the config lists none.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    has_dir = model_dir is not None and (Path(model_dir) / "config.json").is_file()
    archs = getattr(config, "architectures", None) or []
    return {
        "architecture": archs[0] if archs else architecture,
        "hidden_size": int(text.hidden_size),
        "num_hidden_layers": int(num_hidden_layers if num_hidden_layers is not None else text.num_hidden_layers),
        "vocab_size": int(text.vocab_size),
        "config_hash": config_file_hash(model_dir) if has_dir else config_object_hash(config),
        "tokenizer_hash": tokenizer_hash(model_dir) if has_dir else None,
        "weights_hash": weights_hash(model_dir) if has_dir else None,
    }


def target_provenance(model_dir: str | Path | None) -> dict[str, Any]:
    """Where the target was read from (recorded, never compared)."""
    return {"target_path": str(Path(model_dir).resolve()) if model_dir is not None else "<in-memory model>"}


def comparable(target: dict[str, Any] | None) -> dict[str, Any]:
    """The identity fields a target section records (provenance and unset fields left out)."""
    target = target or {}
    return {k: target[k] for k in IDENTITY_FIELDS if target.get(k) is not None}


# The fields each purpose compares: the purposes are explicit so that a rule for one of them
# changes here and nowhere else. Training from a cache takes only the target's embedding and
# head: other weights of the same config are a warning there (weights_note), not a refusal.
PURPOSE_FIELDS: dict[Purpose, tuple[str, ...]] = {
    p: tuple(f for f in IDENTITY_FIELDS if p != Purpose.TRAIN or f != "weights_hash") for p in Purpose
}


def target_differences(expected: dict[str, Any] | None, found: dict[str, Any] | None,
                       purpose: Purpose) -> list[tuple[str, Any, Any]]:
    """(field, expected value, found value) for each field of the purpose that both target
    sections record and that differs; empty: the same target for that purpose."""
    first, second = comparable(expected), comparable(found)
    fields = [k for k in PURPOSE_FIELDS[Purpose(purpose)] if k in first and k in second]
    return [(k, first[k], second[k]) for k in fields if first[k] != second[k]]


def weights_note(cached: dict[str, Any] | None, current: dict[str, Any] | None, *, cache: str,
                 target: str) -> Finding | None:
    """cache.target-weights-differ when the cache at `cache` and the target model at `target`
    both record weight hashes and they differ (the same config, other weights); None otherwise."""
    a, b = (cached or {}).get("weights_hash"), (current or {}).get("weights_hash")
    if a is None or b is None or a == b:
        return None
    return Finding("cache.target-weights-differ", cache=cache, target=target, cache_hash=a[:12], target_hash=b[:12])


# What may record its target without a hash of the weights (cache.target-weights-unrecorded).
UNRECORDED_PURPOSES = ("cache", "checkpoint")


def unrecorded_weights_note(recorded: dict[str, Any] | None, current: dict[str, Any] | None, *, purpose: str,
                            path: str) -> Finding | None:
    """cache.target-weights-unrecorded when `recorded` (the target of the older cache or
    checkpoint at `path`, by `purpose`) has no weights hash while `current` does: accepted, but
    the weights could not be checked."""
    if purpose not in UNRECORDED_PURPOSES:
        raise ValueError(f"purpose {purpose!r} is not one of {UNRECORDED_PURPOSES}")
    if (recorded or {}).get("weights_hash") is None and (current or {}).get("weights_hash") is not None:
        return Finding("cache.target-weights-unrecorded", purpose=purpose, path=path)
    return None
