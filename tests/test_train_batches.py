"""The loader's batches: hidden states decoded in place equal per-sample reads, any codec."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cache_utils import bits, random_sample, tiny_header
from dflash.cache_tools.cache_set import CacheSet
from dflash.cache_tools.writer import CacheWriter
from dflash.train.data.loader import collate, dequantize_batch, read_batch


def write(path, codec, seed):
    writer = CacheWriter(path, tiny_header(codec, hidden_size=32, store_last_hidden=True))
    gen = torch.Generator().manual_seed(seed)
    with writer.part_writer("part-000000") as pw:
        for s, n in enumerate([5, 70, 33, 1]):
            ids, mask, hidden = random_sample(gen, n, 64)
            pw.add_sample(s, ids, mask, hidden, last_hidden=torch.randn(n, 32, generator=gen).bfloat16())
    return path


@pytest.mark.parametrize("max_seq_len", [64, 1000])
def test_batches_decoded_in_place_equal_collated_samples(tmp_path, max_seq_len):
    caches = CacheSet([str(write(tmp_path / "a", "bf16", 0)), str(write(tmp_path / "b", "fp8", 1))],
                      max_seq_len=max_seq_len)
    indices = [1, 6, 0, 3, 5]  # both caches, a truncated sample (70 > 64), a 1-token sample
    got = read_batch(caches, indices)
    want = collate([caches.read(i) for i in indices])
    assert got.keys() == want.keys()
    assert got["hidden"].shape == (5, min(70, max_seq_len), 64)
    for key in ("hidden", "last_hidden"):
        np.testing.assert_array_equal(bits(got[key]), bits(want[key]))  # padding rows are zero in both
    for key in ("input_ids", "loss_mask", "lengths", "sample_ids"):
        assert torch.equal(got[key], want[key])
    assert got["lengths"].tolist() == [min(70, max_seq_len), 33, 5, 1, min(70, max_seq_len)]


def test_fp8_batches_travel_as_bytes_and_dequantize_to_the_same_values(tmp_path):
    caches = CacheSet([str(write(tmp_path / "a", "fp8", 0)), str(write(tmp_path / "b", "fp8", 1))],
                      max_seq_len=64)
    indices = [1, 6, 0, 3]
    got = read_batch(caches, indices)
    assert got["hidden"].dtype == torch.uint8 and got["hidden_scale"].shape == (4, 64, 2)
    assert got["last_hidden"].dtype == torch.uint8 and got["last_hidden_scale"].shape == (4, 64, 1)
    got = dequantize_batch(got)
    assert "hidden_scale" not in got and got["hidden"].dtype == torch.bfloat16
    want = collate([caches.read(i) for i in indices])  # dequantized per sample by the reader
    for key in ("hidden", "last_hidden"):
        np.testing.assert_array_equal(bits(got[key]), bits(want[key]))


def test_nf4_batches_travel_as_stored_rows_and_decode_like_the_reader(tmp_path):
    caches = CacheSet([str(write(tmp_path / "a", "nf4", 0)), str(write(tmp_path / "b", "nf4", 1))],
                      max_seq_len=64)
    indices = [1, 6, 0, 3]
    got = read_batch(caches, indices)
    assert got["hidden"].dtype == torch.uint8 and got["hidden"].shape == (4, 64, 64 // 2 + 64 // 16)
    got = dequantize_batch(got)  # torch, on the training device
    assert got["hidden"].dtype == torch.bfloat16 and got["hidden"].shape == (4, 64, 64)
    want = collate([caches.read(i) for i in indices])  # decoded per sample by the reader (numpy)
    for key in ("hidden", "last_hidden"):
        np.testing.assert_array_equal(bits(got[key]), bits(want[key]))
    mixed = CacheSet([str(write(tmp_path / "c", "bf16", 2)), str(tmp_path / "a")], max_seq_len=64)
    batch = read_batch(mixed, [0, 5])  # codecs differ: decoded to bf16 on the host
    assert batch["hidden"].dtype == torch.bfloat16 and batch["hidden"].shape[-1] == 64
    np.testing.assert_array_equal(bits(batch["hidden"][1, :33]), bits(mixed.read(5)["hidden"][:33]))


def test_training_from_an_nf4_cache_runs_to_the_end(tiny_world, tmp_path):
    from conftest import tiny_train_config
    from dflash.cache_tools.rewrite import recompress_cache
    from dflash.train.run.loop import train

    recompress_cache(tiny_world["cache"], tmp_path / "nf4", codec="nf4", progress=False)
    result = train(tiny_train_config(tmp_path / "nf4", tiny_world["target"], tmp_path / "run", max_steps=3))
    assert result.step == 3


def test_training_from_an_fp8_cache_runs_to_the_end_and_exports(tiny_world, tmp_path):
    from conftest import tiny_train_config
    from dflash.cache_tools.rewrite import recompress_cache
    from dflash.train.run.loop import train

    world = tiny_world
    recompress_cache(world["cache"], tmp_path / "fp8", codec="fp8", progress=False)
    result = train(tiny_train_config(tmp_path / "fp8", world["target"], tmp_path / "run", max_steps=3))
    assert result.step == 3
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
