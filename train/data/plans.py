"""Batch plans: which samples form each batch of an epoch (a pure function of the seed, the
epoch, the sample lengths and the batching settings); a rank's share of them from a position
on is `loader.RankBatches`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from dflash.runtime.findings import Finding
from dflash.train.config import TrainConfigError


class PlanSettings(Protocol):
    """What a plan reads of the run's data section (`config.DataConfig`)."""

    token_budget: int
    max_batch_size: int
    max_seq_len: int
    shuffle_window: int
    shuffle_parts: int


def pack_batches(order: np.ndarray, lengths: np.ndarray, token_budget: int, max_batch_size: int) -> list[np.ndarray]:
    """Greedy packing of `order` (already sorted by descending length) under the budget."""
    batches: list[np.ndarray] = []
    start = 0
    n = len(order)
    while start < n:
        longest = int(lengths[order[start]])
        size = max(1, min(max_batch_size, token_budget // max(longest, 1), n - start))
        batches.append(order[start:start + size])
        start += size
    return batches


def plan_epoch(indices: np.ndarray, lengths: np.ndarray, config: PlanSettings, epoch: int,
               groups: np.ndarray | None = None, *, seed: int) -> list[np.ndarray]:
    """The global batch list of one epoch: a pure function of its arguments. Under
    --shuffle-parts (`groups`: each sample's group of parts) the groups come one after the
    other in the extraction's order, each planned on its own with its own stream."""
    if config.shuffle_parts and groups is not None:
        of = groups[indices]
        return [b for g in np.unique(of)
                for b in _plan_span(indices[of == g], lengths, config, [seed, epoch, 0x5EED, int(g)])]
    return _plan_span(indices, lengths, config, [seed, epoch, 0x5EED])


def _plan_span(indices: np.ndarray, lengths: np.ndarray, config: PlanSettings, seed: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shuffled = indices[rng.permutation(len(indices))]
    batches: list[np.ndarray] = []
    for w in range(0, len(shuffled), config.shuffle_window):
        window = shuffled[w:w + config.shuffle_window]
        window = window[np.argsort(-lengths[window], kind="stable")]
        batches += pack_batches(window, lengths, config.token_budget, config.max_batch_size)
    return [batches[i] for i in rng.permutation(len(batches))]


def plan_eval(indices: np.ndarray, lengths: np.ndarray, config: PlanSettings) -> list[np.ndarray]:
    """Held-out batches: sorted by length for the least padding, no shuffle."""
    order = indices[np.argsort(-lengths[indices], kind="stable")]
    return pack_batches(order, lengths, config.token_budget, config.max_batch_size)


def check_budget(lengths: np.ndarray, indices: np.ndarray, config: PlanSettings) -> None:
    too_long = indices[lengths[indices] > config.token_budget]
    if len(too_long):
        raise TrainConfigError(Finding("train.samples-over-token-budget", samples=len(too_long),
                                       token_budget=config.token_budget, longest=int(lengths[too_long].max()),
                                       max_seq_len=config.max_seq_len))


