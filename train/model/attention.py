"""The DFlash training attention pattern and the two kernels that run it.

Layout of one training sequence: keys/values are `[context (T) ; block_0 ; block_1 ; ...]`,
queries are the block tokens only, `A` anchors x `block_size` tokens. A query of block `a`
(anchor at position `p_a`) may see:

- context positions `j < p_a` (strictly: the anchor's own target state would leak the answer),
- every token of its own block (bidirectional),
- nothing else (no other block, no padding).

A sliding-window layer (`window` W) further keeps only keys at positions j > q - W for a query
at position q (context and block alike), and a causal layer lets block slot s see only block
slots <= s. The serving engines resolve both per layer (`DrafterConfig.layer_attention`), so a
drafter's layers may need up to two different masks; `build_layer_masks` builds each distinct
one once.

Padding anchors (sequences with fewer anchors than the widest one) get position 0 and so see
only their own block; that keeps every softmax row non-empty (no NaN) and their outputs are
dropped by the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from dflash.runtime.errors import SettingError
from dflash.runtime.findings import Finding
from dflash.train.config import (
    ATTENTION_BACKENDS,  # beside --attention-backend (torch-free, for --help)
)


def build_dense_mask(anchor_positions: torch.Tensor, context_len: int, block_size: int, *,
                     window: int | None = None, causal: bool = False) -> torch.Tensor:
    """Boolean mask [B, A*block_size, context_len + A*block_size]; True where attention is allowed.

    `anchor_positions` is [B, A] long (padding anchors at position 0).
    """
    batch, num_anchors = anchor_positions.shape
    device = anchor_positions.device
    q_len = num_anchors * block_size
    q_block = torch.arange(q_len, device=device) // block_size  # [Q]
    q_slot = torch.arange(q_len, device=device) % block_size
    kv = torch.arange(context_len + q_len, device=device)  # [KV]
    anchor_of_query = anchor_positions[:, q_block]  # [B, Q]
    sees_context = (kv[None, None, :] < context_len) & (kv[None, None, :] < anchor_of_query[..., None])
    if window is not None:
        query_pos = anchor_of_query + q_slot  # [B, Q]
        sees_context = sees_context & (query_pos[..., None] - kv[None, None, :] < window)
    kv_block = (kv - context_len).div(block_size, rounding_mode="floor")
    kv_slot = (kv - context_len) % block_size
    sees_block = (kv[None, :] >= context_len) & (kv_block[None, :] == q_block[:, None])  # [Q, KV]
    if causal:
        sees_block = sees_block & (kv_slot[None, :] <= q_slot[:, None])
    if window is not None:
        sees_block = sees_block & (q_slot[:, None] - kv_slot[None, :] < window)
    return sees_context | sees_block[None].expand(batch, -1, -1)


def make_mask_mod(anchor_positions: torch.Tensor, context_len: int, block_size: int, *,
                  window: int | None = None, causal: bool = False):
    """The same rule as `build_dense_mask`, as a flex-attention mask_mod(b, h, q_idx, kv_idx)."""

    def mask_mod(b, h, q_idx, kv_idx):
        q_block, q_slot = q_idx // block_size, q_idx % block_size
        in_context = kv_idx < context_len
        anchor = anchor_positions[b, q_block]
        sees_context = in_context & (kv_idx < anchor)
        kv_slot = (kv_idx - context_len) % block_size
        sees_block = (~in_context) & ((kv_idx - context_len) // block_size == q_block)
        if causal:
            sees_block = sees_block & (kv_slot <= q_slot)
        if window is not None:
            sees_context = sees_context & (anchor + q_slot - kv_idx < window)
            sees_block = sees_block & (q_slot - kv_slot < window)
        return sees_context | sees_block

    return mask_mod


@dataclass
class AttentionMask:
    """One mask per batch and kind of layer; built for the kernel that will use it."""

    backend: str
    dense: torch.Tensor | None = None
    """[B, 1, Q, KV] bool for SDPA."""
    block_mask: Any = None
    """A flex-attention BlockMask."""


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise SettingError(Finding("train.attention-backend", backend=backend, choices=list(ATTENTION_BACKENDS)))
    if backend == "auto":
        # Flex attention is only fast when compiled, which is reliable on CUDA.
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


def refuse_backend_off_its_device(backend: str, device: torch.device) -> None:
    """--attention-backend flex on a CPU: torch's FlexAttention has no backward there, and the
    first step would end in its traceback."""
    if backend == "flex" and device.type == "cpu":
        from dflash.train.config import TrainConfigError

        raise TrainConfigError(Finding("train.flex-on-cpu", flag="--attention-backend", device=device.type))


def build_attention_mask(
    anchor_positions: torch.Tensor, context_len: int, block_size: int, backend: str = "auto", *,
    window: int | None = None, causal: bool = False,
) -> AttentionMask:
    """Build the training mask for `backend` ("sdpa", "flex" or "auto")."""
    backend = resolve_backend(backend, anchor_positions.device)
    if backend == "sdpa":
        dense = build_dense_mask(anchor_positions, context_len, block_size, window=window, causal=causal)
        return AttentionMask(backend="sdpa", dense=dense[:, None])
    from dflash.train.model.masks import TILE, training_block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod = make_mask_mod(anchor_positions, context_len, block_size, window=window, causal=causal)
    if window is None and not causal and TILE % block_size == 0:  # the same BlockMask, from tile counts
        return AttentionMask(backend="flex", block_mask=training_block_mask(
            anchor_positions, context_len, block_size, mask_mod))
    batch, num_anchors = anchor_positions.shape
    q_len = num_anchors * block_size
    block_mask = create_block_mask(
        mask_mod,
        batch,
        None,
        q_len,
        context_len + q_len,
        device=anchor_positions.device,
    )
    return AttentionMask(backend="flex", block_mask=block_mask)


def build_layer_masks(
    anchor_positions: torch.Tensor, context_len: int, block_size: int,
    layer_attention: Sequence[tuple[int | None, bool]], backend: str = "auto",
) -> list[AttentionMask]:
    """One training mask per draft layer from its (window, causal); equal kinds share one mask."""
    built: dict[tuple[int | None, bool], AttentionMask] = {}
    for kind in layer_attention:
        if kind not in built:
            built[kind] = build_attention_mask(anchor_positions, context_len, block_size, backend,
                                               window=kind[0], causal=kind[1])
    return [built[kind] for kind in layer_attention]


def inference_mask(
    context_positions: torch.Tensor | None, context_valid: torch.Tensor | None, block_positions: torch.Tensor,
    *, window: int | None, causal: bool,
) -> AttentionMask | None:
    """The mask of one drafted block [B, 1, Q, L + Q] over `[context ; block]` (None: no mask).

    `context_positions`/`context_valid` [B, L] describe the cached context columns (holes are
    invalid); `block_positions` [B, Q] the block's. All context lies before the anchor.
    """
    batch, q_len = block_positions.shape
    sees = None
    if context_valid is not None and not bool(context_valid.all()):
        sees = context_valid[:, None, :].expand(-1, q_len, -1)
    if window is not None and context_positions is not None:
        near = block_positions[:, :, None] - context_positions[:, None, :] < window
        sees = near if sees is None else sees & near
    slots = torch.arange(q_len, device=block_positions.device)
    block = torch.ones(q_len, q_len, dtype=torch.bool, device=block_positions.device)
    if causal:
        block = block & (slots[None, :] <= slots[:, None])
    if window is not None:
        block = block & (slots[:, None] - slots[None, :] < window)
    if sees is None and bool(block.all()):
        return None
    if sees is None:
        length = 0 if context_positions is None else context_positions.shape[1]
        sees = torch.ones(batch, q_len, length, dtype=torch.bool, device=block_positions.device)
    dense = torch.cat([sees, block[None].expand(batch, -1, -1)], dim=2)
    return AttentionMask(backend="sdpa", dense=dense[:, None])


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
    if torch.compiler.is_compiling():  # inside a compiled drafter: its graph holds the kernel
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
