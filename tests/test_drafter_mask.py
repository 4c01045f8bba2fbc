"""The training attention mask: exact pattern, both kernels, and no leakage of the anchor's state."""

from __future__ import annotations

import pytest
import torch
from dflash.train.loss.objective import build_blocks, sample_anchors
from dflash.train.model.attention import build_dense_mask, build_layer_masks, make_mask_mod
from test_drafter_support import HIDDEN, tiny_drafter

BLOCK = 4


def loop_reference_mask(anchors: list[list[int]], context_len: int, block: int, *,
                        window: int | None = None, causal: bool = False) -> list:
    """The rule written out by hand: [seq][query][key] -> bool.

    A query at position q = p + slot sees context j < p, and its own block's slots (only slots
    <= its own when causal); with a window only keys at positions j > q - window.
    """
    width = max(len(a) for a in anchors)
    out = []
    for seq_anchors in anchors:
        rows = []
        for a in range(width):
            real = a < len(seq_anchors)
            p = seq_anchors[a] if real else 0
            for slot in range(block):
                q = p + slot
                row = []
                for key in range(context_len + width * block):
                    if key < context_len:
                        allowed = real and key < p and (window is None or q - key < window)
                    else:
                        key_block, key_slot = divmod(key - context_len, block)
                        allowed = key_block == a
                        if causal:
                            allowed = allowed and key_slot <= slot
                        if window is not None:
                            allowed = allowed and q - (p + key_slot) < window
                    row.append(allowed)
                rows.append(row)
        out.append(rows)
    return out


def _two_sequence_anchors(seq_len: int = 12):
    lengths = torch.tensor([seq_len, 7])
    loss_mask = torch.zeros(2, seq_len)
    loss_mask[0, 2:seq_len] = 1
    loss_mask[1, 1:7] = 1
    g = torch.Generator().manual_seed(3)
    anchors, valid = sample_anchors(loss_mask, lengths, max_anchors=4, generator=g)
    return anchors, [anchors[b][valid[b]].tolist() for b in range(2)]


def test_dense_mask_matches_a_loop_reference_for_two_sequences():
    seq_len = 12
    anchors, listed = _two_sequence_anchors(seq_len)
    assert len(listed[0]) == 4 and 1 <= len(listed[1]) <= 4
    assert all(2 <= p <= 10 for p in listed[0]) and all(1 <= p <= 5 for p in listed[1])

    dense = build_dense_mask(anchors, seq_len, BLOCK)
    reference = torch.tensor(loop_reference_mask(listed, seq_len, BLOCK))
    assert dense.shape == reference.shape == (2, 4 * BLOCK, seq_len + 4 * BLOCK)
    assert torch.equal(dense, reference)


@pytest.mark.parametrize("window", [None, 1, 3, 6])
@pytest.mark.parametrize("causal", [False, True])
def test_windowed_and_causal_masks_match_the_loop_reference_element_by_element(window, causal):
    seq_len = 12
    anchors, listed = _two_sequence_anchors(seq_len)
    dense = build_dense_mask(anchors, seq_len, BLOCK, window=window, causal=causal)
    reference = torch.tensor(loop_reference_mask(listed, seq_len, BLOCK, window=window, causal=causal))
    assert torch.equal(dense, reference)
    if window is not None:  # the window removes context the full mask keeps
        assert dense.sum() < build_dense_mask(anchors, seq_len, BLOCK, causal=causal).sum()
    # Flex's mask_mod evaluates the same rule at every (query, key).
    mod = make_mask_mod(anchors, seq_len, BLOCK, window=window, causal=causal)
    b, q, k = torch.meshgrid(torch.arange(2), torch.arange(dense.shape[1]), torch.arange(dense.shape[2]),
                             indexing="ij")
    assert torch.equal(mod(b, None, q, k), dense)


def test_window_keeps_exactly_the_last_positions_before_a_query():
    anchors = torch.tensor([[6]])
    dense = build_dense_mask(anchors, 10, 4, window=3, causal=True)
    # Slot 0 (position 6) sees positions 4, 5 and itself; slot 2 (position 8) sees slots 0..2 only.
    assert dense[0, 0, :10].nonzero().flatten().tolist() == [4, 5]
    assert dense[0, 0, 10:].tolist() == [True, False, False, False]
    assert dense[0, 2, :10].sum() == 0 and dense[0, 2, 10:].tolist() == [True, True, True, False]


def test_hand_written_anchors_give_the_expected_rows():
    anchors = torch.tensor([[3, 6], [0, 0]])  # second sequence: one real anchor at 0, one pad
    dense = build_dense_mask(anchors, 8, 2)
    # Block 1 of sequence 0 (queries 2, 3): context 0..5, keys of its own block (8+2, 8+3).
    expected = torch.zeros(12, dtype=torch.bool)
    expected[:6] = True
    expected[10:12] = True
    assert torch.equal(dense[0, 2], expected) and torch.equal(dense[0, 3], expected)
    # An anchor at 0 sees no context at all, only its block.
    assert dense[1, 0, :8].sum() == 0 and dense[1, 0, 8:10].all() and not dense[1, 0, 10:].any()


def _run(drafter, hidden, input_ids, anchors, backend):
    block_ids, positions = build_blocks(input_ids, anchors, drafter.config.mask_token_id, BLOCK)
    kinds = [drafter.config.layer_attention(i) for i in range(drafter.config.num_hidden_layers)]
    mask = build_layer_masks(anchors, hidden.shape[1], BLOCK, kinds, backend)
    with torch.no_grad():
        return drafter(hidden, block_ids, positions, mask)


@pytest.mark.parametrize("layers", [{}, {"layer_types": "sliding,full", "sliding_window": 3}])
def test_flex_and_sdpa_paths_give_the_same_block_states(layers):
    drafter = tiny_drafter(**layers)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, 2 * HIDDEN, generator=g)
    input_ids = torch.randint(0, 100, (2, 12), generator=g)
    anchors = torch.tensor([[1, 4, 9], [2, 5, 0]])
    sdpa = _run(drafter, hidden, input_ids, anchors, "sdpa")
    flex = _run(drafter, hidden, input_ids, anchors, "flex")
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
    # The comparison has teeth: another mask changes the result.
    shifted = _run(drafter, hidden, input_ids, anchors + 1, "flex")
    assert (shifted - sdpa).abs().max() > 1e-2


def test_block_logits_ignore_the_anchor_state_and_later_context_but_use_earlier_context():
    drafter = tiny_drafter()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 14, 2 * HIDDEN, generator=g)
    input_ids = torch.randint(0, 100, (2, 14), generator=g)
    anchors = torch.tensor([[2, 6, 10], [3, 7, 0]])
    p, a = 6, 1  # the block under test: sequence 0, anchor at 6
    block = slice(a * BLOCK + 1, (a + 1) * BLOCK)  # predicting slots 1..3 of that block

    def logits(h):
        return drafter.logits(_run(drafter, h, input_ids, anchors, "sdpa"))

    base = logits(hidden)

    for position in (p, p + 1, 13):  # the anchor's own state and later ones
        changed = hidden.clone()
        changed[0, position] += 5 * torch.randn(2 * HIDDEN, generator=g)
        out = logits(changed)
        torch.testing.assert_close(out[0, block], base[0, block], rtol=0, atol=1e-6)
        # The other sequence never sees this one.
        torch.testing.assert_close(out[1], base[1], rtol=0, atol=1e-6)

    for position in (0, p - 1):  # earlier context is used
        changed = hidden.clone()
        changed[0, position] += 5 * torch.randn(2 * HIDDEN, generator=g)
        out = logits(changed)
        assert (out[0, block] - base[0, block]).abs().max() > 1e-3
