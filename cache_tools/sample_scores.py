"""Split keys and their scores: a pseudo-random value in [0, 1) per key, a function of the key alone.

A sample's split key is what the held-out split groups by: a cache extracted now stores, per
sample, a 64-bit hash of its prompt (`prompt_split_key`: the input ids before its completion
starts), so that the answers of one prompt share a key, or, for a record that names a "group", a
hash of that group (`group_split_key`), so that every sample of one document shares one; a cache
extracted before has none and
uses the sample id itself as the key (`CacheSet.split_keys`), which keeps its scores, and so its
split, bit for bit. Both stages read the scores, so they belong to the cache contract: the
trainer's held-out split holds out a sample when its `heldout_scores` value is below
--eval-fraction (train/data/heldout.py), and `dflash-extract --top1-share F` stores the target's
top-1 for the samples whose same score is below F (`top1_selected`). One score, so that with
F >= the held-out fraction every held-out sample has its top-1, and the samples of lowest score
(those an evaluation cap keeps) first. numpy only: no torch.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np


def prompt_split_key(input_ids: np.ndarray, loss_mask: np.ndarray) -> int:
    """The split key of a sample (int64): blake2b-8 of its prompt's ids as little-endian int32,
    the prompt being the ids before the first 1 of its loss mask (runtime/records.py's
    completion start, as the cache stores the sample), or all of them without one. Samples
    with equal prompts get equal keys."""
    mask = np.asarray(loss_mask)
    starts = np.flatnonzero(mask)
    start = int(starts[0]) if starts.size else int(mask.shape[0])
    prompt = np.ascontiguousarray(np.asarray(input_ids)[:start], dtype="<i4")
    digest = hashlib.blake2b(prompt.tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def group_split_key(group: str | int) -> int:
    """The split key of a sample whose record names a "group" (runtime/records.py): blake2b-8 of
    the group as JSON, so that every sample of one group, whatever its prompt, gets the same key
    (and no group's key is a prompt's: another domain of the hash)."""
    digest = hashlib.blake2b(json.dumps(group).encode(), digest_size=8, person=b"dflash-group").digest()
    return int.from_bytes(digest, "little", signed=True)


def heldout_scores(split_keys: np.ndarray) -> np.ndarray:
    """A pseudo-random value in [0, 1) per split key (the split and the evaluation cap use it)."""
    return _unit_hash(np.asarray(split_keys).astype(np.int64).view(np.uint64))


def subset_scores(split_keys: np.ndarray) -> np.ndarray:
    """Another pseudo-random value in [0, 1) per split key, independent of heldout_scores (the
    --max-train-samples cap uses it, so the training subset is not drawn from the split's edge)."""
    return _unit_hash(np.asarray(split_keys).astype(np.int64).view(np.uint64) ^ np.uint64(0x5DEECE66D2545F49))


def top1_selected(split_keys: np.ndarray, share: float | np.ndarray) -> np.ndarray:
    """bool per split key: whether a cache of top-1 share `share` (one value, or one per key)
    stores the target's top-1 for its sample. Share 1 selects every sample, 0 none."""
    return heldout_scores(split_keys) < np.asarray(share, dtype=np.float64)


def _unit_hash(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each value, mapped to [0, 1)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
