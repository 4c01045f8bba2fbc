"""The held-out split: which samples a run never trains on, decided by their split keys.

A sample is held out when a hash of its split key falls below the held-out fraction. The key
is a hash of its prompt (stored per sample in the commit records of a cache extracted now), so
the answers of one prompt (dflash-generate --samples-per-prompt, a dataset that repeats
prompts) all land on the same side and the estimate never reads an answer to a prompt the
drafter trained on; a cache extracted before keys were stored uses its sample ids as keys and
splits as it always did (CacheSet.split_keys). A sample's side depends on its key only, so it
does not move when a cache grows, is extracted again as a superset, merged, or listed in
another order; the evaluation cap keeps the held-out samples of lowest hash, a set that only
loses members as samples are added. The hash is the cache contract's
(cache_tools/sample_scores.py): extraction stores the target's top-1 for the samples of lowest
hash, the held-out ones first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from dflash.cache_tools.sample_scores import heldout_scores, top1_selected

if TYPE_CHECKING:
    from dflash.cache_tools.sources import SampleSource


def eval_split(caches: SampleSource, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) sample indices. A sample is held out when the hash of its split key
    (its prompt's hash, or its sample id in a cache of before) falls below `fraction`: its side
    depends on that key only, so the answers of one prompt share a side, and it stays put when
    a cache grows, is re-extracted as a superset, merged, or listed in another order."""
    index = np.arange(len(caches), dtype=np.int64)
    if fraction <= 0:
        return index, index[:0]
    held_out = heldout_scores(caches.split_keys()) < fraction
    return index[~held_out], index[held_out]


def cap_by_score(indices: np.ndarray, scores: np.ndarray, max_samples: int) -> np.ndarray:
    """The `max_samples` indices of lowest score (all of them for 0), in index order; the
    chosen set only loses members as samples are added, never gains old ones."""
    if not max_samples or len(indices) <= max_samples:
        return indices
    keep = np.argsort(scores[indices], kind="stable")[:max_samples]
    return np.sort(indices[keep])


def without_top1(caches: SampleSource, indices: np.ndarray) -> int:
    """How many of the samples `indices` have no target top-1 in their cache (a cache without
    top-1 or top-k, or a sample outside its --top1-share in a cache without top-k): their held-out replay checks drafts against
    their own tokens."""
    indices = np.asarray(indices, dtype=np.int64)
    if not len(indices):
        return 0
    which = np.searchsorted(caches.starts, indices, side="right") - 1
    # a cache of top-k log-probs holds every sample's top-1 (its first id)
    shares = np.array([1.0 if r.manifest.topk else r.top1_share for r in caches.readers], dtype=np.float64)[which]
    return int((~top1_selected(caches.split_keys()[indices], shares)).sum())
