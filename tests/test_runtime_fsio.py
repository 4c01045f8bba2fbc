"""The one atomic directory publish and stale-temporary sweeper (dflash.runtime.fsio) that cache
commits, checkpoints and exports share."""

from __future__ import annotations

import pytest
from dflash.runtime.fsio import file_lock, staged_dir, stale_temps, sweep_stale_temps, temp_name


def test_a_staged_directory_replaces_the_old_one_only_when_complete(tmp_path):
    final = tmp_path / "out"
    with staged_dir(final) as stage:
        (stage / "a").write_text("old")
    with pytest.raises(RuntimeError), staged_dir(final) as stage:
        (stage / "a").write_text("half")
        raise RuntimeError("killed midway")
    assert (final / "a").read_text() == "old"  # the failed write left the old directory as it was
    with staged_dir(final) as stage:
        (stage / "a").write_text("new")
    assert (final / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or old copy left


def test_the_sweeper_removes_dead_writers_temporaries_and_keeps_live_ones(tmp_path):
    dead = temp_name(tmp_path / "part-1")
    dead.mkdir()
    (tmp_path / f"{dead.name}.lock").touch()  # its writer died: nobody holds the lock
    live = temp_name(tmp_path / "part-2")
    live.mkdir()
    (tmp_path / "part-0").mkdir()  # not a temporary: never touched
    with file_lock(tmp_path / f"{live.name}.lock"):
        assert stale_temps(tmp_path) == sorted([dead, tmp_path / f"{dead.name}.lock"])
        sweep_stale_temps(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["part-0", live.name, f"{live.name}.lock"])
    sweep_stale_temps(tmp_path)  # its writer is gone now
    assert [p.name for p in tmp_path.iterdir()] == ["part-0"]
