"""Scores of global sample ids: a pseudo-random value in [0, 1) per id, a function of the id alone.

Both stages read them, so they belong to the cache contract: the trainer's held-out split holds
out a sample when its `heldout_scores` value is below --eval-fraction (train/heldout.py), and
`dflash-extract --top1-share F` stores the target's top-1 for the samples whose same score is
below F (`top1_selected`). One score, so that with F >= the held-out fraction every held-out
sample has its top-1, and the samples of lowest score (those an evaluation cap keeps) first.
numpy only: no torch.
"""

from __future__ import annotations

import numpy as np


def heldout_scores(sample_ids: np.ndarray) -> np.ndarray:
    """A pseudo-random value in [0, 1) per sample id (the split and the evaluation cap use it)."""
    return _unit_hash(np.asarray(sample_ids).astype(np.int64).view(np.uint64))


def subset_scores(sample_ids: np.ndarray) -> np.ndarray:
    """Another pseudo-random value in [0, 1) per sample id, independent of heldout_scores (the
    --max-train-samples cap uses it, so the training subset is not drawn from the split's edge)."""
    return _unit_hash(np.asarray(sample_ids).astype(np.int64).view(np.uint64) ^ np.uint64(0x5DEECE66D2545F49))


def top1_selected(sample_ids: np.ndarray, share: float | np.ndarray) -> np.ndarray:
    """bool per sample id: whether a cache of top-1 share `share` (one value, or one per id)
    stores the target's top-1 for it. Share 1 selects every sample, 0 none."""
    return heldout_scores(sample_ids) < np.asarray(share, dtype=np.float64)


def _unit_hash(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each value, mapped to [0, 1)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
