"""Where a training batch's anchors come from: the loader draws them where it reads the batch (a
worker, off the training thread) with a generator seeded by the batch's place in the run, and the
loss reads them from the batch (`objective.compute_loss` draws none).

Seeded by place, not by a stream: no generator state to carry over a resume, and the same draws on
any world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from dflash.train.loss.objective import sample_anchors, scored_slots


def add_anchors(batch: dict, max_anchors: int, block_size: int, generator: torch.Generator | None = None) -> dict:
    """Put the batch's anchors and its scored block slots (both worked out on the host, so the
    step never waits for the GPU) into it, drawn with `generator` (CPU; None: torch's global
    one); returns the batch. The DataLoader pins them with the batch."""
    anchors, valid = sample_anchors(batch["loss_mask"], batch["lengths"], max_anchors, generator)
    slots = scored_slots(batch["input_ids"], batch["loss_mask"], batch["lengths"], anchors, valid, block_size)
    batch.update(anchor_positions=anchors, anchor_valid=valid, scored_slots=slots)
    return batch


@dataclass(frozen=True)
class AnchorDraw:
    """The loader's batch completion (`TrainLoader.prepare`): `add_anchors` with the anchor
    generator of global batch `batch_index` of `epoch`, the same draws wherever it runs."""

    seed: int
    max_anchors: int
    block_size: int

    def __call__(self, batch: dict, epoch: int, batch_index: int) -> None:
        generator = torch.Generator().manual_seed(batch_seeds(self.seed, epoch, batch_index)[0])
        add_anchors(batch, self.max_anchors, self.block_size, generator)


def draw_anchors(batch: dict, epoch: int, batch_index: int, *, seed: int, max_anchors: int,
                 block_size: int) -> None:
    """`AnchorDraw(seed, max_anchors, block_size)(batch, epoch, batch_index)`."""
    AnchorDraw(seed, max_anchors, block_size)(batch, epoch, batch_index)


def batch_seeds(seed: int, epoch: int, batch_index: int) -> tuple[int, int]:
    """(anchor seed, noise seed) of one global training batch."""
    # The 0 once told training batches from held-out ones (evaluation now draws no anchors);
    # it stays so that the same run gets the same draws as before.
    entropy = [seed, 0, epoch, batch_index]
    anchor_seed, noise_seed = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint64)
    return int(anchor_seed), int(noise_seed)


def noise_generator(seed: int, epoch: int, batch_index: int, device: torch.device) -> torch.Generator:
    """The hidden-state noise generator (on `device`) of one global training batch."""
    return torch.Generator(device=device).manual_seed(batch_seeds(seed, epoch, batch_index)[1])
