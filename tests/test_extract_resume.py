"""Ranks, resume and identity: however the work is split or restarted, the cache is the same."""

from __future__ import annotations

import signal

import pytest
from conftest import random_records, write_jsonl
from dflash.cache_tools.errors import ConfigMismatchError
from dflash.cache_tools.manifest import read_manifest
from dflash.extract.config import ExtractConfig
from dflash.extract.pipeline import STAGED_COPY_ENV, run_extraction
from extract_utils import (
    LAYER_IDS,
    assert_same_contents,
    cache_contents,
    committed_parts,
    make_target,
    start,
    wait_for,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    target = make_target(root / "model", "llama", layers=4)
    data = write_jsonl(root / "data.jsonl", random_records(24, seed=5))
    clean = root / "clean"
    run_extraction(config(target, data, clean))
    return target, data, clean


def config(target, data, out, **kw) -> ExtractConfig:
    base = dict(target_model=str(target), data=str(data), output=str(out), dtype="fp32",
                target_layer_ids=LAYER_IDS, part_tokens=150, token_budget=128, sort_window_tokens=300, progress=False,
                num_writers=0)
    base.update(kw)
    return ExtractConfig(**base)


def test_parts_are_cut_from_the_data_alone(setup):
    _target, _data, clean = setup
    parts = read_manifest(clean).parts
    assert len(parts) > 4
    assert all(p.tokens <= 150 or p.samples == 1 for p in parts)


def test_two_ranks_write_the_same_cache_as_one(setup, tmp_path):
    target, data, clean = setup
    out = tmp_path / "two"
    s0 = run_extraction(config(target, data, out, rank=0, world_size=2))
    s1 = run_extraction(config(target, data, out, rank=1, world_size=2))
    assert s0.parts_written and s1.parts_written
    assert s0.parts_written + s1.parts_written == s0.parts_total
    assert_same_contents(cache_contents(out), cache_contents(clean))


def test_resume_with_other_world_size_finishes_without_duplicates(setup, tmp_path):
    target, data, clean = setup
    out = tmp_path / "resume"
    first = run_extraction(config(target, data, out, rank=1, world_size=3))
    again = run_extraction(config(target, data, out))  # one rank now
    assert again.parts_done_before == first.parts_written
    assert again.parts_written == again.parts_total - first.parts_written
    assert_same_contents(cache_contents(out), cache_contents(clean))
    rerun = run_extraction(config(target, data, out))
    assert rerun.parts_written == 0


def test_writer_processes_write_the_same_cache(setup, tmp_path):
    target, data, clean = setup
    out = tmp_path / "procs"
    run_extraction(config(target, data, out, num_writers=2))
    assert_same_contents(cache_contents(out), cache_contents(clean))


@pytest.mark.parametrize("num_writers", [0, 2])
def test_staged_host_copies_write_the_same_cache(setup, tmp_path, monkeypatch, num_writers):
    """The fallback path (rows through the engine's host slots, then placed by the loop)
    writes what the direct path (rows straight into the part buffers) writes."""
    target, data, clean = setup
    monkeypatch.setenv(STAGED_COPY_ENV, "1")
    out = tmp_path / "staged"
    run_extraction(config(target, data, out, num_writers=num_writers))
    assert_same_contents(cache_contents(out), cache_contents(clean))


@pytest.mark.parametrize("change", [
    {"target_layer_ids": [0, 1]}, {"codec": "fp8"}, {"max_seq_len": 40}, {"dtype": "bf16"},
    {"sort_window_tokens": 300000},
])
def test_resume_with_other_settings_refuses_unless_forced(setup, tmp_path, change):
    target, data, _clean = setup
    out = tmp_path / "c"
    run_extraction(config(target, data, out, part_tokens=100000))
    with pytest.raises(ConfigMismatchError) as e:
        run_extraction(config(target, data, out, part_tokens=100000, **change))
    assert e.value.code == "cache.settings-differ" and e.value.fields["cache"] == str(out)  # renders --force
    assert e.value.fields["purpose"] == "extraction"
    assert any(next(iter(change)) in key for key, _found, _want in e.value.fields["differences"]), e.value.fields
    run_extraction(config(target, data, out, part_tokens=100000, force=True, **change))


def test_force_with_the_same_settings_resumes_and_keeps_every_committed_part(setup, tmp_path):
    target, data, clean = setup
    out = tmp_path / "c"
    first = run_extraction(config(target, data, out))
    committed = {p.name: p.nbytes for p in read_manifest(out).parts}
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "parts").iterdir()}
    again = run_extraction(config(target, data, out, force=True))  # "to be safe": nothing is lost
    assert again.parts_written == 0 and again.parts_done_before == first.parts_written
    assert {p.name: p.nbytes for p in read_manifest(out).parts} == committed
    assert {p.name: p.stat().st_mtime_ns for p in (out / "parts").iterdir()} == stamps  # not written again
    assert_same_contents(cache_contents(out), cache_contents(clean))


def test_a_force_stopped_while_it_deleted_the_old_cache_leaves_one_that_a_rerun_starts_anew(setup, tmp_path):
    import shutil

    from dflash.cache_tools.manifest import HEADER_FILE, LOG_FILE

    target, data, clean = setup
    out = tmp_path / "c"
    run_extraction(config(target, data, out, target_layer_ids=[0, 1]))
    # what a --force to other settings leaves when stopped after the records, before the parts
    (out / LOG_FILE).unlink()
    (out / HEADER_FILE).unlink()
    parts = sorted((out / "parts").iterdir())
    shutil.rmtree(parts[0])
    assert (out / "manifest.plan.json").exists() and len(parts) > 2
    run_extraction(config(target, data, out))  # the same command runs, without a refusal
    assert_same_contents(cache_contents(out), cache_contents(clean))
    assert {p.name for p in (out / "parts").iterdir()} == {p.name for p in read_manifest(out).parts}


def test_force_empties_a_parts_directory_that_links_to_another_disk_and_keeps_the_link(setup, tmp_path):
    target, data, clean = setup
    out, elsewhere = tmp_path / "c", tmp_path / "disk2" / "parts"
    elsewhere.mkdir(parents=True)
    out.mkdir()
    (out / "parts").symlink_to(elsewhere)
    run_extraction(config(target, data, out, target_layer_ids=[0, 1]))
    assert any(elsewhere.iterdir())
    run_extraction(config(target, data, out, force=True))
    assert (out / "parts").is_symlink() and (out / "parts").resolve() == elsewhere.resolve()
    assert_same_contents(cache_contents(out), cache_contents(clean))


def test_resume_with_other_data_refuses(setup, tmp_path):
    target, data, _clean = setup
    out = tmp_path / "c"
    run_extraction(config(target, data, out, part_tokens=100000))
    other = write_jsonl(tmp_path / "other.jsonl", random_records(24, seed=6))
    with pytest.raises(ConfigMismatchError) as e:
        run_extraction(config(target, other, out, part_tokens=100000))
    assert e.value.code == "extract.data-differs"
    assert {c["file"]: c["change"] for c in e.value.fields["changes"]} == {str(other): "added",
                                                                      str(tmp_path / data.name): "gone"}


def test_sigterm_stops_with_status_143_and_keeps_committed_parts(setup, zygote, tmp_path):
    target, data, _clean = setup
    out = tmp_path / "cache"
    proc = start(zygote, target, data, out, sleep=0.5)
    wait_for(lambda: len(committed_parts(out)) >= 1)
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 143, proc.output()
    assert read_manifest(out).parts


def _fork_server_pid():
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def test_writer_fork_server_starts_before_the_target_loads_and_ends_with_the_run(setup, tmp_path, monkeypatch):
    """The writers' fork server imports the writer code while the target loads (the pool then
    only forks), and it does not outlive the run, whether the run ends or fails."""
    from dflash.extract import pipeline

    target, data, clean = setup
    seen = []
    real_load = pipeline.load_target

    def load(*a, **k):
        seen.append(_fork_server_pid())
        return real_load(*a, **k)

    monkeypatch.setattr(pipeline, "load_target", load)
    run_extraction(config(target, data, tmp_path / "a", num_writers=2))
    assert seen and seen[0] is not None  # already running while the target loaded
    assert _fork_server_pid() is None
    assert_same_contents(cache_contents(tmp_path / "a"), cache_contents(clean))

    def broken(*_a, **_k):
        raise RuntimeError("cannot load")

    monkeypatch.setattr(pipeline, "load_target", broken)
    with pytest.raises(RuntimeError, match="cannot load"):
        run_extraction(config(target, data, tmp_path / "b", num_writers=2))
    assert _fork_server_pid() is None
