"""The incremental (engine-style) drafting path equals the training path."""

from __future__ import annotations

import pytest
import torch
from dflash.train.loss.objective import build_blocks
from dflash.train.model.attention import build_layer_masks
from reference_decoding import ContextCache
from test_drafter_support import HIDDEN, tiny_drafter


def training_block_logits(drafter, hidden, input_ids, anchors) -> torch.Tensor:
    block = drafter.config.block_size
    block_ids, positions = build_blocks(input_ids, anchors, drafter.config.mask_token_id, block)
    with torch.no_grad():
        kinds = [drafter.config.layer_attention(i) for i in range(drafter.config.num_hidden_layers)]
        masks = build_layer_masks(anchors, hidden.shape[1], block, kinds, "sdpa")
        states = drafter(hidden, block_ids, positions, masks)
        return drafter.logits(states.view(*anchors.shape, block, -1)[:, :, 1:])


DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("rope,layers", [
    (DEFAULT_ROPE, {}),
    (LLAMA3_ROPE, {}),
    # Sliding-window layers (causal by convention) beside a full one; then both forced bidirectional.
    (DEFAULT_ROPE, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}),
    (DEFAULT_ROPE, {"layer_types": "sliding", "sliding_window": 3, "causal": False}),
])
def test_incremental_context_drafts_the_same_block_logits_as_training(rope, layers):
    drafter = tiny_drafter(rope_parameters=rope, **layers)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 20, 2 * HIDDEN, generator=g)
    input_ids = torch.randint(0, 100, (2, 20), generator=g)
    anchors = torch.tensor([[4, 9, 15], [3, 11, 17]])
    reference = training_block_logits(drafter, hidden, input_ids, anchors)

    for b in range(2):
        cache = ContextCache(drafter)
        done = 0
        for a, p in enumerate(anchors[b].tolist()):
            # Context arrives in uneven chunks, as accepted tokens do in an engine.
            cache.append_context(hidden[b : b + 1, done:p])
            done = p
            assert cache.length == p
            logits = cache.draft_block(input_ids[b : b + 1, p])
            torch.testing.assert_close(logits[0], reference[b, a], rtol=1e-4, atol=1e-4)


def test_cropping_rejected_context_restores_the_draft():
    drafter = tiny_drafter()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 12, 2 * HIDDEN, generator=g)
    anchor = torch.tensor([7])
    cache = ContextCache(drafter)
    cache.append_context(hidden[:, :6])
    expected = cache.draft_block(anchor)
    cache.append_context(hidden[:, 6:11])  # tokens the target then rejects
    assert not torch.allclose(cache.draft_block(anchor), expected)
    cache.crop(6)
    torch.testing.assert_close(cache.draft_block(anchor), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="append_context"):
        ContextCache(drafter).draft_block(anchor)


def test_a_sliding_layer_ignores_context_outside_its_window():
    drafter = tiny_drafter(layer_types="sliding", sliding_window=4)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 12, 2 * HIDDEN, generator=g)
    anchor = torch.tensor([5])

    def draft(h):
        cache = ContextCache(drafter)
        cache.append_context(h)
        return cache.draft_block(anchor)

    base = draft(hidden)
    far, near = hidden.clone(), hidden.clone()
    far[:, :8] += 5 * torch.randn(8, 2 * HIDDEN, generator=g)  # outside every block token's window
    near[:, 11] += 5 * torch.randn(2 * HIDDEN, generator=g)  # the anchor's previous token
    # The block sits at positions 12..15; with window 4 no block token sees context before 9.
    torch.testing.assert_close(draft(far), base, rtol=0, atol=1e-6)
    assert (draft(near) - base).abs().max() > 1e-3


def test_batched_draft_context_with_holes_keeps_each_row_window_by_position():
    # The window counts positions, not cache columns: a row with padding and holes sees the
    # same context as the same row drafted alone, whose columns are its positions.
    from dflash.eval.speculative import DraftContext

    drafter = tiny_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    hidden = torch.randn(3, 10, 2 * HIDDEN, generator=torch.Generator().manual_seed(1))
    holes = {0: [0, 1, 6], 1: [4, 5], 2: []}  # left padding and rejected slots
    valid = torch.tensor([[c not in holes[r] for c in range(10)] for r in range(3)])
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    context = DraftContext(drafter)
    for lo, hi in ((0, 3), (3, 7), (7, 10)):  # context arrives cycle by cycle
        context.append(hidden[:, lo:hi], positions[:, lo:hi], valid[:, lo:hi])
    anchors = torch.tensor([5, 9, 2])
    drafted = context.draft(anchors, valid.sum(1), 4)
    for row in range(3):
        alone = ContextCache(drafter)
        alone.append_context(hidden[row : row + 1, valid[row]])
        expected = alone.draft_block(anchors[row : row + 1])[0]
        torch.testing.assert_close(drafted[row], expected, rtol=1e-5, atol=1e-5)


def test_greedy_decoding_with_a_sliding_window_drafter_is_lossless_in_batches():
    from dflash.eval.speculative import DecodeConfig, speculative_generate, target_generate
    from test_eval_support import VOCAB, tiny_target
    from test_eval_support import tiny_drafter as eval_drafter

    target = tiny_target(steps=0)
    drafter = eval_drafter(target)
    drafter.config.layer_types, drafter.config.sliding_window = ["sliding_attention"], 4
    assert drafter.config.layer_attention(0) == (4, True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 8)]
    config = DecodeConfig(max_new_tokens=16)
    expected = [target_generate(target, [p], config)[0].tokens for p in prompts]
    assert [gen.tokens for gen in speculative_generate(target, drafter, prompts, config)] == expected
