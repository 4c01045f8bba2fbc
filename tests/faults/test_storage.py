"""Storage faults: a full disk mid-part, a read-only output, damaged parts and manifests, a
stale temporary part, and two extractions started on one cache at once."""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import zarr
from click.testing import CliRunner
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.errors import CacheCorruptError, CacheNotFoundError
from dflash.cache_tools.reader import CacheReader
from dflash.extract.cli import main as extract_main
from dflash.train.cli import main as train_main
from dflash.train.data.loader import sample_tensors

from .helpers import (
    cache_hash,
    committed_parts,
    extract_argv,
    temp_parts,
    train_config_file,
    weights_hash,
)


def extract(world, out, *extra):
    return CliRunner().invoke(extract_main, extract_argv(world["target"], world["data"], out, *extra))


def train(world, cache, out, tmp_path, **overrides):
    config = train_config_file(tmp_path / "train.json", cache, world["target"], **overrides)
    return CliRunner().invoke(train_main, ["--config", str(config), "--output-dir", str(out)])


def copy_cache(world, dst: Path) -> Path:
    shutil.copytree(world["cache"], dst)
    return dst


def mount(*args: str) -> None:
    """Run mount(8); skip when this machine does not allow it (tests and CI run as root, where
    mounting works; chmod cannot be used instead, since root writes through it)."""
    res = subprocess.run(["mount", *args], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"mount is not permitted here ({res.stderr.strip()}); the injected faults cover the rest")


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *, read_only: bool = False):
    """A small tmpfs at `path`."""
    path.mkdir(parents=True, exist_ok=True)
    mount("-t", "tmpfs", "-o", f"size={size}" + (",ro" if read_only else ""), "tmpfs", str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# -- a full disk -----------------------------------------------------------------------------


def test_disk_full_mid_part_is_one_clear_error_and_a_rerun_completes(world, tmp_path, monkeypatch):
    """An injected ENOSPC while the fourth part's arrays are being written."""
    out = tmp_path / "cache"
    real_create = zarr.create_array
    arrays: dict[str, int] = {}  # arrays created per part, parts in the order they are written

    def create_array(store, *args, **kwargs):
        name = re.search(r"part-\d{6}", str(getattr(store, "root", store))).group(0)
        arrays[name] = arrays.get(name, 0) + 1
        if len(arrays) == 4 and arrays[name] == 2:  # the 2nd array of the fourth part
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_create(store, *args, **kwargs)

    monkeypatch.setattr(zarr, "create_array", create_array)
    res = extract(world, out)
    assert res.exit_code == 2, res.output
    started = list(arrays)  # (a sort window's batch order)
    assert len(started) == 4, res.output
    assert (f"Error: Writing part {started[3]} into {out} failed: [Errno 28] No space left on device. "
            "Free space or fix the cause, then rerun the same command: committed parts are kept and "
            "the rest is redone.") in res.output
    assert "Traceback" not in res.output
    assert sorted(committed_parts(out)) == sorted(started[:3])
    assert temp_parts(out) == []  # the half-written part was discarded
    monkeypatch.setattr(zarr, "create_array", real_create)
    res = extract(world, out)
    assert res.exit_code == 0, res.output
    assert cache_hash(out) == world["cache_hash"]


def test_real_full_tmpfs_stops_with_a_clear_error_and_resumes_after_space_is_freed(world, tmp_path):
    with tmpfs(tmp_path / "small", "160k") as mnt:
        out = mnt / "cache"
        res = extract(world, out)
        assert res.exit_code == 2, res.output
        assert "No space left on device" in res.output and "Traceback" not in res.output
        assert "then rerun the same command" in res.output
        done = committed_parts(out)
        assert 0 < len(done) < 16
        reader = CacheReader(out)  # everything committed reads back clean
        for i in range(len(reader)):
            reader.read_sample(i)
        mount("-o", "remount,size=16m", str(mnt))
        res = extract(world, out)
        assert res.exit_code == 0, res.output
        assert cache_hash(out) == world["cache_hash"]


# -- a read-only output ----------------------------------------------------------------------


def test_extract_into_a_read_only_location_is_a_clear_error(world, tmp_path):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as mnt:
        res = extract(world, mnt / "cache")
        assert res.exit_code == 2, res.output
        assert (f"Error: Cannot create the cache directory {mnt / 'cache'}: Read-only file system. Choose a "
                "writable location with free space.") in res.output


def test_resume_of_a_cache_on_a_read_only_mount_is_a_clear_error_and_keeps_it(world, tmp_path):
    cache = tmp_path / "cache"
    extract(world, cache, "--part-tokens", "300")
    log = cache / "manifest.parts.jsonl"  # keep 2 parts committed: the resume has work to do
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:2]))
    before = cache_hash(cache)
    mount("--bind", str(cache), str(cache))
    try:
        mount("-o", "remount,ro,bind", str(cache))
        res = extract(world, cache, "--part-tokens", "300")
        assert res.exit_code == 2, res.output
        assert "Traceback" not in res.output
        assert f"Error: Cannot write to the cache at {cache}" in res.output
        assert "Read-only file system" in res.output
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=False)
    assert len(committed_parts(cache)) == 2 and cache_hash(cache) == before  # untouched


def test_train_into_a_read_only_output_dir_is_a_clear_error(world, tmp_path):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as mnt:
        res = train(world, world["cache"], mnt / "run", tmp_path)
        assert res.exit_code == 2, res.output
        text = " ".join(res.output.split())
        assert f"Read-only file system ({mnt / 'run'})" in text and "rerun the same command to resume" in text
        assert "Traceback" not in res.output


# -- damaged parts ---------------------------------------------------------------------------


def shard_file(cache: Path, part: str = "part-000002") -> Path:
    return cache / "parts" / part / "hidden" / "c" / "0" / "0"


@pytest.mark.parametrize("damage", ["bit-flip", "truncation"])
def test_damaged_part_is_named_by_verify_and_stops_the_trainer(world, tmp_path, damage):
    cache = copy_cache(world, tmp_path / "cache")
    shard = shard_file(cache)
    data = bytearray(shard.read_bytes())
    if damage == "bit-flip":
        data[40] ^= 0x10
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    res = CliRunner().invoke(cache_main, ["verify", str(cache), "--no-progress"])
    assert res.exit_code == 1 and "part-000002" in res.output, res.output
    for workers in (0, 2):
        run = train(world, cache, tmp_path / f"run-{workers}", tmp_path, num_workers=workers)
        assert run.exit_code == 2, run.output
        assert "Error: cache part 'part-000002' (array hidden" in run.output
        assert "dflash-cache verify" in run.output
        assert "Traceback" not in run.output, run.output
        assert multiprocessing.active_children() == []  # the failed run's loader workers are gone


# -- damaged or missing manifests ------------------------------------------------------------


def damage_manifest(cache: Path, how: str) -> None:
    if how == "header deleted":
        (cache / "manifest.json").unlink()
    elif how == "header corrupted":
        (cache / "manifest.json").write_text('{"format_version": 1, "target": ')
    elif how == "commit log corrupted":
        log = cache / "manifest.parts.jsonl"
        lines = log.read_text().splitlines(keepends=True)
        lines[3] = lines[3].replace('"samples":', '"samples": 9, "x":')
        log.write_text("".join(lines))


MANIFEST_ERRORS = {
    "header deleted": "is not a dflash cache: it has no manifest.json",
    "header corrupted": "manifest.json is not valid JSON",
    "commit log corrupted": "line 4: the commit record is damaged",
}
MANIFEST_FINDINGS = {  # the reader's error: its code and the file (and line) it names
    "header deleted": (CacheNotFoundError, "cache.no-manifest", "manifest", "manifest.json"),
    "header corrupted": (CacheCorruptError, "cache.manifest-not-json", "file", "{cache}/manifest.json"),
    "commit log corrupted": (CacheCorruptError, "cache.commit-record-checksum", "where",
                             "{cache}/manifest.parts.jsonl, line 4"),
}


@pytest.mark.parametrize("how", list(MANIFEST_ERRORS))
def test_damaged_manifest_is_a_clear_error_for_reader_verify_resume_and_trainer(world, tmp_path, how):
    cache = copy_cache(world, tmp_path / "cache")
    damage_manifest(cache, how)
    expected = MANIFEST_ERRORS[how]
    with pytest.raises((CacheNotFoundError, CacheCorruptError)) as refused:
        CacheReader(cache)
    kind, code, field, named = MANIFEST_FINDINGS[how]
    assert isinstance(refused.value, kind) and refused.value.code == code and refused.value.fields[field] == named.format(cache=cache), refused.value.fields
    res = CliRunner().invoke(cache_main, ["verify", str(cache), "--no-progress"])
    assert res.exit_code != 0 and expected in res.output.replace("\n", " "), res.output
    res = extract(world, cache)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    if how == "header deleted":  # the parts are still there: resume refuses to write over them
        assert "is not empty and holds no cache manifest: refusing" in res.output
    else:
        assert expected in res.output
    run = train(world, cache, tmp_path / "run", tmp_path)
    assert run.exit_code == 2 and "Traceback" not in run.output, run.output
    assert expected in run.output.replace("\n", " ")
    assert sorted(p.name for p in (cache / "parts").iterdir()) == sorted(
        p.name for p in (world["cache"] / "parts").iterdir())  # nothing was deleted


# -- a stale temporary part ------------------------------------------------------------------


def test_stale_temporary_part_of_a_crashed_run_is_removed_and_counted_at_the_next_open(world, tmp_path):
    cache = copy_cache(world, tmp_path / "cache")
    log = cache / "manifest.parts.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:-1]))  # the last part was never committed ...
    last = committed_parts(world["cache"])[-1]
    stale = cache / "parts" / f".tmp-{last}.4242.deadbeef"
    shutil.copytree(cache / "parts" / last, stale)  # ... its writer died mid-write
    stale.with_name(stale.name + ".lock").touch()
    shutil.rmtree(cache / "parts" / last)
    assert CacheReader(cache).manifest.num_samples < 60  # readers never see it
    res = extract(world, cache)
    assert res.exit_code == 0, res.output
    assert "1 leftover(s) of interrupted writers" in res.output
    assert temp_parts(cache) == []
    assert cache_hash(cache) == world["cache_hash"]


# -- two extractions at once -----------------------------------------------------------------


def test_two_extractions_started_on_one_cache_at_once_equal_a_single_run(zygote, world, tmp_path):
    out = tmp_path / "cache"
    env = {"DFLASH_TEST_SLEEP_BEFORE_COMMIT": "0.01"}
    runs = [zygote.run("extract", extract_argv(world["target"], world["data"], out), env=env) for _ in range(2)]
    for run in runs:
        assert run.wait() == 0, run.output()
    lines = (out / "manifest.parts.jsonl").read_text().splitlines()
    names = [json.loads(line.rsplit(" ", 1)[0])["part"] for line in lines]
    assert sorted(names) == sorted(committed_parts(world["cache"]))  # each part committed once, by one run
    assert temp_parts(out) == []
    assert cache_hash(out) == world["cache_hash"]


def test_disk_full_during_a_checkpoint_save_is_a_clear_error_and_the_rerun_resumes(world, tmp_path, monkeypatch):
    import dflash.train.run.checkpoint as checkpoint

    out = tmp_path / "run"
    real_save = checkpoint.torch.save
    saves = {"n": 0}

    def save(obj, path, *args, **kwargs):
        saves["n"] += 1
        if saves["n"] == 2 * 2 + 1:  # two files per checkpoint: the third checkpoint's optimizer.pt
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    res = train(world, world["cache"], out, tmp_path)
    assert res.exit_code == 2, res.output
    text = res.output.replace("\n", " ")
    assert "Error: No space left on device (" in text and "optimizer.pt" in text
    assert "rerun the same command to resume" in text and "Traceback" not in text
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004", "step-000008"]
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    res = train(world, world["cache"], out, tmp_path)
    assert res.exit_code == 0, res.output
    assert weights_hash(out) == world["weights_hash"]


def test_a_short_write_of_a_commit_record_fails_the_commit_instead_of_tearing_the_log(world, tmp_path, monkeypatch):
    """On a full disk os.write can write part of a line and return a short count: the commit
    must fail (and the torn bytes go), not report a part that the log does not hold."""
    import os

    from dflash.cache_tools.writer import CacheWriter

    cache = copy_cache(world, tmp_path / "cache")
    log = cache / "manifest.parts.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:-1]))
    before = log.read_bytes()
    last = committed_parts(world["cache"])[-1]
    writer = CacheWriter(cache, json.loads((cache / "manifest.json").read_text()))
    shutil.rmtree(cache / "parts" / last, ignore_errors=True)
    src = CacheReader(world["cache"])
    real_write = os.write

    def short_write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}") == str(log):
            return real_write(fd, bytes(data)[: len(data) // 2])
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", short_write)
    with pytest.raises(OSError, match="commit record"), writer.part_writer(last) as pw:
        for i in range(len(src) - src.parts[-1].samples, len(src)):
            s = sample_tensors(src.read_sample(i))
            pw.add_sample(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden"],
                          top1_ids=s.get("top1_ids"), topk_ids=s.get("topk_ids"),
                          topk_logprobs=s.get("topk_logprobs"))  # (an extraction stores top-1 and top-k)
    monkeypatch.setattr(os, "write", real_write)
    assert not pw.committed
    assert log.read_bytes() == before  # no torn line left behind
    res = extract(world, cache)  # the unrecorded part directory is an orphan: redone
    assert res.exit_code == 0, res.output
    assert cache_hash(cache) == world["cache_hash"]
