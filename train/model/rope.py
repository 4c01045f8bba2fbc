"""RoPE of a drafter: which of the target's settings it keeps, and its cos/sin tables.

A drafter is a full-rotary Qwen3 block whatever its target does (docs/serving.md): the target's
base and scaling are kept, its partial-rotary and M-RoPE keys are not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# RoPE keys of a target that a drafter does not use. A drafter is a full-rotary Qwen3 block (as in
# z-lab's model and SGLang); vLLM would rotate only `head_dim * partial_rotary_factor` (or
# `rope_dim`) of the head and refuses M-RoPE keys for DFlash, so they are never carried over.
TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "rope_dim", "mrope_section", "mrope_interleaved", "type")


def drafter_rope_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """`params` without the keys a full-rotary drafter does not use, with a rope_type."""
    out = {k: v for k, v in dict(params).items() if k not in TARGET_ONLY_ROPE_KEYS}
    out.setdefault("rope_type", params.get("type", "default"))
    return out


def rope_parameters_from_config(config: Any) -> dict[str, Any]:
    """The drafter's RoPE settings as one 5.x-style dict `{rope_type, rope_theta, ...}`.

    Accepts transformers 5.x configs (`rope_parameters`), 4.x ones (`rope_theta` +
    `rope_scaling`) and plain dicts (an export's config.json); the target's partial-rotary and
    M-RoPE keys are dropped (`TARGET_ONLY_ROPE_KEYS`).
    """
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    params = get("rope_parameters")
    if isinstance(params, dict) and "rope_type" not in params and "full_attention" in params:
        params = params["full_attention"]  # per-layer-type RoPE (e.g. Gemma 3): take the global one
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return drafter_rope_parameters(params)
    scaling = dict(get("rope_scaling") or {})
    theta = get("rope_theta")
    scaling["rope_theta"] = float(theta if theta is not None else 10000.0)
    return drafter_rope_parameters(scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, H, L, d] by the [B, L, d] tables of its positions."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class RotaryEmbedding(nn.Module):
    """cos/sin tables at absolute positions, with transformers' RoPE init for every rope_type.

    The inverse frequencies are a plain float32 attribute, not a buffer, so that casting the
    drafter to bf16 cannot round them (positions in the thousands need the float32 angles).
    """

    def __init__(self, c: Any) -> None:
        """`c`: a DrafterConfig (rope_parameters, head_dim, to_hf_config)."""
        super().__init__()
        rope_type = c.rope_parameters["rope_type"]
        if rope_type == "default":
            theta = float(c.rope_parameters["rope_theta"])
            inv_freq = 1.0 / theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                from dflash.runtime.findings import Finding
                from dflash.train.model.target_weights import TargetUnreadableError

                raise TargetUnreadableError(Finding("train.rope-type", rope_type=rope_type))
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](c.to_hf_config(), None)
        self.inv_freq = inv_freq.float()
        self.attention_scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
