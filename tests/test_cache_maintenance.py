"""Behaviour of the cache maintenance operations (verify, stats, recompress, merge, prune)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.errors import CacheError, CacheNotFoundError, ConfigMismatchError
from dflash.cache_tools.maintenance import cache_stats, prune_cache, verify_cache
from dflash.cache_tools.manifest import make_header, read_manifest
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.rewrite import merge_caches, recompress_cache
from dflash.cache_tools.summary import cache_info
from dflash.cache_tools.writer import CacheWriter
from dflash.runtime.fsio import file_lock
from dflash.train.data.loader import sample_tensors

VOCAB = 1000


def make_cache(
    path: Path, *, layer_ids=(1, 5), hidden: int = 32, codec: str = "bf16", parts: int = 2,
    samples_per_part: int = 4, first_id: int = 0, seed: int = 0, scale_channel: int | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """A tiny cache of random bf16 activations; returns what was written, by sample id."""
    header = make_header(
        target={"model": "tiny-qwen3", "architecture": "Qwen3ForCausalLM", "vocab_size": VOCAB,
                "num_hidden_layers": 8},
        target_layer_ids=list(layer_ids), hidden_size=hidden, codec=HiddenCodec(name=codec),
        chunk_rows=16, shard_rows=64, data={"dataset": "synthetic", "seed": seed},
    )
    writer = CacheWriter(path, header)
    g = torch.Generator().manual_seed(seed)
    width = len(layer_ids) * hidden
    written: dict[int, dict[str, torch.Tensor]] = {}
    sid = first_id
    for p in range(parts):
        with writer.part_writer(f"part-{p:06d}") as pw:
            pw.stats["skipped_bad"] = p + 1
            for _ in range(samples_per_part):
                t = int(torch.randint(20, 90, (1,), generator=g))
                h = torch.randn(t, width, generator=g)
                if scale_channel is not None:
                    h[:, scale_channel] *= 100.0
                sample = {
                    "input_ids": torch.randint(0, VOCAB, (t,), generator=g),
                    "loss_mask": (torch.rand(t, generator=g) > 0.3).to(torch.uint8),
                    "hidden": h.bfloat16(),
                }
                pw.add_sample(sid, **sample)
                written[sid] = sample
                sid += 1
    return written


def flip_chunk_bytes(cache: Path, part_idx: int, chunk: int) -> None:
    """Flip bytes in the middle of one stored hidden chunk (inside its shard file)."""
    reader = CacheReader(cache)
    pf = reader.part_arrays(part_idx)
    meta = pf.array_meta("hidden")
    shard, inner = divmod(chunk * meta.chunk_rows, meta.shard_rows)
    _, idx = pf.shard_index("hidden", shard, meta)
    off, nbytes = (int(x) for x in idx[inner // meta.chunk_rows])
    pf.close()
    path = pf.dir / "hidden" / "c" / str(shard) / "0"
    with open(path, "r+b") as f:
        f.seek(off + nbytes // 2)
        b = f.read(4)
        f.seek(off + nbytes // 2)
        f.write(bytes(x ^ 0xFF for x in b))


def truncate_shard(cache: Path, part: str, shard: int = 0) -> Path:
    path = cache / "parts" / part / "hidden" / "c" / str(shard) / "0"
    os.truncate(path, path.stat().st_size // 2)
    return path


def test_verify_finds_nothing_on_a_sound_cache(tmp_path):
    make_cache(tmp_path / "c", parts=3)
    for fast in (False, True):
        report = verify_cache(tmp_path / "c", fast=fast, progress=False)
        assert report.ok, [str(p) for p in report.problems]
        assert report.parts == 3
    assert verify_cache(tmp_path / "c", progress=False).chunks > 0


def test_verify_collects_a_corrupt_chunk_and_a_truncated_shard_in_different_parts(tmp_path):
    cache = tmp_path / "c"
    make_cache(cache, parts=3)
    flip_chunk_bytes(cache, part_idx=0, chunk=1)
    truncate_shard(cache, "part-000002")
    report = verify_cache(cache, progress=False)
    assert report.bad_parts == ["part-000000", "part-000002"]
    found = {(p.part, p.array, p.finding.code, p.finding.fields.get("chunk"), p.finding.fields.get("shard_file"))
             for p in report.problems}
    assert ("part-000000", "hidden", "cache.verify-unreadable", 1, "hidden/c/0/0") in found, found
    assert [p.finding.fields["error"].code for p in report.problems if p.part == "part-000000"] == ["cache.chunk-checksum"]
    assert any(part == "part-000002" and shard == "hidden/c/0/0" for part, _, _, _, shard in found), found
    # the rest of the truncated part was still checked: its later shards decode fine
    assert report.chunks > 0


def test_verify_fast_catches_truncation_but_does_not_decode_chunks(tmp_path):
    cache = tmp_path / "c"
    make_cache(cache, parts=3)
    flip_chunk_bytes(cache, part_idx=0, chunk=1)
    truncate_shard(cache, "part-000002")
    report = verify_cache(cache, fast=True, progress=False)
    assert report.bad_parts == ["part-000002"]
    assert report.chunks == 0


def test_verify_reports_token_ids_outside_the_vocabulary(tmp_path):
    cache = tmp_path / "c"
    make_cache(cache, parts=1)
    header = read_manifest(cache).header
    writer = CacheWriter(cache, header)
    with writer.part_writer("part-000001") as pw:
        ids = torch.full((10,), 5)
        ids[3] = VOCAB + 7
        pw.add_sample(99, ids, torch.ones(10, dtype=torch.uint8), torch.randn(10, 64).bfloat16())
    report = verify_cache(cache, progress=False)
    assert [(p.part, p.array, p.finding.code) for p in report.problems] == [
        ("part-000001", "input_ids", "cache.verify-token-ids")]
    assert report.problems[0].finding.fields == {"count": 1, "vocab_size": VOCAB, "row": 3, "token": VOCAB + 7}


def test_verify_reports_a_missing_part_and_a_damaged_commit_line_and_goes_on(tmp_path):
    cache = tmp_path / "c"
    make_cache(cache, parts=3)
    shutil.rmtree(cache / "parts" / "part-000001")
    log = cache / "manifest.parts.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b'"samples":4', b'"samples":5')
    log.write_bytes(b"".join(lines))
    report = verify_cache(cache, progress=False)
    found = [(p.part, p.finding.code, p.finding.fields.get("line")) for p in report.problems]
    assert ("part-000001", "cache.verify-part-missing", None) in found, found
    assert (None, "cache.verify-commit-line", 3) in found, found
    damaged = next(p for p in report.problems if p.part is None).finding
    assert (damaged.fields["file"], damaged.fields["line"]) == ("manifest.parts.jsonl", 3)
    assert damaged.fields["error"].code == "cache.commit-record-checksum"  # what is wrong with the line
    assert report.parts == 2  # the two readable records were still checked


def test_info_matches_what_was_written(tmp_path):
    cache = tmp_path / "c"
    written = make_cache(cache, parts=2, hidden=32)
    info = cache_info(cache)
    tokens = sum(len(s["input_ids"]) for s in written.values())
    on_disk = sum(f.stat().st_size for f in (cache / "parts").rglob("*") if f.is_file())
    assert (info["parts"], info["samples"], info["tokens"]) == (2, len(written), tokens)
    assert info["bytes"] == on_disk
    assert info["raw_bf16_bytes"] == tokens * 2 * 32 * 2
    assert info["compression_ratio"] == pytest.approx(tokens * 2 * 32 * 2 / on_disk)
    assert info["part_stats"] == {"skipped_bad": 3}
    assert info["target_layer_ids"] == [1, 5] and info["codec"]["name"] == "bf16"


def test_stats_finds_an_outlier_channel_and_counts_every_sample(tmp_path):
    cache = tmp_path / "c"
    written = make_cache(cache, parts=2, scale_channel=7)
    s = cache_stats(cache, num_tokens=200, seed=1, progress=False)
    assert s["sampled_tokens"] == 200
    assert s["layers"][0]["top_channels"][0]["channel"] == 7
    assert s["layers"][0]["top_channels"][0]["rms_over_median"] > 50
    assert s["layers"][0]["absmax"] > 50 > s["layers"][1]["absmax"]
    assert s["layers"][1]["std"] == pytest.approx(1.0, rel=0.1)
    assert sum(h["samples"] for h in s["length_histogram"]) == len(written)
    assert cache_stats(cache, num_tokens=200, seed=1, progress=False) == s  # seeded


def _read_all(cache: Path) -> dict[int, dict[str, torch.Tensor]]:
    reader = CacheReader(cache)
    return {s["sample_id"]: s for s in (sample_tensors(reader.read_sample(i)) for i in range(len(reader)))}


def test_recompress_to_fp8_keeps_samples_within_3_percent(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "fp8"
    written = make_cache(src, hidden=256, parts=2, samples_per_part=2)
    report = recompress_cache(src, dst, codec="fp8", progress=False)
    assert report.written == ["part-000000", "part-000001"]
    assert [p.name for p in read_manifest(dst).parts] == [p.name for p in read_manifest(src).parts]
    got = _read_all(dst)
    assert sorted(got) == sorted(written)
    for sid, w in written.items():
        g = got[sid]
        assert torch.equal(g["input_ids"], w["input_ids"]) and torch.equal(g["loss_mask"], w["loss_mask"])
        x = w["hidden"].float().reshape(len(w["input_ids"]), 2, 256)
        y = g["hidden"].float().reshape_as(x)
        rel = (y - x).norm(dim=-1) / x.norm(dim=-1)
        assert rel.max() < 0.03
    assert cache_info(dst)["compression_ratio"] > 1.8


def test_recompress_between_bf16_and_raw_is_exact_and_resumes(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "raw"
    written = make_cache(src, parts=2)
    assert recompress_cache(src, dst, codec="raw", progress=False).written == ["part-000000", "part-000001"]
    # the source grows by one part; rerunning copies only the new one
    writer = CacheWriter(src, read_manifest(src).header)
    with writer.part_writer("part-000002") as pw:
        pw.add_sample(50, torch.arange(5), torch.ones(5, dtype=torch.uint8), torch.randn(5, 64).bfloat16())
    report = recompress_cache(src, dst, codec="raw", progress=False)
    assert report.written == ["part-000002"] and report.skipped == ["part-000000", "part-000001"]
    got = _read_all(dst)
    for sid, w in written.items():
        assert torch.equal(got[sid]["hidden"], w["hidden"])
    assert verify_cache(dst, progress=False).ok


def test_recompress_refuses_a_destination_written_with_another_codec(tmp_path):
    make_cache(tmp_path / "src", parts=1)
    recompress_cache(tmp_path / "src", tmp_path / "dst", codec="fp8", progress=False)
    with pytest.raises(ConfigMismatchError) as err:
        recompress_cache(tmp_path / "src", tmp_path / "dst", codec="raw", progress=False)
    assert err.value.code == "cache.settings-differ" and err.value.fields["cache"] == str(tmp_path / "dst")
    assert ["hidden.codec.name", "'fp8'", "'raw'"] in err.value.fields["differences"]


def test_merge_holds_every_sample_of_both_sources(tmp_path):
    a = make_cache(tmp_path / "a", parts=2, seed=1)
    b = make_cache(tmp_path / "b", parts=1, seed=2, first_id=100)
    report = merge_caches(tmp_path / "m", [tmp_path / "a", tmp_path / "b"], progress=False)
    m = read_manifest(tmp_path / "m")
    assert [p.name for p in m.parts] == ["s0-part-000000", "s0-part-000001", "s1-part-000000"]
    assert report.written == [p.name for p in m.parts]
    sources = m.header["data"]["merged_from"]
    assert [s["data"]["seed"] for s in sources] == [1, 2]
    assert [s["prefix"] for s in sources] == ["s0", "s1"]
    got = _read_all(tmp_path / "m")
    expected = {**a, **b}
    assert sorted(got) == sorted(expected)
    for sid, w in expected.items():
        assert torch.equal(got[sid]["hidden"], w["hidden"])
        assert torch.equal(got[sid]["input_ids"], w["input_ids"])
    assert cache_info(tmp_path / "m")["part_stats"] == {"skipped_bad": 1 + 2 + 1}


def test_merge_refuses_caches_with_different_target_layer_ids(tmp_path):
    make_cache(tmp_path / "a", parts=1, layer_ids=(1, 5))
    make_cache(tmp_path / "b", parts=1, layer_ids=(2, 6))
    with pytest.raises(ConfigMismatchError) as e:
        merge_caches(tmp_path / "m", [tmp_path / "a", tmp_path / "b"], progress=False)
    assert e.value.code == "cache.merge-settings-differ"
    assert (e.value.fields["first"], e.value.fields["cache"]) == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert ["target_layer_ids", "[1, 5]", "[2, 6]"] in e.value.fields["differences"]
    assert not (tmp_path / "m").exists()


def test_merge_refuses_to_write_into_a_source(tmp_path):
    make_cache(tmp_path / "a", parts=1)
    with pytest.raises(CacheError) as e:
        merge_caches(tmp_path / "a", [tmp_path / "a"], progress=False)
    assert e.value.code == "cache.destination-is-source" and e.value.fields == {"dst": str(tmp_path / "a"), "src": None}


def test_prune_removes_stale_temp_and_unrecorded_parts_and_keeps_the_rest(tmp_path):
    cache = tmp_path / "c"
    make_cache(cache, parts=2)
    parts = cache / "parts"
    stale = parts / ".tmp-part-000009.123.abcd"
    (stale / "hidden").mkdir(parents=True)
    (stale / "hidden" / "zarr.json").write_text("{}")
    unrecorded = parts / "part-000042"
    unrecorded.mkdir()
    (unrecorded / "zarr.json").write_text("{}")
    live = parts / ".tmp-part-000010.456.beef"
    live.mkdir()
    with file_lock(parts / (live.name + ".lock")):  # a writer that is still running
        dry = prune_cache(cache, dry_run=True)
        assert sorted(n for n, _ in dry) == [stale.name, "part-000042"]
        assert stale.exists() and unrecorded.exists()
        removed = prune_cache(cache)
        assert sorted(n for n, _ in removed) == [stale.name, "part-000042"]
        assert all(size > 0 for _, size in removed)
    assert not stale.exists() and not unrecorded.exists() and live.exists()
    assert (parts / "part-000000").is_dir() and (parts / "part-000001").is_dir()
    assert len(CacheReader(cache)) == 8 and verify_cache(cache, progress=False).ok


def test_operations_on_a_missing_directory_raise_cache_not_found(tmp_path):
    for op in (cache_info, verify_cache, cache_stats, prune_cache):
        with pytest.raises(CacheNotFoundError):
            op(tmp_path / "nope")
    assert not any(tmp_path.iterdir())  # nothing was created on the way
