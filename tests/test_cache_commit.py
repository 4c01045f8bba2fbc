"""The commit protocol: concurrent writers, crashes at any moment, orphans, torn records."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from cache_utils import bits, random_sample, tiny_header
from dflash.cache_tools.errors import CacheError
from dflash.cache_tools.maintenance import verify_cache
from dflash.cache_tools.manifest import LOG_FILE, read_manifest
from dflash.cache_tools.orphans import remove_orphans
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.writer import CacheWriter
from dflash.runtime.fsio import file_lock
from dflash.train.data.loader import sample_tensors

WRITER_SCRIPT = textwrap.dedent("""
    import os, sys, time, traceback, torch
    sys.path.insert(0, sys.argv[3])
    from cache_utils import random_sample, tiny_header
    from dflash.cache_tools.writer import CacheWriter
    cache, slow = sys.argv[1], len(sys.argv) > 4
    ranges = [tuple(map(int, r.split(":"))) for r in sys.argv[2].split(",")]

    def write(first, count):
        w = CacheWriter(cache, tiny_header())
        for p in range(first, first + count):
            gen = torch.Generator().manual_seed(p)
            with w.part_writer(f"part-{p:06d}") as pw:
                for s in range(3):
                    ids, mask, hidden = random_sample(gen, 20 + s, 64)
                    pw.add_sample(p * 100 + s, ids, mask, hidden)
                    if slow and p == first + count - 1:
                        print("IN-PART", flush=True)
                        time.sleep(60)
            print("COMMITTED", p, flush=True)

    if len(ranges) == 1:
        write(*ranges[0])
    else:  # one writer process per range, forked once the imports are done, all at once
        pids = []
        for first, count in ranges:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    write(first, count)
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    os._exit(code)
            pids.append(pid)
        statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        sys.exit(f"writer statuses {statuses}" if any(statuses) else 0)
""")


def expected_part(p: int):
    gen = torch.Generator().manual_seed(p)
    return [random_sample(gen, 20 + s, 64) for s in range(3)]


def run_writers(cache, ranges: list[tuple[int, int]], tests_dir, *extra):
    """Writer processes, one per (first part, count) range, committing to `cache` concurrently."""
    spec = ",".join(f"{first}:{count}" for first, count in ranges)
    return subprocess.Popen(
        [sys.executable, "-c", WRITER_SCRIPT, str(cache), spec, str(tests_dir), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def check_parts(cache, parts):
    reader = CacheReader(cache)
    names = [p.name for p in reader.parts]
    assert sorted(names) == [f"part-{p:06d}" for p in sorted(parts)]
    for idx, record in enumerate(reader.parts):
        p = int(record.name.split("-")[1])
        for s, (ids, _mask, hidden) in enumerate(expected_part(p)):
            part_idx, local = idx, s
            got = sample_tensors(reader.read_sample(int(reader._part_start[part_idx]) + local))
            assert got["sample_id"] == p * 100 + s
            assert torch.equal(got["input_ids"], ids)
            np.testing.assert_array_equal(bits(got["hidden"]), bits(hidden))


def test_concurrent_writers_lose_no_commit(tmp_path):
    cache = tmp_path / "c"
    tests_dir = os.path.dirname(__file__)
    proc = run_writers(cache, [(10 * i, 6) for i in range(4)], tests_dir)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    check_parts(cache, [10 * i + j for i in range(4) for j in range(6)])
    assert read_manifest(cache).num_samples == 4 * 6 * 3


def test_second_writer_of_a_part_is_dropped_whole(tmp_path):
    cache = tmp_path / "c"
    writer = CacheWriter(cache, tiny_header())
    gen = torch.Generator().manual_seed(0)
    first, second = writer.part_writer("part-000000"), writer.part_writer("part-000000")
    with first, second:
        first.add_sample(1, *random_sample(gen, 5, 64))
        second.add_sample(2, *random_sample(gen, 5, 64))
    # `second` exits first (inner context), so it wins; `first` must be dropped, not merged.
    assert second.committed and not first.committed
    reader = CacheReader(cache)
    assert len(reader) == 1 and reader.read_sample(0)["sample_id"] == 2


def test_sigkill_mid_part_keeps_earlier_parts_and_leaves_no_orphan(tmp_path):
    cache = tmp_path / "c"
    proc = run_writers(cache, [(0, 4)], os.path.dirname(__file__), "slow")
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("IN-PART"):
            break
    # Kill while part 3's temporary directory exists and nothing of it is committed.
    tmp_dirs = [p for p in (cache / "parts").iterdir() if p.name.startswith(".tmp-")]
    assert tmp_dirs, "the writer should hold a temporary part when killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert lines[:3] == ["COMMITTED 0", "COMMITTED 1", "COMMITTED 2"]
    # Readers see exactly the committed parts even before any cleanup.
    check_parts(cache, [0, 1, 2])
    # The next writer's open removes the dead writer's leftovers.
    CacheWriter(cache, tiny_header())
    leftovers = [p.name for p in (cache / "parts").iterdir()]
    assert sorted(leftovers) == ["part-000000", "part-000001", "part-000002"]
    check_parts(cache, [0, 1, 2])
    report = verify_cache(cache, progress=False)
    assert report.ok and report.parts == 3, [str(p) for p in report.problems]


def test_orphan_sweep_spares_a_live_writer(tmp_path):
    cache = tmp_path / "c"
    writer = CacheWriter(cache, tiny_header())
    gen = torch.Generator().manual_seed(0)
    with writer.part_writer("part-000001") as live:
        live.add_sample(1, *random_sample(gen, 5, 64))
        # A crashed writer's leftovers: a temp dir with an unheld lock, and an unrecorded part.
        (cache / "parts" / ".tmp-part-000007.999.dead").mkdir()
        (cache / "parts" / ".tmp-part-000007.999.dead.lock").touch()
        (cache / "parts" / "part-000008").mkdir()
        with file_lock(cache / ".lock"):
            removed = remove_orphans(cache)
        assert sorted(removed) == [".tmp-part-000007.999.dead", "part-000008"]
        assert live._tmp.name.startswith(".tmp-part-000001")
    assert live.committed
    assert [p.name for p in read_manifest(cache).parts] == ["part-000001"]


def test_the_orphan_sweep_spares_a_following_trainers_record_in_the_making(tmp_path):
    """A trainer following a cache writes its consumption record beside the manifest without the
    cache lock: an extraction restarted meanwhile, whose open sweeps a dead writer's temporary
    files, must not delete that record's temporary file under it (the trainer's rename failed).
    The rank's own next record clears what a killed trainer of that rank left."""
    from dflash.cache_tools.eviction import read_trained, write_trained

    cache = tmp_path / "c"
    CacheWriter(cache, tiny_header())
    in_flight = cache / f".tmp-manifest.trained-rank00000.json.{os.getpid()}.abcd1234"
    other_rank = cache / ".tmp-manifest.trained-rank00001.json.999.dead"
    dead_manifest = cache / ".tmp-manifest.json.999.dead"
    for p in (in_flight, other_rank, dead_manifest):
        p.write_text("{}")
    CacheWriter(cache, tiny_header())  # a restarted extraction's open
    assert in_flight.exists() and other_rank.exists() and not dead_manifest.exists()
    write_trained(cache, rank=0, world_size=1, epoch=0, parts=["part-000001"])
    assert not in_flight.exists() and other_rank.exists()
    assert [r.parts for r in read_trained(cache)] == [frozenset({"part-000001"})]


def test_torn_commit_record_is_ignored_then_repaired(tmp_path):
    cache = tmp_path / "c"
    writer = CacheWriter(cache, tiny_header())
    gen = torch.Generator().manual_seed(0)
    with writer.part_writer("part-000000") as pw:
        pw.add_sample(1, *random_sample(gen, 5, 64))
    with open(cache / LOG_FILE, "ab") as f:  # a writer killed in the middle of its append
        f.write(b'{"part":"part-000001","samp')
    assert [p.name for p in read_manifest(cache).parts] == ["part-000000"]
    writer = CacheWriter(cache, tiny_header())
    with writer.part_writer("part-000002") as pw:
        pw.add_sample(2, *random_sample(gen, 5, 64))
    assert [p.name for p in read_manifest(cache).parts] == ["part-000000", "part-000002"]
    assert (cache / LOG_FILE).read_bytes().count(b"\n") == 2


def test_open_after_kill_during_commit_rename(tmp_path):
    """A part renamed into place but never recorded (killed between the two) is not visible
    and is removed by the next writer; the same part can then be written again."""
    cache = tmp_path / "c"
    writer = CacheWriter(cache, tiny_header())
    gen = torch.Generator().manual_seed(0)
    with writer.part_writer("part-000000") as pw:
        pw.add_sample(1, *random_sample(gen, 5, 64))
    shutil.copytree(cache / "parts" / "part-000000", cache / "parts" / "part-000005")
    assert [p.name for p in read_manifest(cache).parts] == ["part-000000"]
    writer = CacheWriter(cache, tiny_header())
    assert not (cache / "parts" / "part-000005").exists()
    with writer.part_writer("part-000005") as pw:
        pw.add_sample(5, *random_sample(gen, 7, 64))
    assert CacheReader(cache).read_sample(1)["sample_id"] == 5


def test_opening_a_cache_another_writer_is_creating_does_not_refuse(tmp_path):
    """Two ranks starting at once: one finds the other's lock file, parts/ and the manifest's
    temporary file but no manifest yet. That is a cache being born, not foreign data."""
    cache = tmp_path / "c"
    (cache / "parts").mkdir(parents=True)
    (cache / ".lock").touch()
    (cache / ".tmp-manifest.json.4242.abcd1234").write_text("{")
    writer = CacheWriter(cache, tiny_header())
    assert read_manifest(cache).header["target_layer_ids"] == [1, 3]
    # Under the lock, a manifest temp file is a crashed creator's leftover: swept.
    assert writer.removed_orphans == [".tmp-manifest.json.4242.abcd1234"]
    assert not (cache / ".tmp-manifest.json.4242.abcd1234").exists()


def test_a_manifest_written_while_the_directory_is_listed_is_a_cache_not_foreign_data(tmp_path, monkeypatch):
    """The other rank renames its manifest into place (and opens the commit log) after this
    writer looked for a manifest but before it listed the directory: the listing shows the
    manifest, and the writer must join the cache rather than refuse it."""
    cache = tmp_path / "c"
    (cache / "parts").mkdir(parents=True)
    (cache / ".lock").touch()
    CacheWriter(tmp_path / "other", tiny_header())  # the manifest the other rank writes
    listing = Path.iterdir

    def iterdir_while_the_other_rank_commits(self):
        if self == cache and not (cache / "manifest.json").exists():
            shutil.copy(tmp_path / "other" / "manifest.json", cache / "manifest.json")
            (cache / LOG_FILE).touch()
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", iterdir_while_the_other_rank_commits)
    writer = CacheWriter(cache, tiny_header())
    monkeypatch.undo()
    with writer.part_writer("part-000000") as pw:
        pw.add_sample(0, *random_sample(torch.Generator().manual_seed(0), 5, 64))
    assert [p.name for p in read_manifest(cache).parts] == ["part-000000"]


def test_a_directory_with_a_commit_log_but_no_manifest_is_refused(tmp_path):
    """A cache whose manifest was deleted keeps its parts and commit log: no new manifest is
    written over them."""
    cache = tmp_path / "c"
    (cache / "parts").mkdir(parents=True)
    (cache / LOG_FILE).write_text("")
    with pytest.raises(CacheError) as err:
        CacheWriter(cache, tiny_header())
    assert err.value.code == "cache.dir-not-a-cache"
    assert not (cache / "manifest.json").exists()
