"""The Qwen3-style draft layer: attention from the block tokens to `[fused context ; block]`
(the context's keys/values come projected from outside, see model.py), a SwiGLU MLP, RMSNorms."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from dflash.train.heads import get_head
from dflash.train.model.attention import AttentionMask, attend
from dflash.train.model.rope import apply_rope
from torch import nn

if TYPE_CHECKING:
    from dflash.train.model.drafter_config import DrafterConfig


class RMSNorm(nn.Module):
    """Qwen3/Llama RMSNorm: computed in float32, weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class DrafterAttention(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [B, Hkv, L, d] of `x` [B, L, D]."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMask | None,
    ) -> torch.Tensor:
        b, n, _ = x.shape
        cos, sin = rope
        q = self.q_norm(self.q_proj(x).view(b, n, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_block, v_block = self.project_kv(x, cos, sin)
        k = torch.cat([context_kv[0], k_block], dim=2)
        v = torch.cat([context_kv[1], v_block], dim=2)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DrafterMLP(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(c)
        self.mlp = DrafterMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # A head may wrap the sublayers (DFlash2: an in-block convolution before and after each);
        # the wrapper's attribute prefixes its tensors (layers.N.attention_conv.*).
        head = get_head(c.drafter_type)
        self.wrappers = {sublayer: attr for sublayer, attr in head.wrapper_names.items()}
        for sublayer, attr in self.wrappers.items():
            setattr(self, attr, head.wrap_sublayer(c, sublayer))
        self.block_size = c.block_size

    def forward(self, x, context_kv, rope, mask) -> torch.Tensor:
        if not self.wrappers:
            x = x + self.self_attn(self.input_layernorm(x), context_kv, rope, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self._wrapped("attention", self.self_attn, self.input_layernorm(x), context_kv, rope, mask)
        return x + self._wrapped("mlp", self.mlp, self.post_attention_layernorm(x))

    def _wrapped(self, sublayer: str, module: nn.Module, x: torch.Tensor, *args) -> torch.Tensor:
        attr = self.wrappers.get(sublayer)
        if attr is None:
            return module(x, *args)
        wrapper = getattr(self, attr)
        h, state = wrapper.prepare(x, self.block_size)
        return wrapper.finish(module(h, *args), state, self.block_size)
