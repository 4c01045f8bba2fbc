"""How many positions a target takes: read from its config, for every command that runs it.

Past them a model of learned positions has no embedding to look up, and a RoPE model gives
hidden states at angles it never saw in training: nothing fails, the numbers are out of range.
Extraction holds its samples to them (`dflash-extract`) and the evaluation its prompts with the
tokens it decodes (`dflash-eval`).

The count is the config's `max_position_embeddings` (or, for families that name it otherwise,
`n_positions`, `seq_length`, `max_sequence_length`, `max_seq_len`: the fewest of those given),
of its text config for a multimodal one. A RoPE scaling (`rope_scaling`, or 5.x's
`rope_parameters`) with a `factor` extends it to factor x `original_max_position_embeddings`
(or x the count above where it gives none), when that is more: YaRN, linear and dynamic
scaling state the pretrained count and the factor; Llama 3's and LongRoPE's configs give the
extended count already. torch is not imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POSITION_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length", "max_seq_len")
NO_SCALING = (None, "default", "mrope")


@dataclass(frozen=True)
class TargetPositions:
    """The positions a target takes, and where its config says so."""

    limit: int
    source: str  # e.g. "max_position_embeddings 32768, rope_scaling yarn x4 of 32768"

    def describe(self) -> str:
        """`the target's 2,048 positions (max_position_embeddings 2048 of its config)`."""
        return f"the target's {self.limit:,} positions ({self.source} of its config)"


def target_positions(config: Any) -> TargetPositions | None:
    """The positions a transformers config (or its config.json as a dict) allows; None where it
    gives no count."""
    text = _text_config(config)
    counts = [(key, value) for key in POSITION_KEYS
              if isinstance(value := _get(text, key), int) and not isinstance(value, bool) and value > 0]
    if not counts:
        return None
    key, base = min(counts, key=lambda kv: kv[1])
    limit, source = base, f"{key} {base}"
    scaling = _rope_scaling(text)
    factor = scaling.get("factor")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in NO_SCALING and isinstance(factor, int | float) and not isinstance(factor, bool) and factor > 1:
        original = scaling.get("original_max_position_embeddings")
        original = original if isinstance(original, int) and original > 0 else base
        scaled = int(factor * original)
        if scaled > limit:
            limit, source = scaled, f"{source}, rope_scaling {kind} x{factor:g} of {original}"
    return TargetPositions(limit, source)


def _text_config(config: Any) -> Any:
    if isinstance(config, dict):
        text = config.get("text_config")
        return text if isinstance(text, dict) else config
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def _rope_scaling(config: Any) -> dict[str, Any]:
    """The RoPE scaling parameters (5.x `rope_parameters`, 4.x `rope_scaling`; the global
    layers' of a per-layer-type one), {} for none."""
    for key in ("rope_parameters", "rope_scaling"):
        params = _get(config, key)
        if isinstance(params, dict) and "rope_type" not in params and "type" not in params:
            params = params.get("full_attention")  # per layer type (e.g. Gemma 3): the global layers'
        if isinstance(params, dict) and params:
            return params
    return {}
