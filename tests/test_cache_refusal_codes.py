"""cache_tools/: refusals of the dflash-cache verbs, the eviction and budget records and a
followed path carry their code and fields (the words are cache_tools/messages.py's)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.errors import CacheCorruptError, CacheError
from dflash.cache_tools.eviction import (
    BUDGET_FILE,
    EVICTION_FILE,
    decode_event,
    encode_event,
    recorded_budget,
)
from dflash.cache_tools.followed import wait_for_plan
from dflash.cache_tools.rewrite import merge_caches
from test_cache_maintenance import make_cache


def test_a_damaged_eviction_record_or_budget_file_names_itself(tmp_path):
    line = encode_event({"part": "part-000000", "event": "evicted"})
    assert decode_event(line, "here")["part"] == "part-000000"
    with pytest.raises(CacheCorruptError) as e:
        decode_event(line.replace(b"evicted", b"restored"), f"{EVICTION_FILE}, line 3")
    assert e.value.code == "cache.eviction-record-damaged" and e.value.fields == {"where": f"{EVICTION_FILE}, line 3"}
    (tmp_path / BUDGET_FILE).write_text("{}")
    with pytest.raises(CacheCorruptError) as e:
        recorded_budget(tmp_path)
    assert e.value.code == "cache.budget-file-damaged" and e.value.fields["file"] == str(tmp_path / BUDGET_FILE)


def test_merge_without_sources_or_with_one_twice_is_refused_by_code(tmp_path):
    with pytest.raises(CacheError) as e:
        merge_caches(tmp_path / "m", [], progress=False)
    assert e.value.code == "cache.merge-no-source"
    make_cache(tmp_path / "a", parts=1)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    with pytest.raises(CacheError) as e:
        merge_caches(tmp_path / "m", [tmp_path / "a", tmp_path / "link"], progress=False)
    assert e.value.code == "cache.source-twice"
    assert e.value.fields == {"src": str(tmp_path / "link"), "also": str(tmp_path / "a")}
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("what", ["file", "foreign"])
def test_following_a_path_that_cannot_become_a_cache_is_refused_at_once(tmp_path, what):
    path = tmp_path / "data.jsonl"
    path.write_text("{}\n")
    if what == "foreign":
        path = tmp_path
    with pytest.raises(CacheError) as e:
        wait_for_plan(path, lambda _: None, start_seconds=60)
    assert e.value.code == {"file": "cache.follow-not-a-directory", "foreign": "cache.follow-foreign-directory"}[what]
    assert e.value.fields["cache"] == str(path)
    if what == "foreign":
        assert e.value.fields["files"] == ["data.jsonl"]


def test_verify_quarantine_of_a_remote_cache_and_upload_to_a_local_path_are_usage_errors(tmp_path):
    res = CliRunner().invoke(cache_main, ["verify", "--quarantine", "s3://bucket/cache"])
    assert res.exit_code == 2 and "s3://bucket/cache" in res.output and "--quarantine" in res.output, res.output
    make_cache(tmp_path / "c", parts=1)
    res = CliRunner().invoke(cache_main, ["upload", str(tmp_path / "c"), str(tmp_path / "elsewhere")])
    assert res.exit_code == 2 and str(tmp_path / "elsewhere") in res.output, res.output
    assert not (tmp_path / "elsewhere").exists()
