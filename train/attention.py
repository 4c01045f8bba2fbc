"""The DFlash training attention pattern and the two kernels that run it.

Layout of one training sequence: keys/values are `[context (T) ; block_0 ; block_1 ; ...]`,
queries are the block tokens only, `A` anchors x `block_size` tokens. A query of block `a`
(anchor at position `p_a`) may see:

- context positions `j < p_a` (strictly: the anchor's own target state would leak the answer),
- every token of its own block (bidirectional),
- nothing else (no other block, no padding).

Padding anchors (sequences with fewer anchors than the widest one) get position 0 and so see
only their own block; that keeps every softmax row non-empty (no NaN) and their outputs are
dropped by the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("auto", "sdpa", "flex")


def build_dense_mask(anchor_positions: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask [B, A*block_size, context_len + A*block_size]; True where attention is allowed.

    `anchor_positions` is [B, A] long (padding anchors at position 0).
    """
    batch, num_anchors = anchor_positions.shape
    device = anchor_positions.device
    q_len = num_anchors * block_size
    q_block = torch.arange(q_len, device=device) // block_size  # [Q]
    kv = torch.arange(context_len + q_len, device=device)  # [KV]
    anchor_of_query = anchor_positions[:, q_block]  # [B, Q]
    sees_context = (kv[None, None, :] < context_len) & (kv[None, None, :] < anchor_of_query[..., None])
    kv_block = (kv - context_len).div(block_size, rounding_mode="floor")
    sees_block = (kv[None, :] >= context_len) & (kv_block[None, :] == q_block[:, None])  # [Q, KV]
    return sees_context | sees_block[None].expand(batch, -1, -1)


def make_mask_mod(anchor_positions: torch.Tensor, context_len: int, block_size: int):
    """The same rule as `build_dense_mask`, as a flex-attention mask_mod(b, h, q_idx, kv_idx)."""

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        in_context = kv_idx < context_len
        sees_context = in_context & (kv_idx < anchor_positions[b, q_block])
        sees_block = (~in_context) & ((kv_idx - context_len) // block_size == q_block)
        return sees_context | sees_block

    return mask_mod


@dataclass
class AttentionMask:
    """One mask per batch, shared by every draft layer; built for the kernel that will use it."""

    backend: str
    dense: torch.Tensor | None = None
    """[B, 1, Q, KV] bool for SDPA."""
    block_mask: Any = None
    """A flex-attention BlockMask."""


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}.")
    if backend == "auto":
        # Flex attention is only fast when compiled, which is reliable on CUDA.
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


def build_attention_mask(
    anchor_positions: torch.Tensor, context_len: int, block_size: int, backend: str = "auto"
) -> AttentionMask:
    """Build the training mask for `backend` ("sdpa", "flex" or "auto")."""
    backend = resolve_backend(backend, anchor_positions.device)
    if backend == "sdpa":
        dense = build_dense_mask(anchor_positions, context_len, block_size)
        return AttentionMask(backend="sdpa", dense=dense[:, None])
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_anchors = anchor_positions.shape
    q_len = num_anchors * block_size
    block_mask = create_block_mask(
        make_mask_mod(anchor_positions, context_len, block_size),
        batch,
        None,
        q_len,
        context_len + q_len,
        device=anchor_positions.device,
    )
    return AttentionMask(backend="flex", block_mask=block_mask)


_compiled_flex = None


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type != "cuda":
        # Uncompiled flex materializes the scores: correct, only meant for tests on CPU.
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None) -> torch.Tensor:
    """Attention over [B, H, Q, d] queries and [B, Hkv, KV, d] keys/values (GQA allowed).

    `mask=None` means every query sees every key (the inference path).
    """
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if mask.backend == "flex":
        return _flex(q, k, v, mask.block_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=True)
