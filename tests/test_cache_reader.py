"""The hot read path: corruption is detected and named; open cost does not grow with parts."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
import torch
from cache_utils import bits, make_cache, shard_file, tiny_header
from dflash.cache_tools.checksum import crc32c
from dflash.cache_tools.errors import CacheCorruptError, CacheNotFoundError
from dflash.cache_tools.manifest import LOG_FILE, PartRecord, encode_log_line
from dflash.cache_tools.reader import CacheReader


@pytest.mark.parametrize("codec", ["bf16", "raw", "fp8", "nf4"])
def test_flipped_byte_in_a_chunk_is_named(tmp_path, codec):
    cache = tmp_path / "c"
    make_cache(cache, codec)
    path = shard_file(cache, "part-000001")
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF  # inside the first chunk of the shard
    path.write_bytes(bytes(data))
    reader = CacheReader(cache)
    reader.read_sample(0)  # other parts are unaffected
    with pytest.raises(CacheCorruptError) as err:
        reader.read_sample(2)
    assert err.value.code == "cache.chunk-checksum"
    assert {k: err.value.fields[k] for k in ("part", "array", "chunk")} == {"part": "part-000001", "array": "hidden",
                                                                           "chunk": 0}


@pytest.mark.parametrize("row,sample", [(98, 1), (105, 0)])
def test_damage_outside_the_rows_read_of_a_raw_chunk_is_caught(tmp_path, row, sample):
    """A raw chunk shared by two samples (rows 96-111: sample 0 ends at row 99) is checked
    whole when only some of its rows are read: a flipped bit in the other sample's rows fails
    the read."""
    cache = tmp_path / "c"
    make_cache(cache, "raw", parts=1)
    header = tiny_header("raw")["hidden"]
    cr, sr, row_bytes = header["chunk_rows"], header["shard_rows"], 2 * 32 * 2
    path = shard_file(cache, "part-000000", shard=row // sr)
    data = bytearray(path.read_bytes())
    n_inner = sr // cr
    index = np.frombuffer(bytes(data[len(data) - (n_inner * 16 + 4):-4]), dtype="<u8").reshape(n_inner, 2)
    data[int(index[(row % sr) // cr, 0]) + (row % cr) * row_bytes + 5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError) as err:
        CacheReader(cache).read_sample(sample)
    assert err.value.code == "cache.chunk-checksum"
    assert {k: err.value.fields[k] for k in ("part", "array", "chunk")} == {"part": "part-000000", "array": "hidden",
                                                                           "chunk": 6}
    other = CacheReader(cache, verify_checksums=False).read_sample(sample)["hidden"]  # unchecked: the rows read are intact
    np.testing.assert_array_equal(bits(other), bits(make_cache(tmp_path / "again", "raw", parts=1)[sample][2]))


def test_truncated_shard_is_named(tmp_path):
    cache = tmp_path / "c"
    make_cache(cache)
    path = shard_file(cache, "part-000000", shard=1)  # rows 64..127 of the part
    os.truncate(path, path.stat().st_size // 2)
    reader = CacheReader(cache)
    with pytest.raises(CacheCorruptError) as err:
        reader.read_sample(0)  # sample 0 spans rows 0..99: crosses into shard 1
    assert err.value.code == "cache.chunk-checksum"  # the shard's index
    assert {k: err.value.fields[k] for k in ("part", "array", "chunk", "shard_file")} == {
        "part": "part-000000", "array": "hidden", "chunk": None, "shard_file": "c/1/0"}


@pytest.mark.parametrize("codec", ["raw", "bf16"])
def test_index_entry_with_a_wrong_chunk_size_is_named(tmp_path, codec):
    # A shard index whose own checksum is intact but whose size for chunk 1 is off by 8 bytes
    # (a writer bug, or a file patched by hand): the reader must refuse that chunk by name,
    # never copy or decode a neighbouring chunk's bytes as rows.
    cache = tmp_path / "c"
    make_cache(cache, codec)
    path = shard_file(cache, "part-000000")
    data = bytearray(path.read_bytes())
    header = tiny_header(codec)["hidden"]
    n_inner = header["shard_rows"] // header["chunk_rows"]
    start = len(data) - (n_inner * 16 + 4)
    index = np.frombuffer(bytes(data[start:-4]), dtype="<u8").reshape(n_inner, 2).copy()
    index[1, 1] -= 8
    data[start:-4] = index.tobytes()
    data[-4:] = crc32c(bytes(data[start:-4])).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError) as err:
        CacheReader(cache).read_sample(0)
    assert err.value.code == "cache.chunk-checksum"
    assert {k: err.value.fields[k] for k in ("part", "array", "chunk")} == {"part": "part-000000", "array": "hidden",
                                                                           "chunk": 1}


def test_missing_shard_file_is_named(tmp_path):
    cache = tmp_path / "c"
    make_cache(cache)
    shard_file(cache, "part-000001").unlink()
    with pytest.raises(CacheCorruptError) as err:
        CacheReader(cache).read_sample(2)
    assert err.value.code == "cache.part-file-missing"
    assert {k: err.value.fields[k] for k in ("part", "array", "file")} == {"part": "part-000001", "array": "hidden",
                                                                          "file": "c/0/0"}


def test_checksum_verification_can_be_turned_off_for_speed(tmp_path):
    cache = tmp_path / "c"
    samples = make_cache(cache, "raw")
    reader = CacheReader(cache, verify_checksums=False)
    np.testing.assert_array_equal(bits(reader.read_sample(1)["hidden"]), bits(samples[1][2]))


def test_missing_or_foreign_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CacheNotFoundError) as err:
        CacheReader(tmp_path / "nope")
    assert err.value.code == "cache.dir-missing" and err.value.fields["cache"] == str(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CacheNotFoundError) as err:
        CacheReader(tmp_path / "empty")
    assert err.value.code == "cache.no-manifest" and err.value.fields == {"cache": str(tmp_path / "empty"),
                                                                          "manifest": "manifest.json"}


def test_reader_in_a_forked_worker_reopens_its_maps(tmp_path):
    cache = tmp_path / "c"
    samples = make_cache(cache)
    reader = CacheReader(cache)
    reader.read_sample(0)  # the parent has open maps now
    loader = torch.utils.data.DataLoader(
        list(range(4)), batch_size=None, num_workers=2,
        collate_fn=lambda i: reader.read_sample(i)["hidden"],
        multiprocessing_context="fork",
        timeout=120,  # a worker that deadlocks after fork fails this test instead of hanging the run
    )
    got = list(loader)
    for i, h in enumerate(got):
        np.testing.assert_array_equal(bits(h), bits(samples[i][2]))


_OPENED: list[str] = []


def _record_opens(event, args):
    # Audit hooks cannot be removed: this one records only while the list is armed.
    if _OPENED and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_record_opens)


def test_open_of_10000_parts_reads_only_the_manifest(tmp_path):
    """10,000 committed parts: opening touches no file but the two manifest files, and reading
    one sample touches only its own part."""
    cache = tmp_path / "c"
    make_cache(cache, parts=1, length=3)
    template = cache / "parts" / "part-000000"
    record = PartRecord(name="", samples=2, tokens=6, lengths=(3, 3), nbytes=1)
    lines = []
    for p in range(1, 10_000):
        os.symlink(template, cache / "parts" / f"part-{p:06d}")
        lines.append(encode_log_line(PartRecord(**{**record.__dict__, "name": f"part-{p:06d}"})))
    with open(cache / LOG_FILE, "ab") as f:
        f.write(b"".join(lines))

    _OPENED.clear()
    _OPENED.append("recording")
    start = time.perf_counter()
    reader = CacheReader(cache)
    during_open = [p for p in _OPENED[1:] if str(cache) in p]
    sample = reader.read_sample(15_000)
    elapsed = time.perf_counter() - start
    during_read = [p for p in _OPENED[len(during_open) + 1:] if str(cache) in p]
    _OPENED.clear()
    assert len(reader) == 20_000
    assert sorted(os.path.basename(p) for p in during_open) == sorted([LOG_FILE, "manifest.json"])
    assert sample["input_ids"].shape == (3,)
    # Reading one sample opens only that part's files.
    touched_parts = {p.split("/parts/")[1].split("/")[0] for p in during_read}
    assert touched_parts == {"part-007500"}
    # The figure itself is measured by bench/bench_open.py (docs/BENCHMARKS.md); this bound only
    # catches a pathological regression (e.g. a directory scan) without timing the machine.
    assert elapsed < 10.0, elapsed


def test_the_commit_log_lists_each_parts_sample_ids_and_a_part_holding_others_is_named(tmp_path):
    """The trainer orders its samples by id from the commit records (no part opened at startup);
    a part whose files hold other ids than its record (files swapped after the commit) is named
    when its ids are read."""
    cache = tmp_path / "c"
    make_cache(cache, parts=2)
    reader = CacheReader(cache)
    assert [p.sample_ids for p in reader.parts] == [(0, 1), (10, 11)]
    assert reader.read_sample(3)["sample_id"] == 11
    lines = (cache / LOG_FILE).read_bytes().splitlines(keepends=True)
    swapped = PartRecord(**{**reader.parts[1].__dict__, "sample_ids": (10, 12)})
    (cache / LOG_FILE).write_bytes(lines[0] + encode_log_line(swapped))
    reader = CacheReader(cache)
    reader.read_sample(0)  # the other part is unaffected
    with pytest.raises(CacheCorruptError) as err:
        reader.read_sample(2)
    assert err.value.code == "cache.part-sample-ids"
    assert {k: err.value.fields[k] for k in ("part", "array", "log")} == {"part": "part-000001", "array": "sample_ids",
                                                                         "log": LOG_FILE}


@pytest.mark.parametrize("codec", ["bf16", "raw", "fp8", "nf4"])
def test_decoding_into_a_slice_of_a_padded_batch_equals_a_plain_read(tmp_path, codec):
    cache = tmp_path / "c"
    make_cache(cache, codec)
    reader = CacheReader(cache)
    batch = torch.full((2, 120, 64), 7.0, dtype=torch.bfloat16)
    rows = batch[1, :90].view(torch.int16).numpy().view(np.uint16)  # the batch rows' bf16 bits
    got = reader.read_sample(1, max_tokens=90, out={"hidden": rows})
    assert got["hidden"] is rows
    np.testing.assert_array_equal(bits(batch[1, :90]), bits(reader.read_sample(1, max_tokens=90)["hidden"]))
    assert bool((batch[1, 90:] == 7.0).all()) and bool((batch[0] == 7.0).all())  # nothing else touched
    with pytest.raises(ValueError, match="contiguous uint16 array of shape"):
        reader.read_sample(1, out={"hidden": batch[1, :50].view(torch.int16).numpy().view(np.uint16)})


@pytest.mark.parametrize("codec", ["bf16", "raw"])
def test_token_ranges_inside_chunks_read_the_rows_written(tmp_path, codec):
    """Ranges that start and end inside a chunk (16 rows here) get exactly their rows: the
    straddled chunks are decoded whole (bf16) or checked whole (raw), then the rows copied."""
    cache = tmp_path / "c"
    samples = make_cache(cache, codec, parts=1, length=100)
    rows = torch.cat([samples[0][2], samples[1][2]])
    reader = CacheReader(cache)
    for a, b in [(3, 17), (20, 150), (99, 101), (0, 200), (199, 200)]:
        np.testing.assert_array_equal(bits(reader.read_tokens(0, a, b)["hidden"]), bits(rows[a:b]))
