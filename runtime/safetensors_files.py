"""A safetensors file is checked before it is used: its header and its size.

A truncated or damaged `model.safetensors` (a copy that stopped, a disk that filled) otherwise
reaches the user as the library's traceback from deep inside a load. The check reads the
8-byte header length and the JSON header only (no tensor data), so it costs microseconds,
and says which file is damaged and what to do.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from .errors import CorruptDataError, InputError
from .findings import Finding

MAX_HEADER_BYTES = 100 << 20  # the format's own limit


class WeightsFileError(CorruptDataError):
    """A safetensors file is truncated or damaged."""


def safetensors_problem(path: str | os.PathLike) -> Finding | None:
    """Why `path` is not a complete safetensors file (a `runtime.safetensors-*` reason), or None
    when its header and size hold."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return Finding("runtime.safetensors-short", size=size)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return Finding("runtime.safetensors-header-size", header=n, size=size)
            header = json.loads(f.read(n))
    except OSError as e:
        return Finding("runtime.safetensors-unreadable", error=str(e.strerror or e))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return Finding("runtime.safetensors-header-not-json", error=str(e))
    if not isinstance(header, dict):
        return Finding("runtime.safetensors-header-not-object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in entry["data_offsets"])
        except (TypeError, KeyError, ValueError):
            return Finding("runtime.safetensors-offsets", tensor=name, offsets=None)
        if not 0 <= begin <= stop:
            return Finding("runtime.safetensors-offsets", tensor=name, offsets=[begin, stop])
        end = max(end, stop)
    data = size - 8 - n
    if end != data:
        return Finding("runtime.safetensors-data-size", needed=end, holds=data)
    return None


# What a checked file holds, which decides what to do about it (the words: runtime/messages.py,
# runtime.weights-file-damaged): a target's weights, a drafter export's, a checkpoint resumed
# from or exported.
WEIGHT_PURPOSES = ("target", "drafter", "resume", "export")


def check_safetensors(path: str | os.PathLike, *, purpose: str) -> None:
    """Raise WeightsFileError naming `path` and what to do for `purpose` (one of WEIGHT_PURPOSES)
    when it is not a complete safetensors file."""
    if purpose not in WEIGHT_PURPOSES:
        raise ValueError(f"weights purpose {purpose!r} is not one of {WEIGHT_PURPOSES}")
    problem = safetensors_problem(path)
    if problem is not None:
        raise WeightsFileError(Finding("runtime.weights-file-damaged", file=str(path), problem=problem,
                                       purpose=purpose))


def check_weight_dir(directory: str | os.PathLike, *, purpose: str) -> None:
    """Check every *.safetensors file of a model directory (a target, a drafter)."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        check_safetensors(path, purpose=purpose)


# The architectures of the built-in heads' exports (train/heads/; runtime imports no train module);
# no target has them, nor the `dflash_config` every drafter export writes.
DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


class DrafterAsTargetError(InputError):
    """A drafter export was given where the target model belongs."""


def refuse_drafter_as_target(directory: str | os.PathLike, *, flag: str = "--target-model") -> None:
    """A DFlash drafter export passed as the target is refused by name (it loads as a small Qwen3
    and fails later, or not at all, with a message about something else)."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return  # missing or unreadable: the loader's own check names it
    architectures = config.get("architectures") if isinstance(config, dict) else None
    found = [a for a in architectures or [] if a in DRAFTER_ARCHITECTURES]
    if not found and isinstance(config, dict) and isinstance(config.get("dflash_config"), dict):
        found = list(architectures or []) or ["none listed"]  # a drafter of a head registered elsewhere
    if found:
        raise DrafterAsTargetError(Finding("runtime.drafter-as-target", dir=str(directory), architectures=found,
                                           flag=flag))


class IncompleteWeightsError(WeightsFileError):
    """A model directory whose weight files lack tensors its config needs (or hold them in
    another shape): the loader would fill them with random values."""


def refuse_incomplete_weights(directory: str | os.PathLike, loading_info: dict | None, *,
                              flag: str = "--target-model") -> None:
    """`from_pretrained(..., output_loading_info=True)`'s report: where tensors were missing from
    the checkpoint (or of another shape), transformers initialised them at random and goes on, so
    every hidden state, completion or measurement after it would be a half-random model's."""
    info = loading_info or {}
    missing = list(info.get("missing_keys") or [])
    mismatched = [str(m[0]) if isinstance(m, (list, tuple)) else str(m) for m in info.get("mismatched_keys") or []]
    if missing or mismatched:
        raise IncompleteWeightsError(Finding("runtime.weights-incomplete", dir=str(directory), flag=flag,
                                             missing=missing, mismatched=mismatched))
