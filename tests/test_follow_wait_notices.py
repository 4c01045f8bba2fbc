"""A --follow run that waits (for the extraction plan, for a part not yet committed, for a part
evicted under a disk budget) says what it waits for as a finding: the cache, the part, what the
extraction has done and what ends the wait are fields; the words are cache_tools/messages.py's."""

from __future__ import annotations

import pytest
from dflash.cache_tools.errors import CacheError
from dflash.cache_tools.eviction import PartState
from dflash.cache_tools.followed import FollowCacheSet, announce_wait, wait_for_plan
from dflash.runtime.findings import Finding, collected, render
from test_sample_sources import planned_cache


@pytest.mark.parametrize("where, state", [("no-such-directory", "no-directory"), ("parts-only", "no-header")])
def test_a_wait_for_the_plan_says_at_once_what_it_waits_for_and_until_when(tmp_path, where, state):
    path = tmp_path / "cache"
    if where == "parts-only":
        (path / "parts").mkdir(parents=True)
    said: list[Finding] = []
    with pytest.raises(CacheError):  # (refused once the start wait is over)
        wait_for_plan(path, said.append, start_seconds=0.3)
    assert said[0].code == "cache.follow-waiting-for-plan"
    assert (said[0].fields["cache"], said[0].fields["state"], said[0].fields["limit"]) == (str(path), state, 0)
    assert render(said[0]).startswith(f"--follow: waiting for the extraction plan of {path}")


def test_a_wait_for_a_part_names_it_the_extractions_progress_and_what_ends_it(tmp_path):
    follow = FollowCacheSet(str(planned_cache(tmp_path / "cache")), max_seq_len=40, announce=lambda f: None)
    name = follow.part_names()[1]
    waiting = follow._wait_notice(name, 31.4, None)
    assert waiting.code == "cache.follow-waiting-for-part"
    assert waiting.fields == {"part": name, "cache": str(tmp_path / "cache"), "waited": 31, "committed": 3,
                              "planned": 3, "running": False}
    assert "rerun dflash-extract to resume it" in render(waiting)  # no extraction writes it: what ends the wait
    evicted = follow._wait_notice(name, 30.0, PartState(evicted=True, epoch=2, reextract=False))
    assert evicted.code == "cache.follow-waiting-for-evicted"
    assert (evicted.fields["part"], evicted.fields["epoch"], evicted.fields["reextract"]) == (name, 2, False)


def test_the_default_announce_emits_the_wait_as_a_finding(tmp_path, capsys):
    with collected() as got, pytest.raises(CacheError):
        wait_for_plan(tmp_path / "none", announce_wait, start_seconds=0.2)
    assert [f.code for f in got][:1] == ["cache.follow-waiting-for-plan"]
    assert capsys.readouterr().out.startswith(str(got[0]) + "\n")  # its paragraph, alone on stdout, as before
