"""The host quantizers (fp8, nf4) take a part's rows a block at a time, so their memory follows the
block, not the part: the stored rows and scales are those of one call over every row."""

from __future__ import annotations

import numpy as np
import pytest
from dflash.cache_tools import codecs
from dflash.cache_tools.codecs import HiddenCodec


@pytest.mark.parametrize("name", ["fp8", "nf4"])
def test_a_part_quantized_block_by_block_is_the_part_quantized_at_once(name, monkeypatch):
    codec = HiddenCodec(name=name)
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((53, 2 * 64)) * rng.lognormal(size=(1, 128))).astype(np.float32)
    whole = codec._encode_rows(values, 2)  # one call over every row
    rows = type(codec)._encode_rows
    blocks = []

    def counted(self, v, k):
        blocks.append(len(v))
        return rows(self, v, k)

    monkeypatch.setattr(type(codec), "_encode_rows", counted)
    monkeypatch.setattr(codecs, "ENCODE_BLOCK_BYTES", 4 * 128 * 8)  # 8 rows of 128 float32 values
    blocked = codec.encode(values, 2)
    assert blocks == [8] * 6 + [5]
    np.testing.assert_array_equal(blocked[0], whole[0])
    if whole[1] is None:
        assert blocked[1] is None
    else:
        np.testing.assert_array_equal(blocked[1], whole[1])
