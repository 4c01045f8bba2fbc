"""Part buffers: rows of length-sorted batches land at their samples' places in the part."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from dflash.extract.data import PartPlan, Sample
from dflash.extract.writers import PartBuffer, part_fields


@pytest.mark.parametrize("threads", [0, 3])
def test_batches_in_any_order_fill_the_part_in_sample_order(threads):
    rng = np.random.default_rng(0)
    lengths = [5, 1, 9, 3, 7]
    plan = PartPlan(index=0)
    for i, n in enumerate(lengths):
        plan.add(Sample(sample_id=i, input_ids=np.zeros(n, np.int64), loss_mask=np.ones(n, np.uint8)))
    fields = part_fields(width=6, hidden_size=3, num_layers=2, storage_dtype="uint8",
                         has_scale=True, last_hidden=False, topk=0)
    full = {"hidden": rng.integers(0, 255, (sum(lengths), 6), dtype=np.uint8),
            "hidden_scale": rng.random((sum(lengths), 2), dtype=np.float32)}
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    buf = PartBuffer(plan, fields, shared=False)
    copiers = ThreadPoolExecutor(threads) if threads else None
    for members in ([2, 0], [4, 3, 1]):  # length-sorted batches, not in sample order
        rows = {k: np.concatenate([v[offsets[i]:offsets[i + 1]] for i in members]) for k, v in full.items()}
        buf.put(members, rows, copiers)
        buf.mark_filled(len(members))
    assert buf.complete
    for key, ref in full.items():
        np.testing.assert_array_equal(buf.arrays[key], ref)
