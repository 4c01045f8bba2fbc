"""The part schema is the layout: what the writer writes, old caches hold, and the writer refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from cache_utils import random_sample, tiny_header
from dflash.cache_tools.errors import CacheError
from dflash.cache_tools.manifest import read_manifest
from dflash.cache_tools.rewrite import merge_caches
from dflash.cache_tools.schema import PartSchema, sample_offsets, shard_key
from dflash.cache_tools.writer import CacheWriter

FIXTURES = Path(__file__).parent / "fixtures" / "v1-caches"


def test_widths_and_dtypes_follow_the_header():
    schema = PartSchema.from_header(tiny_header("fp8", layers=(1, 3), hidden_size=32, store_last_hidden=True, topk=3))
    got = {s.name: (s.width, s.dtype.name, s.per, s.chunked) for s in schema}
    assert got == {
        "hidden": (64, "uint8", "token", True),
        "hidden_scale": (2, "float32", "token", False),
        "last_hidden": (32, "uint8", "token", True),
        "last_hidden_scale": (1, "float32", "token", False),
        "topk_ids": (3, "int32", "token", True),
        "topk_logprobs": (3, "float32", "token", True),
        "input_ids": (None, "int32", "token", False),
        "loss_mask": (None, "uint8", "token", False),
        "offsets": (None, "int64", "boundary", False),
        "sample_ids": (None, "int64", "sample", False),
    }
    plain = PartSchema.from_header(tiny_header("bf16"))
    assert [s.name for s in plain] == ["hidden", "input_ids", "loss_mask", "offsets", "sample_ids"]
    assert plain["hidden"].dtype == np.uint16


def _assert_parts_follow_the_schema(cache: Path) -> int:
    manifest = read_manifest(cache)
    schema = PartSchema.from_header(manifest.header)
    for rec in manifest.parts:
        group = zarr.open_group(cache / "parts" / rec.name, mode="r")
        assert sorted(name for name, _ in group.arrays()) == sorted(schema.names), rec.name
        for spec in schema:
            arr = group[spec.name]
            assert arr.shape == spec.shape(rec.tokens, rec.samples) and arr.dtype == spec.dtype, spec.name
            chunks, shards = schema.chunking(spec, arr.shape[0])
            assert arr.chunks == chunks and arr.shards == shards, spec.name
            assert (cache / "parts" / rec.name / spec.name / shard_key(0, arr.ndim)).is_file()
        np.testing.assert_array_equal(group["offsets"][...], sample_offsets(rec.lengths))
    return len(manifest.parts)


@pytest.mark.parametrize("codec", ["bf16", "fp8", "nf4", "raw"])
def test_a_written_part_holds_exactly_the_schema_arrays(tmp_path, codec):
    writer = CacheWriter(tmp_path / "c", tiny_header(codec, store_last_hidden=True, topk=2))
    gen = torch.Generator().manual_seed(0)
    with writer.part_writer("part-000000") as pw:
        for sid, n in enumerate((5, 70)):
            ids, mask, hidden = random_sample(gen, n, 64)
            pw.add_sample(sid, ids, mask, hidden, last_hidden=hidden[:, :32],
                          topk_ids=torch.zeros(n, 2, dtype=torch.int32), topk_logprobs=torch.zeros(n, 2))
    assert _assert_parts_follow_the_schema(tmp_path / "c") == 1


@pytest.mark.parametrize("codec", ["bf16", "fp8", "raw"])
def test_caches_of_the_previous_writer_follow_the_schema(codec):
    assert _assert_parts_follow_the_schema(FIXTURES / codec) >= 1


def test_an_old_cache_with_the_path_in_its_target_merges_with_a_copy_elsewhere(tmp_path):
    """The previous writer recorded the model's path in `target`: it is provenance now."""
    a = shutil.copytree(FIXTURES / "bf16", tmp_path / "a")
    b = shutil.copytree(FIXTURES / "bf16", tmp_path / "b")
    header = json.loads((b / "manifest.json").read_text())
    assert "path" in header["target"]
    header["target"]["path"] = "/another/mount/tiny-target"
    header["data"]["sha256"] = "f" * 64  # as if of other data: a copy's samples never merge with its own
    (b / "manifest.json").write_text(json.dumps(header))
    report = merge_caches(tmp_path / "merged", [a, b], progress=False)
    assert len(report.written) == 2 * len(read_manifest(a).parts)


@pytest.mark.parametrize("extra, unknown", [
    ({"last_hidden": torch.zeros(4, 32)}, ["last_hidden"]),
    ({"topk_ids": torch.zeros(4, 2, dtype=torch.int32), "topk_logprobs": torch.zeros(4, 2)},
     ["topk_ids", "topk_logprobs"]),
])
def test_the_writer_refuses_arrays_the_cache_does_not_store(tmp_path, extra, unknown):
    writer = CacheWriter(tmp_path / "c", tiny_header("bf16"))
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(CacheError) as err, writer.part_writer("part-000000") as pw:
        pw.add_sample(0, *random_sample(gen, 4, 64), **extra)
    assert err.value.code == "cache.write-arrays" and err.value.fields["unknown"] == unknown


def test_the_writer_refuses_a_sample_without_an_array_the_cache_stores(tmp_path):
    writer = CacheWriter(tmp_path / "c", tiny_header("bf16", store_last_hidden=True))
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(CacheError) as err, writer.part_writer("p") as pw:
        pw.add_sample(0, *random_sample(gen, 4, 64))
    assert err.value.code == "cache.write-arrays" and err.value.fields["missing"] == ["last_hidden"]
    assert err.value.fields["unknown"] == [] and err.value.fields["sample"] == 0
    assert read_manifest(tmp_path / "c").parts == []  # nothing committed
