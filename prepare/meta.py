"""The sidecar of a prepared file: `<output>.meta.json`, beside the JSONL it describes.

It records how the records were rendered (chat template sha256 and kwargs, loss_on, the
tokenizer), what produced them, and the counts of the run. `dflash-extract` copies its
rendering keys into the cache manifest (docs/prepare.md), so a cache names its template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash.runtime.fsio import atomic_write_json

META_SUFFIX = ".meta.json"
META_VERSION = 1


def meta_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + META_SUFFIX)


def write_meta(output: str | Path, meta: dict[str, Any]) -> Path:
    path = meta_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"meta_version": META_VERSION, **meta})
    return path


def read_meta(output: str | Path) -> dict[str, Any] | None:
    path = meta_path(output)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
