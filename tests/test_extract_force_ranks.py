"""--force given to every rank of a torchrun extraction: rank 0 starts the cache anew, the others
wait for its new header instead of refusing the old cache or joining it before it is deleted.

Rank 1 runs in a thread of this process (its own target, writer and file locks, as in a process
of its own): the test sees it wait on the old cache before rank 0 starts."""

from __future__ import annotations

import threading

from conftest import random_records, write_jsonl
from dflash.cache_tools.manifest import read_manifest
from dflash.cache_tools.writer import CacheWriter
from extract_utils import assert_same_contents, cache_contents, extract, make_target


class Rank1(threading.Thread):
    """Rank 1 of 2 given --force; `join_checked` raises what it raised."""

    def __init__(self, target, data, out):
        super().__init__(daemon=True)
        self.args_, self.error = (target, data, out), None

    def run(self) -> None:
        try:
            extract(*self.args_, force=True, rank=1, world_size=2)
        except BaseException as e:  # noqa: BLE001 - raised again by join_checked
            self.error = e

    def join_checked(self) -> None:
        self.join(timeout=120)
        assert not self.is_alive(), "rank 1 still waits after rank 0 started the cache anew"
        if self.error is not None:
            raise self.error


def start_waiting_rank(monkeypatch, target, data, out) -> Rank1:
    """Rank 1, returned once it found the old cache not the one of this forced run and waits."""
    waiting = threading.Event()
    is_forced = CacheWriter._forced_for_this_run

    def seen(self):
        forced = is_forced(self)
        if not forced:
            waiting.set()
        return forced

    monkeypatch.setattr(CacheWriter, "_forced_for_this_run", seen)
    rank1 = Rank1(target, data, out)
    rank1.start()
    while not waiting.wait(0.05):
        assert rank1.is_alive(), f"rank 1 ended without waiting: {rank1.error!r}"
    return rank1


def test_a_rank_started_before_rank_0_waits_for_the_forced_cache(tmp_path, monkeypatch):
    target = make_target(tmp_path / "target", layers=4)
    data = write_jsonl(tmp_path / "data.jsonl", random_records(24, seed=3, max_len=40))
    clean = tmp_path / "clean"
    extract(target, data, clean)
    out = tmp_path / "cache"
    extract(target, data, out)  # an old cache of the same settings: rank 1 alone would join it
    old_parts = {p.name for p in read_manifest(out).parts}
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-17")  # what torchrun gives both ranks
    rank1 = start_waiting_rank(monkeypatch, target, data, out)  # rank 1 opens the old cache first
    extract(target, data, out, force=True, rank=0, world_size=2)
    rank1.join_checked()
    manifest = read_manifest(out)
    assert manifest.header["provenance"]["forced_run"] == "run-17"
    assert {p.name for p in manifest.parts} == old_parts  # the same parts, each written anew once
    assert_same_contents(cache_contents(out), cache_contents(clean))


def test_a_forced_rank_without_a_run_id_waits_for_a_header_it_can_join(tmp_path, monkeypatch):
    target = make_target(tmp_path / "target", layers=4)
    data = write_jsonl(tmp_path / "data.jsonl", random_records(24, seed=3, max_len=40))
    out = tmp_path / "cache"
    extract(target, write_jsonl(tmp_path / "old.jsonl", random_records(6, seed=8)), out, part_tokens=60)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    rank1 = start_waiting_rank(monkeypatch, target, data, out)  # other settings: it waits, not refuses
    extract(target, data, out, force=True, rank=0, world_size=2)
    rank1.join_checked()
    extract(target, data, tmp_path / "clean")
    assert_same_contents(cache_contents(out), cache_contents(tmp_path / "clean"))
