"""`--config FILE` for every command: JSON, or YAML when PyYAML is installed.

Keys are the flags' names, written with dashes (as the flags) or underscores (as the config
fields); a key that names no setting is an error that lists the valid ones. A renamed setting
keeps its old key as a deprecated alias: accepted, with a warning naming the new one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import click

from .errors import DflashError, SettingError


def config_key(name: str) -> str:
    """A flag or key name as a config key: `--max-seq-len` / `max-seq-len` -> `max_seq_len`."""
    return str(name).lstrip("-").replace("-", "_")


def _parse(path: Path, text: str, error: type[DflashError]) -> Any:
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise error(f"{path} is YAML but PyYAML is not installed: `pip install pyyaml`, or write "
                        "the config as JSON.") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise error(f"{path} is not valid YAML: {e}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON: {e}") from e


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
        raise error(f"Config file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"Cannot read config file {path}: {e}.") from e
    raw = _parse(path, text, error)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise error(f"{path} must hold a mapping of setting names to values.")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = config_key(key)
        if aliases and name in aliases:
            click.echo(f"Warning: {path}: setting {name} is deprecated; it is {aliases[name]} now.", err=True)
            name = aliases[name]
        if name in out:
            raise error(f"{path} sets {name} twice (as {key!r} and another spelling); keep one.")
        out[name] = value
    unknown = sorted(set(out) - set(known))
    if unknown:
        raise error(f"{path}: unknown setting(s) {', '.join(unknown)}. Known settings: {', '.join(listed)}.")
    return out


def option_keys(command: click.Command) -> dict[str, str]:
    """{config key: click parameter name} for the long flags of `command` (not --config, --help)."""
    out: dict[str, str] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in (None, "config", "config_file"):
            continue
        for opt in param.opts:
            if opt.startswith("--"):
                out[config_key(opt)] = param.name  # type: ignore[assignment]
    return out


def load_config_defaults(ctx: click.Context, _param: Any, path: str | None) -> str | None:
    """Callback of an eager `--config` option: the file's settings become the command's
    defaults (click converts and checks them as it does the flags); flags given win."""
    if not path:
        return path
    keys = option_keys(ctx.command)
    values = read_config_file(path, sorted(keys))
    defaults: dict[str, Any] = {}
    for key, value in values.items():
        param = next(p for p in ctx.command.params if p.name == keys[key])
        if getattr(param, "multiple", False) and not isinstance(value, (list, tuple)):
            value = [value]  # one prompt file, written as a plain string
        defaults[keys[key]] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


def config_file_option(**kwargs: Any) -> Any:
    """`--config FILE` whose settings become the command's defaults (`load_config_defaults`)."""
    kwargs.setdefault("help", "JSON or YAML file of settings (keys as the flags, with - or _); flags "
                              "override it.")
    return click.option("--config", type=click.Path(dir_okay=False), callback=load_config_defaults,
                        is_eager=True, expose_value=False, **kwargs)
