"""bench_train's FLOP model counts the attention pairs the training mask lets through: for long
samples (the context before each anchor, anchors drawn over the completion) and for sliding or
causal layers (train/model/attention.py's mask, counted entry by entry)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_train import visible_keys  # noqa: E402


@pytest.mark.parametrize(("window", "causal"), [(None, False), (None, True), (24, True), (24, False), (3, True)])
def test_visible_keys_is_the_mean_of_the_training_masks_rows(window, causal):
    from dflash.train.model.attention import build_dense_mask

    context, prompt, block = 300, 0.1, 4
    first = int(context * prompt)
    anchors = torch.arange(first, context - 1)[None]  # every position the trainer draws anchors from
    mask = build_dense_mask(anchors, context, block, window=window, causal=causal)
    assert visible_keys(context, prompt, block, window, causal) == pytest.approx(mask.sum(-1).float().mean().item())


def test_a_long_sample_sees_half_its_completion_and_a_window_caps_it():
    assert visible_keys(32768, 0.1, 16) == pytest.approx(0.55 * 32768, rel=1e-3)
    assert visible_keys(32768, 0.1, 16, 2048, True) == pytest.approx(2048)
