"""Reading `--config FILE` for every command: JSON, or YAML when PyYAML is installed.

Keys may be written with dashes (as the flags) or underscores (as the config fields); a key
that names no setting is an error that lists the known ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import DflashError


def read_config_file(
    path: str | os.PathLike, known_keys: Iterable[str], error: type[DflashError]
) -> dict[str, Any]:
    """{setting: value} from a JSON/YAML file; problems raise `error` with one sentence."""
    path = Path(path)
    known = tuple(known_keys)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"Config file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"Cannot read config file {path}: {e}.") from e
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise error(
                f"{path} is YAML but PyYAML is not installed: `pip install pyyaml`, or write "
                "the config as JSON."
            ) from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise error(f"{path} is not valid YAML: {e}") from e
    else:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise error(f"{path} is not valid JSON: {e}") from e
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise error(f"{path} must hold a mapping of setting names to values.")
    out = {str(k).replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(out) - set(known))
    if unknown:
        raise error(
            f"{path}: unknown setting(s) {', '.join(unknown)}. Known settings: {', '.join(known)}."
        )
    return out
