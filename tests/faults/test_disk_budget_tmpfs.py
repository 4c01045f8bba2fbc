"""dflash-extract --disk-budget on a real small file system: a tmpfs a little larger than the
budget plus one part, far smaller than the whole cache. Extraction and a follow-mode trainer run
three epochs on it, evicting and extracting again, with no ENOSPC; the weights are an offline
run's, verify and info stay truthful, and the file system's own usage (sampled with statvfs, and
bounded by the mount's size) never passes the budget plus one part. test_disk_budget.py checks
the same bound by counting bytes at every commit; this one checks what the file system spends,
4 KiB pages for the small metadata files included. Skipped (with the reason) where mounting is
not permitted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from click.testing import CliRunner
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.eviction import EVICTED, RESTORED, EvictionLog, evict_part, restore_part
from dflash.cache_tools.manifest import LOCK_FILE, PARTS_DIR, read_manifest
from dflash.cache_tools.reader import CacheReader
from dflash.extract.budget import ExtractionBudget
from dflash.runtime.fsio import file_lock
from dflash.train.data.follow import FollowCacheSet

from .helpers import extract_argv, train_config_file, weights_hash
from .test_disk_budget import EPOCHS, SETTINGS, events
from .test_storage import tmpfs

# Groups of 2 parts: what the trainer holds at once (a group and the parts read since its last
# checkpoint) fits a budget of under a third of the cache.
TMPFS_SETTINGS = {**SETTINGS, "shuffle_parts": 2}


def fs_used(path: Path) -> int:
    """Bytes the file system mounted at `path` has allocated (what ENOSPC is decided on)."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def fs_size(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


class UsageSampler(threading.Thread):
    """Samples fs_used(path) every millisecond or so until stopped; keeps the peak."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.peak, self.samples = path, 0, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, fs_used(self.path))
            self.samples += 1
            time.sleep(0.001)

    def stop(self) -> tuple[int, int]:
        self._done.set()
        self.join()
        return self.peak, self.samples


PAGE = 4096  # a tmpfs allocates whole pages


def sizes_on_tmpfs(cache: Path, probe: Path) -> tuple[int, int]:
    """(the whole cache, its largest part) as a tmpfs allocates them: each copied in turn onto
    the empty tmpfs `probe`."""
    whole = fs_used(probe)
    shutil.copytree(cache, probe / "cache")
    whole = fs_used(probe) - whole
    largest = 0
    for part in sorted((probe / "cache" / PARTS_DIR).iterdir()):
        before = fs_used(probe)
        shutil.copytree(part, probe / "one")
        largest = max(largest, fs_used(probe) - before)
        shutil.rmtree(probe / "one")
    return whole, largest


def test_the_budget_counts_the_blocks_a_tmpfs_allocates_for_the_cache(world, tmp_path):
    """The budget's bytes are the file system's: on a part of ~17 KB in 13 files, their sizes were
    a quarter of the 60 KB of pages it takes, and manifests outside parts/ were not counted."""
    with tmpfs(tmp_path / "disk", "64m") as disk:
        shutil.copytree(world["cache"], disk / "cache")
        reader = CacheReader(disk / "cache")
        budget = ExtractionBudget(disk / "cache", reader.manifest.header, 1 << 30, schema=reader.schema)
        assert budget.used() == fs_used(disk)
        budget.refresh()
        for record in reader.manifest.parts:  # the estimate of a part is in the same bytes
            before = fs_used(disk)
            shutil.copytree(disk / "cache" / PARTS_DIR / record.name, disk / "one")
            spent = fs_used(disk) - before
            shutil.rmtree(disk / "one")
            assert abs(budget.estimate(record.tokens) - spent) <= spent // 2, (record.name, spent)
        reader.close()


def held_files(part_dir: Path) -> list[str]:
    """This process's maps and open files under `part_dir` (a deleted one reads "... (deleted)")."""
    held = [line.split(maxsplit=5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if str(part_dir) in line]
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(part_dir)):
            held.append(target)
    return held


def test_a_follow_reader_lets_go_of_parts_evicted_while_it_reads_or_waits(world, tmp_path):
    """A trainer kept the maps of every part it had read (up to 64) after they were evicted: the
    extraction counted their bytes as freed while the file system still held them all, and the
    next part hit ENOSPC on a disk just above the budget. The reader drops them at its next read,
    and while it waits for a part."""
    cache = tmp_path / "cache"
    shutil.copytree(world["cache"], cache)
    records = {p.name: p for p in read_manifest(cache).parts}
    follow = FollowCacheSet(str(cache), max_seq_len=64, announce=lambda msg: None)
    for i in range(len(follow)):
        follow.read(i)
    first = follow.read(0)["sample_id"]
    waited_for = next(p.name for p in follow.plan.parts if first in p.sample_ids)
    read_on, gone_meanwhile = [n for n in records if n != waited_for][:2]
    assert held_files(cache / PARTS_DIR / read_on) and held_files(cache / PARTS_DIR / gone_meanwhile)

    evict_part(cache, records[read_on], 0)
    follow.read(0)
    assert held_files(cache / PARTS_DIR / read_on) == []

    evict_part(cache, records[waited_for], 0)
    result: dict = {}
    reading = threading.Thread(target=lambda: result.update(follow.read(0)), daemon=True)
    reading.start()
    evict_part(cache, records[gone_meanwhile], 0)
    deadline = time.monotonic() + 10
    while held_files(cache / PARTS_DIR / gone_meanwhile) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held_files(cache / PARTS_DIR / gone_meanwhile) == [] and reading.is_alive()
    stage = cache / PARTS_DIR / ".tmp-restore"  # the re-extraction, bit for bit
    shutil.copytree(world["cache"] / PARTS_DIR / waited_for, stage)
    with file_lock(cache / LOCK_FILE):
        restore_part(cache, stage, records[waited_for], records[waited_for],
                     EvictionLog(cache).refresh().state(waited_for))
    reading.join(timeout=10)
    assert result.get("sample_id") == first
    follow.reader.close()


def test_budgeted_follow_on_a_tmpfs_just_above_the_budget_never_fills_it(zygote, world, tmp_path):
    with tmpfs(tmp_path / "probe", "64m") as probe:
        whole, part = sizes_on_tmpfs(world["cache"], probe)
    budget = whole * 3 // 10
    room = budget + part + 64 * 1024  # a little above the bound (the manifest's files are inside it)
    offline = train_config_file(tmp_path / "offline.json", world["cache"], world["target"], **TMPFS_SETTINGS)
    run = zygote.run("train", ["--config", offline, "--output-dir", tmp_path / "offline"])
    assert run.wait(timeout=300) == 0, run.output()
    reference = weights_hash(tmp_path / "offline")
    with tmpfs(tmp_path / "disk", str(room)) as disk:
        size = fs_size(disk)
        assert budget + part < size < whole // 2, (size, budget, part, whole)  # the cache never fits
        cache = disk / "cache"
        sampler = UsageSampler(disk)
        sampler.start()
        config = train_config_file(tmp_path / "follow.json", cache, world["target"], follow=True,
                                   disk_budget=str(budget), **TMPFS_SETTINGS)
        started = time.monotonic()
        trainer = zygote.run("train", ["--config", config, "--output-dir", tmp_path / "follow"],
                             env={"DFLASH_TEST_SLEEP_PER_BATCH": "0.01"})
        extraction = zygote.run("extract", extract_argv(world["target"], world["data"], cache, "--disk-budget",
                                                        str(budget), "--follow-epochs", str(EPOCHS)))
        try:  # bounded: a full disk or a wait for room that never comes fails here
            status = extraction.wait(timeout=120), trainer.wait(timeout=60)
        finally:
            peak, samples = sampler.stop()
            for run in (extraction, trainer):
                if run.wait(timeout=0) is None:
                    run.signal(signal.SIGKILL)
        elapsed = time.monotonic() - started
        assert status == (0, 0), f"status {status} after {elapsed:.0f} s:\n{extraction.output()[-3000:]}\n" \
                                 f"{trainer.output()[-3000:]}"
        assert "No space left on device" not in extraction.output() + trainer.output()
        assert weights_hash(tmp_path / "follow") == reference
        # The extraction keeps the cache within the budget plus one part at each of its checks; in
        # between, the trainer rewrites its consumption record (trained-rank-N.json, through a
        # temporary copy) and appends to the logs: a few pages that no budget check saw yet.
        records = 4 * PAGE
        assert samples > 100 and peak <= budget + part + records, (peak, budget, part, samples)

        # verify and info tell the truth about the cache that is left: evicted parts are noted,
        # not reported as damage, and the rest is sound.
        log, gone = events(cache), EvictionLog(cache).refresh().evicted()
        restored = sum(e["event"] == RESTORED for e in log)
        assert gone and restored and sum(e["event"] == EVICTED for e in log) >= restored
        manifest_parts = {p.name for p in read_manifest(cache).parts}
        on_disk = {p.name for p in (cache / PARTS_DIR).iterdir()}
        assert on_disk == manifest_parts - set(gone), (sorted(on_disk), sorted(gone))
        runner = CliRunner()
        verify = runner.invoke(cache_main, ["verify", str(cache)])
        assert verify.exit_code == 0, verify.output
        assert f"OK: {len(manifest_parts)} parts" in verify.output and f"{len(gone)} parts" in verify.output
        info = runner.invoke(cache_main, ["info", "--json", str(cache)])
        assert info.exit_code == 0, info.output
        summary = json.loads(info.output)
        assert summary["evicted_parts"] == sorted(gone)
        assert summary["evicted_bytes"] == sum(st.nbytes for st in gone.values())
    print(f"tmpfs of {size} bytes for a cache of {whole} (part {part}, budget {budget}): "
          f"peak {peak} over {samples} samples; {len(gone)} parts evicted at the end, {restored} "
          f"re-extractions; {elapsed:.0f} s")
