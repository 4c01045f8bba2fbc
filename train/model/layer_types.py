"""Attention types of the draft layers, as `--draft-layer-types` spells them (torch-free: the
training config checks the flag before anything heavy is imported)."""

from __future__ import annotations

from dflash.runtime.errors import SettingError
from dflash.runtime.findings import Finding

_LAYER_TYPE_NAMES = {"full": "full_attention", "sliding": "sliding_attention",
                     "full_attention": "full_attention", "sliding_attention": "sliding_attention"}


def parse_layer_types(spec: str | list[str] | None, num_layers: int) -> list[str]:
    """Per-draft-layer attention types from `full`, `sliding` or a comma-separated per-layer list
    (`sliding,sliding,full`; `full_attention`/`sliding_attention` spell the same)."""
    if spec is None:
        return ["full_attention"] * num_layers
    items = [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec) if t.strip()]
    bad = [t for t in items if t not in _LAYER_TYPE_NAMES]
    if bad or not items:
        raise SettingError(Finding("train.draft-layer-types", spec=spec, bad=bad))
    if len(items) == 1:
        items = items * num_layers
    if len(items) != num_layers:
        raise SettingError(Finding("train.draft-layer-types-count", spec=spec, given=len(items), layers=num_layers))
    return [_LAYER_TYPE_NAMES[t] for t in items]
