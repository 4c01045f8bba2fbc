"""The sidecar of a prepared file: `<output>.meta.json`, beside the JSONL it describes.

It records how the records were rendered (chat template sha256 and kwargs, loss_on, the
tokenizer), what produced them, and the counts of the run. `dflash-extract` copies its
rendering keys into the cache manifest (docs/prepare.md), so a cache names its template.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

META_SUFFIX = ".meta.json"
META_VERSION = 1


def meta_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + META_SUFFIX)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a unique temp name, fsync, replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_meta(output: str | Path, meta: dict[str, Any]) -> Path:
    path = meta_path(output)
    atomic_write_text(path, json.dumps({"meta_version": META_VERSION, **meta}, indent=2, sort_keys=True) + "\n")
    return path


def read_meta(output: str | Path) -> dict[str, Any] | None:
    path = meta_path(output)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
