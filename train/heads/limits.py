"""Range checks of settings, as findings: a head's settings dataclass returns the first of its
settings out of range from its `refusal()` (the settings class it is composed into raises it,
runtime/settings.py `compose`), and train/config.py's sections raise them. Importing this module
imports no torch."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dflash.runtime.findings import Finding


def flag(name: str) -> str:
    """The flag of setting `name` (`--max-seq-len`)."""
    return "--" + name.replace("_", "-")


def below(obj: Any, names: tuple[str, ...], low: int, *, name_default: bool = False) -> Finding | None:
    """The first of `names` (None passes) below `low` (0 or 1); `name_default`: the finding names
    the setting's default (the fix: leave it out)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < low:
            default = _defaults(obj).get(name) if name_default else None
            return out_of_range(name, value, "at least 1" if low == 1 else "0 or more", default=default)
    return None


def _defaults(obj: Any) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(obj)}


def not_finite(obj: Any, names: tuple[str, ...]) -> Finding | None:
    """The first of `names` that is nan or inf, which the range checks let through (any comparison
    with nan is false): nan weights after the first steps."""
    defaults = _defaults(obj)
    for name in names:
        value = getattr(obj, name)
        if any(v is not None and not math.isfinite(v) for v in (value if isinstance(value, tuple) else (value,))):
            return Finding("train.setting-not-finite", flag=flag(name), value=value, default=defaults.get(name))
    return None


def out_of_range(name: str, value: Any, allowed: str, *, default: Any = None) -> Finding:
    """Setting `name` = `value` is not `allowed` (a short text: "at least 1", "in [0, 1)"); a
    `default` given is named as the fix."""
    return Finding("train.setting-range", flag=flag(name), value=value, allowed=allowed, default=default)


def first(*found: Finding | None) -> Finding | None:
    """The first finding of several checks (None: all passed)."""
    return next((f for f in found if f is not None), None)
