"""The flex-attention BlockMask of the training pattern, built from the anchors at block level.

`torch.nn.attention.flex_attention.create_block_mask` evaluates the mask_mod on every
(query, key) pair of the batch, `B x Q x KV` entries (64 samples of 256 tokens with ~160
anchors of 16: ~460M), then sums them per 128 x 128 tile: a dense pass over the GPU and
tens of small launches from the host on every step. For a layer that is neither sliding nor
causal, every query of one anchor's block sees the same keys (the context before its anchor,
then its own block), so the number of visible keys of each (anchor, key tile) pair has a
closed form; summed over the anchors of each query tile it gives the tile counts that
`create_block_mask` computes, from `B x A x KV/128` integers. Full tiles (all 128 x 128
visible) and partial tiles (some) follow as there, and the result is the same BlockMask:
the same tiles, in the same order, with the same mask_mod for the partial ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

TILE = 128
"""Flex attention's default sparse block (query and key tile) size."""


def anchor_tile_counts(anchor_positions: torch.Tensor, context_len: int, block_size: int,
                       tile: int = TILE) -> torch.Tensor:
    """[B, Q/tile (rounded up), KV/tile (rounded up)] long: visible (query, key) pairs per tile of
    the training mask (`attention.build_dense_mask` without window or causality)."""
    batch, num_anchors = anchor_positions.shape
    if tile % block_size:
        raise ValueError(f"the attention tile ({tile}) must be a multiple of block_size ({block_size}).")
    device = anchor_positions.device
    q_len = num_anchors * block_size
    kv_len = context_len + q_len
    kv_tiles = -(-kv_len // tile)
    per_tile = tile // block_size  # anchors per query tile
    q_tiles = -(-num_anchors // per_tile)
    lo = torch.arange(kv_tiles, device=device) * tile  # first key of each tile
    hi = (lo + tile).clamp(max=kv_len)
    # Context keys j < min(anchor, context_len) that fall in the tile; 16 queries each see them.
    seen = anchor_positions.clamp(max=context_len)[:, :, None]  # [B, A, 1]
    context = (torch.minimum(hi, seen) - lo).clamp(min=0)  # [B, A, KV tiles]
    # Its own block: keys context_len + a*block_size ... + block_size, seen by its block_size queries.
    start = context_len + torch.arange(num_anchors, device=device)[:, None] * block_size  # [A, 1]
    own = (torch.minimum(hi, start + block_size) - torch.maximum(lo, start)).clamp(min=0)  # [A, KV tiles]
    counts = (context + own) * block_size
    pad = q_tiles * per_tile - num_anchors  # the last query tile's rows past Q see nothing
    counts = torch.nn.functional.pad(counts, (0, 0, 0, pad))
    return counts.view(batch, q_tiles, per_tile, kv_tiles).sum(2)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 1, Qt, KVt] 0/1 -> (tiles per query row, their key-tile indices first, ascending),
    int32, in the order `create_block_mask` stores them."""
    dense = tiles.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(-1).to(torch.int32).contiguous(), indices.to(torch.int32).contiguous()


def training_block_mask(anchor_positions: torch.Tensor, context_len: int, block_size: int,
                        mask_mod: Callable[..., Any]) -> Any:
    """The BlockMask `create_block_mask(mask_mod, B, None, Q, KV)` builds for a full
    (bidirectional, not sliding) training layer, from tile counts instead of every entry.

    `mask_mod` must be that layer's rule (`attention.make_mask_mod`): the kernel applies it
    inside partial tiles.
    """
    from torch.nn.attention.flex_attention import BlockMask

    counts = anchor_tile_counts(anchor_positions, context_len, block_size)[:, None]  # [B, 1, Qt, KVt]
    full = counts == TILE * TILE
    partial = (counts > 0) & ~full
    kv_num, kv_indices = _ordered(partial)
    full_num, full_indices = _ordered(full)
    q_len = anchor_positions.shape[1] * block_size
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=(TILE, TILE),
                                    mask_mod=mask_mod, seq_lengths=(q_len, context_len + q_len))
