"""What a target's causal-LM forward does to its logits after the lm_head.

Most families return `lm_head(norm(x))` as it is. Cohere multiplies it by `logit_scale`, Granite
divides it by `logits_scaling`, Gemma 2/3 soft-cap it (`tanh(z / c) * c`,
`final_logit_softcapping`). Soft labels must see the logits the target's forward returns,
whichever way they are made: recomputed from the cache's last hidden state (`dflash-train`)
or stored as top-k log-probs at extraction (`dflash-extract --store-topk`). Both read the
steps here, from the target's config. torch is not imported: the functions use tensor methods.
"""

from __future__ import annotations

from typing import Any


def post_head_steps(config: Any) -> dict[str, float | None]:
    """{"scale": factor or None, "softcap": cap or None} of a transformers config (its text config
    for a multimodal one)."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    scale = _first(text, config, "logit_scale")  # Cohere multiplies
    divide = _first(text, config, "logits_scaling")  # Granite divides
    if divide:
        scale = (scale or 1.0) / float(divide)
    cap = _first(text, config, "final_logit_softcapping")  # Gemma 2/3
    return {"scale": None if scale in (None, 1.0) else float(scale), "softcap": float(cap) if cap else None}


def apply_post_head(logits: Any, *, scale: float | None = None, softcap: float | None = None) -> Any:
    """`logits` as the target's forward returns them (scale first, then the soft cap)."""
    if scale is not None:
        logits = logits * scale
    if softcap is not None:
        logits = (logits / softcap).tanh() * softcap
    return logits


def _first(text: Any, config: Any, name: str) -> Any:
    value = getattr(text, name, None)
    return value if value is not None else getattr(config, name, None)
