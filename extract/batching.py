"""Forward batches of one sort window: length-sorted, right-padded, under a padded-token budget.

Padding is on the right and no attention mask is passed: under causal attention a real token
never attends to a later (padded) position, so its hidden states do not depend on the padding
(and the model takes its plain causal path, with no host synchronisation for mask checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .data import Sample


@dataclass
class Batch:
    """One forward batch: which samples of the window, and the tensors to run."""

    members: list[int]  # indices into the window's sample list, in batch-row order
    input_ids: torch.Tensor  # int64 [B, L], right-padded with 0
    gather_index: torch.Tensor  # int64 [T_real]: flat positions (b * L + t) of real tokens
    lengths: list[int]
    split_keys: list[int] = field(default_factory=list)  # the split key of each row's sample

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def row_tokens(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(gather, dest) of the real tokens of batch rows `rows` (ascending): their flat
        positions (i * L + t) in a [len(rows), L] tensor of just those rows, and their places
        among the batch's packed real tokens (the order of `gather_index`)."""
        width = int(self.input_ids.shape[1])
        starts = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        gather = [np.arange(n) + i * width for i, n in enumerate(self.lengths[r] for r in rows)]
        dest = [np.arange(starts[r], starts[r + 1]) for r in rows]
        empty = np.zeros(0, np.int64)
        return (np.concatenate(gather).astype(np.int64) if gather else empty,
                np.concatenate(dest).astype(np.int64) if dest else empty)


def group_by_budget(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices grouped so that (batch size x longest length) <= token_budget.

    Longest first, so each batch's first member sets its padded length; a sample longer
    than the budget forms a batch of its own. Deterministic (stable sort).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def make_batch(samples: list[Sample], members: list[int]) -> Batch:
    lengths = [samples[i].length for i in members]
    width = max(lengths)
    ids = np.zeros((len(members), width), dtype=np.int64)
    gather = np.empty(sum(lengths), dtype=np.int64)
    pos = 0
    for row, i in enumerate(members):
        n = lengths[row]
        ids[row, :n] = samples[i].input_ids
        gather[pos:pos + n] = np.arange(row * width, row * width + n)
        pos += n
    return Batch(
        members=list(members), input_ids=torch.from_numpy(ids), gather_index=torch.from_numpy(gather),
        lengths=lengths, split_keys=[samples[i].split_key for i in members],
    )


def make_batches(samples: list[Sample], token_budget: int) -> list[Batch]:
    return [make_batch(samples, g) for g in group_by_budget([s.length for s in samples], token_budget)]
