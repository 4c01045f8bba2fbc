"""Reading a `--config FILE`: JSON, or YAML when PyYAML is installed.

Keys are the flags' names, written with dashes (as the flags) or underscores (as the config
fields); a key that names no setting is an error that lists the valid ones. A renamed setting
keeps its old key as a deprecated alias: accepted, with a warning naming the new one. The values
are converted and checked by `dflash.runtime.settings`, as the flags' are.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from .errors import DflashError, SettingError
from .findings import Finding, emit


def config_key(name: str) -> str:
    """A flag or key name as a config key: `--max-seq-len` / `max-seq-len` -> `max_seq_len`."""
    return str(name).lstrip("-").replace("-", "_")


class _RepeatedKey(ValueError):
    """A key given twice in one mapping of a config file (the parsers keep the last silently)."""


def _unique_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def _parse(path: Path, text: str, error: type[DflashError]) -> Any:
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise error(Finding("runtime.config-yaml-missing", file=str(path))) from None

        class UniqueKeyLoader(yaml.SafeLoader):
            def construct_mapping(self, node, deep=False):
                self.flatten_mapping(node)
                return _unique_pairs([(self.construct_object(k, deep=deep), self.construct_object(v, deep=deep))
                                      for k, v in node.value])

        try:
            return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
        except _RepeatedKey as e:
            raise error(Finding("runtime.config-repeated-key", file=str(path), key=e.args[0])) from None
        except yaml.YAMLError as e:
            raise error(Finding("runtime.config-not-parsed", file=str(path), format="YAML", error=str(e))) from e
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except _RepeatedKey as e:
        raise error(Finding("runtime.config-repeated-key", file=str(path), key=e.args[0])) from None
    except json.JSONDecodeError as e:
        raise error(Finding("runtime.config-not-parsed", file=str(path), format="JSON", error=str(e))) from e


def yaml_source(path: str | os.PathLike, keys: Collection[str], index: int | None = None) -> tuple[str, int] | None:
    """(text as written, line) of the value a YAML config file gives one of `keys` (item `index`
    of a list), where that value is a plain scalar; None for JSON or where it cannot be told.

    An error about a value YAML typed (`0755` read as the integer 493, `on` as true) shows it as
    the user wrote it."""
    path = Path(path)
    if path.suffix not in (".yaml", ".yml"):
        return None
    try:
        import yaml
    except ImportError:
        return None
    try:
        root = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(root, yaml.MappingNode):
        return None
    for key, node in root.value:
        if not isinstance(key, yaml.ScalarNode) or config_key(key.value) not in keys:
            continue
        if index is not None:
            node = node.value[index] if isinstance(node, yaml.SequenceNode) and index < len(node.value) else None
        if isinstance(node, yaml.ScalarNode) and not node.style:  # plain: unquoted
            return node.value, node.start_mark.line + 1
    return None


def read_config_file(
    path: str | os.PathLike, known_keys: Iterable[str], error: type[DflashError] = SettingError, *,
    aliases: Mapping[str, str] | None = None, listed: Iterable[str] | None = None,
) -> dict[str, Any]:
    """{setting: value} from a JSON/YAML file; problems raise `error` with one sentence.

    `known_keys` are the valid keys (underscored); `aliases` maps deprecated keys to them;
    `listed` are the keys an error lists (default: all the known ones).
    """
    path = Path(path)
    known = tuple(known_keys)
    listed = tuple(listed) if listed is not None else known
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(Finding("runtime.config-missing", file=str(path))) from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(Finding("runtime.config-unreadable", file=str(path), error=str(e))) from e
    raw = _parse(path, text, error)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise error(Finding("runtime.config-not-mapping", file=str(path)))
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = config_key(key)
        if aliases and name in aliases:
            emit(Finding("runtime.config-key-deprecated", file=str(path), key=name, now=aliases[name]),
                 prefix="Warning: ")
            name = aliases[name]
        if name in out:
            raise error(Finding("runtime.config-key-twice", file=str(path), key=name, spelling=key))
        out[name] = value
    unknown = sorted(set(out) - set(known))
    if unknown:
        raise error(Finding("runtime.config-unknown-keys", file=str(path), unknown=unknown, known=list(listed)))
    return out
