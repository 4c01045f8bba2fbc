"""The target's top-1 for the held-out share only (dflash-extract --top1-share): the split's
score in the cache contract, which samples carry a top-1, and what the stages make of the rest."""

from __future__ import annotations

import numpy as np
from dflash.cache_tools.sample_scores import heldout_scores, subset_scores, top1_selected

MASK64 = (1 << 64) - 1


def splitmix64_unit(x: int) -> float:
    """splitmix64 in Python integers, mapped to [0, 1): the reference of the split's score."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def test_the_split_score_is_splitmix64_of_the_sample_id_so_existing_splits_stay_put():
    ids = np.array([0, 1, 2, 7, 1000, 123_456_789, 2**40 + 5, -3], dtype=np.int64)
    expected = [splitmix64_unit(int(i) & MASK64) for i in ids]
    assert heldout_scores(ids).tolist() == expected
    assert subset_scores(ids).tolist() == [splitmix64_unit((int(i) & MASK64) ^ 0x5DEECE66D2545F49) for i in ids]


def test_top1_share_selects_the_samples_the_split_holds_out_first():
    ids = np.arange(20_000, dtype=np.int64)
    scores = heldout_scores(ids)
    assert top1_selected(ids, 1.0).all() and not top1_selected(ids, 0.0).any()
    chosen = top1_selected(ids, 0.05)
    assert abs(chosen.mean() - 0.05) < 0.006
    held_out = scores < 0.02  # the trainer's default --eval-fraction
    assert chosen[held_out].all()  # every held-out sample of a smaller fraction has its top-1
    # per-id shares (several caches read together)
    shares = np.where(ids % 2 == 0, 1.0, 0.0)
    assert np.array_equal(top1_selected(ids, shares), ids % 2 == 0)
