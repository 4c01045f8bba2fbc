"""Caches written by an earlier version of the writer (tests/fixtures/v1-caches, committed as
generated: tests/fixtures/README.md) still read with the exact values and pass `verify`."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.maintenance import verify_cache
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.writer import CacheWriter
from dflash.train.data.loader import sample_tensors

FIXTURES = Path(__file__).parent / "fixtures" / "v1-caches"
CODECS = ("bf16", "fp8", "raw")


def old_cache(tmp_path: Path, codec: str) -> tuple[Path, dict[str, np.ndarray]]:
    """A copy of the committed cache (readers and verify take its lock file) and its values."""
    dst = tmp_path / codec
    shutil.copytree(FIXTURES / codec, dst)
    with np.load(FIXTURES / f"{codec}.expected.npz") as expected:
        return dst, dict(expected)


def read_all(reader: CacheReader, **kw) -> list[dict]:
    return [sample_tensors(reader.read_sample(i, **kw)) for i in range(len(reader))]


def concat(samples: list[dict], key: str) -> np.ndarray:
    rows = [s[key] for s in samples]
    if rows[0].dtype == torch.bfloat16:
        rows = [r.view(torch.int16) for r in rows]
    return np.concatenate([r.numpy() for r in rows])


@pytest.mark.parametrize("codec", CODECS)
def test_old_cache_reads_the_values_it_was_written_with(tmp_path, codec):
    cache, expected = old_cache(tmp_path, codec)
    reader = CacheReader(cache)
    assert len(reader.parts) == 2 and reader.manifest.codec.name == codec
    samples = read_all(reader)
    assert [s["sample_id"] for s in samples] == expected["sample_ids"].tolist()
    assert [len(s["input_ids"]) for s in samples] == expected["lengths"].tolist()
    for key in ("hidden", "last_hidden", "input_ids", "loss_mask", "topk_ids", "topk_logprobs"):
        assert np.array_equal(concat(samples, key), expected[key]), key
    if codec == "fp8":  # the stored e4m3 bytes and scales, as the GPU-side dequantization gets them
        stored = read_all(reader, dequantize=False)
        for key in ("hidden", "hidden_scale", "last_hidden", "last_hidden_scale"):
            assert np.array_equal(concat(stored, key), expected[f"stored_{key}"]), key


def test_old_bf16_and_raw_caches_of_one_extraction_hold_the_same_activations():
    with np.load(FIXTURES / "bf16.expected.npz") as bf16, np.load(FIXTURES / "raw.expected.npz") as raw:
        assert np.array_equal(bf16["hidden"], raw["hidden"]) and bf16["hidden"].size > 0


@pytest.mark.parametrize("codec", CODECS)
def test_old_cache_passes_a_full_verify(tmp_path, codec):
    cache, _ = old_cache(tmp_path, codec)
    report = verify_cache(cache)
    assert report.ok, [p for p in report.problems]
    assert report.parts == 2 and report.chunks > 0


@pytest.mark.parametrize("codec", ("bf16", "fp8"))
def test_extraction_with_todays_codec_settings_resumes_an_old_cache(tmp_path, codec):
    """The codec's packing parameters changed since; a cache holding parts packed both ways
    still reads whole and verifies."""
    cache, expected = old_cache(tmp_path, codec)
    header = CacheReader(cache).manifest.header
    header = {**header, "hidden": {**header["hidden"], "codec": HiddenCodec(name=codec).to_dict()}}
    writer = CacheWriter(cache, header)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    with writer.part_writer("part-000002") as pw:
        pw.add_sample(99, torch.arange(40), torch.ones(40, dtype=torch.uint8), hidden,
                      last_hidden=hidden[:, :32], topk_ids=torch.zeros(40, 4, dtype=torch.int32),
                      topk_logprobs=torch.zeros(40, 4))
    reader = CacheReader(cache)
    samples = read_all(reader)
    old = len(expected["sample_ids"])
    assert np.array_equal(concat(samples[:old], "hidden"), expected["hidden"])
    new = samples[old]["hidden"].float()
    if codec == "bf16":
        assert torch.equal(new, hidden.float())
    else:
        assert ((new - hidden.float()).norm() / hidden.float().norm()) < 0.03
    assert verify_cache(cache).ok
