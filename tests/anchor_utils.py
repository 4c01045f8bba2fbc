"""The loss of a hand-made batch, its anchors drawn as the loader draws them (train/data/anchors.py)."""

from __future__ import annotations

from dflash.train.data.anchors import add_anchors
from dflash.train.loss.objective import compute_loss


def loss_of(drafter, batch: dict, config, *, generator=None, noise_generator=None, **kw):
    """`compute_loss` of `batch` (left as it is) with anchors drawn by `generator` (None: torch's
    global one), which then draws the noise too unless `noise_generator` is given."""
    block_size = getattr(drafter, "config", None) and drafter.config.block_size
    anchored = add_anchors(dict(batch), config.max_anchors, block_size, generator)
    return compute_loss(drafter, anchored, config, noise_generator=noise_generator or generator, **kw)
