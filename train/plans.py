"""Batch plans: which samples form each batch of an epoch (a pure function of the seed, the
epoch, the sample lengths and the batching settings), and a rank's share of them from a
position on, across epochs (what one DataLoader reads, so its workers need no restart per epoch).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from .config import TrainConfigError

if TYPE_CHECKING:
    from .loader import LoaderConfig, TrainLoader


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


def plan_epoch(indices: np.ndarray, lengths: np.ndarray, config: LoaderConfig, epoch: int,
               groups: np.ndarray | None = None) -> list[np.ndarray]:
    """The global batch list of one epoch: a pure function of its arguments. Under
    --shuffle-parts (`groups`: each sample's group of parts) the groups come one after the
    other in the extraction's order, each planned on its own with its own stream."""
    if config.shuffle_parts and groups is not None:
        of = groups[indices]
        return [b for g in np.unique(of)
                for b in _plan_span(indices[of == g], lengths, config, [config.seed, epoch, 0x5EED, int(g)])]
    return _plan_span(indices, lengths, config, [config.seed, epoch, 0x5EED])


def _plan_span(indices: np.ndarray, lengths: np.ndarray, config: LoaderConfig, seed: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shuffled = indices[rng.permutation(len(indices))]
    batches: list[np.ndarray] = []
    for w in range(0, len(shuffled), config.shuffle_window):
        window = shuffled[w:w + config.shuffle_window]
        window = window[np.argsort(-lengths[window], kind="stable")]
        batches += pack_batches(window, lengths, config.token_budget, config.max_batch_size)
    return [batches[i] for i in rng.permutation(len(batches))]


def plan_eval(indices: np.ndarray, lengths: np.ndarray, config: LoaderConfig) -> list[np.ndarray]:
    """Held-out batches: sorted by length for the least padding, no shuffle."""
    order = indices[np.argsort(-lengths[indices], kind="stable")]
    return pack_batches(order, lengths, config.token_budget, config.max_batch_size)


def check_budget(lengths: np.ndarray, indices: np.ndarray, config: LoaderConfig) -> None:
    too_long = indices[lengths[indices] > config.token_budget]
    if len(too_long):
        raise TrainConfigError(
            f"{len(too_long)} sample(s) are longer than --token-budget {config.token_budget} "
            f"(the longest has {int(lengths[too_long].max())} tokens after truncation to "
            f"--max-seq-len {config.max_seq_len}). Raise --token-budget to at least the longest "
            "sample, or lower --max-seq-len to truncate them."
        )


class RankBatches:
    """A rank's batches from the loader's position to the end of its planned epochs, as one
    sequence: item k is global batch `index[k]` of epoch `epochs[k]`. Epoch plans are pure
    functions, so a worker makes the ones it reads from itself."""

    def __init__(self, loader: TrainLoader):
        last = max(loader.epoch, len(loader.steps_per_epoch) - 1)
        spans = [np.arange((loader.consumed if e == loader.epoch else 0) + loader.rank, loader.usable(e),
                           loader.world_size) for e in range(loader.epoch, last + 1)]
        self.epochs = np.concatenate([np.full(len(s), loader.epoch + i) for i, s in enumerate(spans)])
        self.index, self.last_epoch = np.concatenate(spans), last
        self._plan = functools.partial(plan_epoch, loader.indices, loader.caches.lengths, loader.config,
                                       groups=loader.groups)
        self._cached = (loader.epoch, loader.epoch_batches(loader.epoch))

    def __len__(self) -> int:
        return len(self.index)

    def position(self, k: int) -> tuple[int, int]:
        return int(self.epochs[k]), int(self.index[k])

    def __getitem__(self, k: int) -> np.ndarray:
        epoch, index = self.position(k)
        if self._cached[0] != epoch:
            self._cached = (epoch, self._plan(epoch))
        return self._cached[1][index]
