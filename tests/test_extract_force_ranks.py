"""--force given to every rank of a torchrun extraction: rank 0 starts the cache anew, the others
wait for its new header instead of refusing the old cache or joining it before it is deleted."""

from __future__ import annotations

import time

from conftest import random_records, write_jsonl
from dflash.cache_tools.manifest import read_manifest
from extract_utils import assert_same_contents, cache_contents, extract, make_target, start


def test_a_rank_started_before_rank_0_waits_for_the_forced_cache(tmp_path, monkeypatch):
    target = make_target(tmp_path / "target", layers=4)
    data = write_jsonl(tmp_path / "data.jsonl", random_records(24, seed=3, max_len=40))
    clean = tmp_path / "clean"
    extract(target, data, clean)
    out = tmp_path / "cache"
    extract(target, data, out)  # an old cache of the same settings: rank 1 alone would join it
    old_parts = {p.name for p in read_manifest(out).parts}
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-17")  # what torchrun gives both ranks
    rank1 = start(target, data, out, "--force", "--rank", "1", "--world-size", "2", sleep=0.0)
    time.sleep(6)  # rank 1 opens the old cache first and waits there
    assert rank1.poll() is None, rank1.communicate()[0]
    extract(target, data, out, force=True, rank=0, world_size=2)
    output, _ = rank1.communicate(timeout=120)
    assert rank1.returncode == 0, output
    manifest = read_manifest(out)
    assert manifest.header["provenance"]["forced_run"] == "run-17"
    assert {p.name for p in manifest.parts} == old_parts  # the same parts, each written anew once
    assert_same_contents(cache_contents(out), cache_contents(clean))


def test_a_forced_rank_without_a_run_id_waits_for_a_header_it_can_join(tmp_path):
    target = make_target(tmp_path / "target", layers=4)
    data = write_jsonl(tmp_path / "data.jsonl", random_records(24, seed=3, max_len=40))
    out = tmp_path / "cache"
    extract(target, write_jsonl(tmp_path / "old.jsonl", random_records(6, seed=8)), out, part_tokens=60)
    rank1 = start(target, data, out, "--force", "--rank", "1", "--world-size", "2", sleep=0.0)
    time.sleep(6)  # other settings in the old cache: rank 1 waits instead of refusing
    assert rank1.poll() is None, rank1.communicate()[0]
    extract(target, data, out, force=True, rank=0, world_size=2)
    output, _ = rank1.communicate(timeout=120)
    assert rank1.returncode == 0, output
    extract(target, data, tmp_path / "clean")
    assert_same_contents(cache_contents(out), cache_contents(tmp_path / "clean"))
