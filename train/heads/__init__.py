"""The registry of drafter heads: what a drafter adds to the DFlash backbone, by name.

The backbone (train/model/drafter.py: the fused context, the draft layers, the masks, the anchors) is
one; a head (`base.DraftHead`) declares in one module everything the rest of the code asks of
its kind of drafter: its settings (flags, config keys, defaults, limits: train/config.py composes
the run's settings from the heads'), its parameters and their start, its loss term, its decode
step, its export contract and its part of the run identity. `--drafter-type` names one.

Importing this package (and the built-in heads' modules) imports no torch: `dflash-train --help`
builds its choices from `head_names()`. A head outside the package registers itself with
`register_head` before a run is configured (docs/drafter.md, "Adding a head").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dflash.runtime.findings import Finding

from . import messages  # noqa: F401  (registers the heads' finding renderers)

if TYPE_CHECKING:
    from dflash.train.heads.base import DraftHead

_BUILTIN = {"dflash": "dflash.train.heads.dflash", "dflash2": "dflash.train.heads.dflash2",
            "dspark": "dflash.train.heads.dspark", "xpress": "dflash.train.heads.xpress",
            "lilicorr": "dflash.train.heads.lilicorr"}
"""The heads that ship with the trainer: name -> the module whose `HEAD` it is (imported on first use)."""
_LOADED: dict[str, DraftHead] = {}
_COMPOSED: list[str] = []
"""The heads whose settings the run's settings classes were composed from (`settings_parts`)."""


def register_head(head: DraftHead) -> DraftHead:
    """Make `head` available under `head.name` (as --drafter-type, in checkpoints and exports);
    a name or an architecture already taken by another head is refused. Returns `head`."""
    if not head.name or not head.architecture:
        raise ValueError(f"a head needs a name and an architecture, got {head.name!r} / {head.architecture!r}.")
    if head.name in _BUILTIN or _LOADED.get(head.name, head) is not head:
        raise ValueError(f"a drafter head named {head.name!r} is registered already.")
    clash = [h.name for h in map(get_head, head_names()) if h.architecture == head.architecture and h is not head]
    if clash:
        raise ValueError(f"head {head.name!r}: architecture {head.architecture} is head {clash[0]!r}'s already.")
    if _COMPOSED and (head.settings is not None or head.objective_settings is not None):
        raise ValueError(f"head {head.name!r} declares settings, but the trainer's settings (flags, config keys) "
                         "were composed already: register it before dflash.train.config is imported, or add "
                         "it to heads._BUILTIN.")
    _LOADED[head.name] = head
    return head


def unregister_head(name: str) -> None:
    """Forget a head registered with `register_head` (the built-ins stay)."""
    if name not in _BUILTIN:
        _LOADED.pop(name, None)


def head_names() -> tuple[str, ...]:
    """Every head's name: the built-ins, then the registered ones in their order."""
    return tuple(_BUILTIN) + tuple(n for n in _LOADED if n not in _BUILTIN)


def _module_head(name: str) -> DraftHead:
    return importlib.import_module(_BUILTIN[name]).HEAD


def get_head(name: str | None) -> DraftHead:
    """The head named `name` (None: a drafter recorded before heads had names, a DFlash one);
    an unknown name is a HeadSettingError (a ValueError) naming the choices."""
    name = "dflash" if name is None else name
    if name not in _LOADED:
        if name not in _BUILTIN:
            from dflash.train.heads.base import HeadSettingError

            raise HeadSettingError(Finding("train.unknown-head", name=name, heads=list(head_names())))
        _LOADED[name] = _module_head(name)
    return _LOADED[name]


def settings_parts(kind: str = "settings") -> tuple[type, ...]:
    """The settings dataclasses the registered heads declare, in the heads' order: `kind` "settings"
    (their drafter settings) or "objective_settings" (their loss's). train/config.py composes the
    run's settings classes from them when it is imported; a head registered after that may declare
    none (it could add no flag)."""
    _COMPOSED[:] = head_names()
    return tuple(part for part in (getattr(get_head(n), kind) for n in head_names()) if part is not None)


def architectures() -> tuple[str, ...]:
    """The `architectures` entries of every head's export (what the engines read to pick a loader)."""
    return tuple(get_head(n).architecture for n in head_names())


def head_for_architecture(names: list[str] | tuple[str, ...] | None) -> DraftHead | None:
    """The head whose export lists one of `names` (an export's config.json `architectures`), or None."""
    for name in head_names():
        head = get_head(name)
        if head.architecture in (names or ()):
            return head
    return None
