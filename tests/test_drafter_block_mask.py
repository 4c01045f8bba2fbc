"""The training BlockMask built from tile counts is the one create_block_mask builds entry by entry."""

from __future__ import annotations

import pytest
import torch
from dflash.train.model.attention import build_attention_mask, make_mask_mod
from dflash.train.model.masks import anchor_tile_counts, training_block_mask

flex = pytest.importorskip("torch.nn.attention.flex_attention")

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _anchors(batch: int, context: int, anchors: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    positions = torch.sort(torch.randint(1, context, (batch, anchors), generator=g), dim=1).values
    positions[-1, anchors // 2:] = 0  # a shorter sequence: padding anchors at position 0
    return positions


def _reference(anchors: torch.Tensor, context: int, block_size: int, **kind):
    batch, num = anchors.shape
    return flex.create_block_mask(make_mask_mod(anchors, context, block_size, **kind), batch, None,
                                  num * block_size, context + num * block_size, device="cpu")


def _assert_same(a, b) -> None:
    assert a.seq_lengths == b.seq_lengths and a.BLOCK_SIZE == b.BLOCK_SIZE
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


@pytest.mark.parametrize("batch,context,anchors,block_size", [
    (3, 256, 159, 16),  # the benchmark's shape: a partial last query tile
    (2, 300, 37, 16),   # context not a multiple of the tile
    (2, 64, 5, 8),      # one query tile, keys in two
    (1, 600, 24, 16),   # full context tiles
])
def test_tile_counts_give_the_create_block_mask_result(batch, context, anchors, block_size):
    positions = _anchors(batch, context, anchors, seed=batch * context + anchors)
    ref = _reference(positions, context, block_size)
    _assert_same(ref, training_block_mask(positions, context, block_size, make_mask_mod(positions, context, block_size)))


def test_tile_counts_equal_the_dense_pattern():
    positions = _anchors(2, 200, 23, seed=3)
    from dflash.train.model.attention import build_dense_mask

    mask = build_dense_mask(positions, 200, 16)  # [B, Q, KV]
    q_pad, kv_pad = (-mask.shape[1]) % 128, (-mask.shape[2]) % 128
    mask = torch.nn.functional.pad(mask, (0, kv_pad, 0, q_pad))
    tiles = mask.view(2, mask.shape[1] // 128, 128, mask.shape[2] // 128, 128).sum((2, 4))
    assert torch.equal(anchor_tile_counts(positions, 200, 16), tiles)


def test_sliding_and_causal_layers_keep_create_block_mask():
    positions = _anchors(2, 256, 40, seed=5)
    for kind in ({"window": 64}, {"causal": True}):
        built = build_attention_mask(positions, 256, 16, "flex", **kind).block_mask
        _assert_same(_reference(positions, 256, 16, **kind), built)
    # a block size that does not divide the tile falls back too
    _assert_same(_reference(positions, 256, 10), build_attention_mask(positions, 256, 10, "flex").block_mask)
