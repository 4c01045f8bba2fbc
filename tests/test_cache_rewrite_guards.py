"""recompress and merge write their destination alone and never from one source twice, and a
full disk names the part and the cache (issue #33, weak spots: `merge c c` passed without a
word, no lock kept two merges apart, recompress's disk-full error named no path)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from dflash.cache_tools import part_layout
from dflash.cache_tools.cli import main
from dflash.cache_tools.manifest import WRITER_LOCK_FILE
from dflash.cache_tools.reader import CacheReader
from dflash.runtime.locks import WriterLock
from test_cache_cli import make_cache


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("second", ["same", "link", "slash"])
def test_merging_a_cache_with_itself_is_refused(tmp_path, second):
    make_cache(tmp_path / "c")
    other = {"same": tmp_path / "c", "slash": f"{tmp_path / 'c'}/", "link": tmp_path / "l"}[second]
    if second == "link":
        os.symlink(tmp_path / "c", other)
    res = run("merge", tmp_path / "merged", tmp_path / "c", other, "--no-progress")
    assert res.exit_code == 2, res.output
    assert f"The source cache {Path(other)} is given twice" in flat(res.output)
    assert "Traceback" not in res.output and not (tmp_path / "merged").exists()
    make_cache(tmp_path / "d", seed=1)  # two distinct caches still merge
    res = run("merge", tmp_path / "merged", tmp_path / "c", tmp_path / "d", "--no-progress")
    assert res.exit_code == 0, res.output
    assert len(CacheReader(tmp_path / "merged")) == len(CacheReader(tmp_path / "c")) + len(CacheReader(tmp_path / "d"))


@pytest.mark.parametrize("command", ["recompress", "merge"])
@pytest.mark.parametrize("holder", ["exclusive", "shared"])  # another merge; an extraction's writers
def test_a_destination_another_process_writes_is_refused_naming_it(tmp_path, command, holder):
    make_cache(tmp_path / "src")
    dst = tmp_path / "dst"
    argv = ["recompress", tmp_path / "src", dst, "--codec", "fp8"] if command == "recompress" else \
        ["merge", dst, tmp_path / "src"]
    assert run(*argv, "--no-progress").exit_code == 0  # the destination exists and is complete
    with WriterLock(dst / WRITER_LOCK_FILE, purpose="extract", output=dst, shared=holder == "shared"):
        res = run(*argv, "--no-progress")
    assert res.exit_code == 2, res.output
    text = flat(res.output)
    assert f"is being written by another process (pid {os.getpid()} on " in text, text
    assert f"{command} writes the destination cache alone" in text and "Traceback" not in text
    res = run(*argv, "--no-progress")  # the holder gone, the rerun resumes (nothing left to write)
    assert res.exit_code == 0 and "0 parts, 2 already present" in res.output, res.output


def test_a_full_disk_during_recompress_names_the_part_and_the_cache(tmp_path, monkeypatch):
    make_cache(tmp_path / "src", parts=3)
    dst = tmp_path / "dst"
    real, calls = part_layout.write_shards, {"n": 0}

    def write_shards(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second part: a write's OSError carries no file name
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(part_layout, "write_shards", write_shards)
    res = run("recompress", tmp_path / "src", dst, "--codec", "raw", "--no-progress")
    assert res.exit_code == 2, res.output
    assert (f"Error: Writing part part-000001 into {dst} failed: No space left on device. Free space there "
            "(or fix the cause), then rerun the same command: the parts written so far are kept and "
            "skipped.") in flat(res.output)
    monkeypatch.setattr(part_layout, "write_shards", real)
    res = run("recompress", tmp_path / "src", dst, "--codec", "raw", "--no-progress")
    assert res.exit_code == 0 and "Recompressed 2 parts, 1 already present" in res.output, res.output
