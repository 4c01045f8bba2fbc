"""Input data that changes under an extraction (issue #33, bug 9: lines appended during a run were
extracted while the manifest fingerprinted the file before them, and the rerun was refused).

A run reads each file's bytes as they were when it started, hashing them as it reads: the cache
holds what its manifest fingerprints, an append is left out and named, an edit in place is named;
a rerun after an append resumes, one after an edit is refused naming the file."""

from __future__ import annotations

import gzip
import hashlib
import json

import pytest
from conftest import random_records, write_jsonl
from dflash.extract import loop as extract_loop
from dflash.extract import pipeline
from dflash.extract.data import snapshot_data
from dflash.runtime.errors import InputError, MismatchError
from dflash.runtime.records import FileChangedError
from extract_utils import assert_same_contents, cache_contents, extract, make_target, run_cli

EXTRA = [json.dumps(r) + "\n" for r in random_records(6, seed=9, max_len=40)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("t") / "target", layers=4)


def _manifest_files(cache):
    return json.loads((cache / "manifest.json").read_text())["data"]["files"]


def test_lines_appended_during_a_run_are_left_out_and_named_and_the_rerun_resumes(target, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", random_records(16, seed=1, max_len=40))
    original = data.read_bytes()
    clean = tmp_path / "clean"
    extract(target, data, clean)
    submit, extra = extract_loop.ExtractionLoop._submit, list(EXTRA)

    def submit_then_append(self, buf):  # a generator still writing the file the run reads
        submit(self, buf)
        with open(data, "a") as fh:
            fh.write(extra.pop(0) if extra else "")

    monkeypatch.setattr(extract_loop.ExtractionLoop, "_submit", submit_then_append)
    out = tmp_path / "cache"
    first = extract(target, data, out)
    monkeypatch.undo()
    assert data.stat().st_size > len(original)
    assert first.samples == 16 and any(n.code == "extract.data-changed-during-run" and n.fields["file"] == str(data)
                                       for n in first.notes)
    assert_same_contents(cache_contents(out), cache_contents(clean))  # the appended lines are not in it
    entry, = _manifest_files(out)
    assert (entry["bytes"], entry["sha256"]) == (len(original), hashlib.sha256(original).hexdigest())

    again = extract(target, data, out)  # the same command: resumed, not refused, not mixed
    assert again.parts_written == 0 and again.parts_done_before == first.parts_written
    assert any(n.code == "extract.data-grown" and n.fields["file"] == str(data) for n in again.notes)
    assert_same_contents(cache_contents(out), cache_contents(clean))

    forced = extract(target, data, out, force=True)  # the file as it is now
    assert forced.samples > 16 and _manifest_files(out)[0]["bytes"] == data.stat().st_size


def test_a_file_edited_in_place_under_a_run_is_named_exit_2(target, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", random_records(10, seed=2, max_len=40))
    ensure_plan = pipeline.ensure_plan

    def edit_then_plan(cache_dir, files, rules):  # after the fingerprint, before the data is read
        records = [json.loads(line) for line in data.read_text().splitlines()]
        records[3]["input_ids"][0] = (records[3]["input_ids"][0] + 1) % 64
        write_jsonl(data, records)  # the same size, other bytes
        return ensure_plan(cache_dir, files, rules)

    monkeypatch.setattr(pipeline, "ensure_plan", edit_then_plan)
    result = run_cli(["--target-model", target, "--data", data, "--output", tmp_path / "cache",
                      "--dtype", "fp32", "--target-layer-ids", "1,2", "--num-writers", "0"])
    assert result.exit_code == 2, result.output
    assert f"{data} changed while it was read" in result.output and "Traceback" not in result.output


def test_a_file_edited_added_or_removed_between_runs_is_refused_naming_it(target, tmp_path):
    data_dir = tmp_path / "data"
    a = write_jsonl(data_dir / "a.jsonl", random_records(8, seed=3, max_len=40))
    b = write_jsonl(data_dir / "b.jsonl", random_records(8, seed=4, max_len=40))
    out = tmp_path / "cache"
    extract(target, data_dir, out)
    a.write_text(a.read_text().replace("1", "2", 1))
    with pytest.raises(MismatchError) as err:
        extract(target, data_dir, out)
    assert err.value.code == "extract.data-differs"
    assert [(c["file"], c["change"]) for c in err.value.fields["changes"]] == [(str(a), "edited")]
    write_jsonl(a, random_records(8, seed=3, max_len=40))  # restored: resumes
    assert extract(target, data_dir, out).parts_written == 0
    b.unlink()
    c = write_jsonl(data_dir / "c.jsonl", random_records(2, seed=5))
    with pytest.raises(MismatchError) as err:
        extract(target, data_dir, out)
    assert err.value.code == "extract.data-differs"
    assert sorted((c["file"], c["change"]) for c in err.value.fields["changes"]) == [(str(b), "gone"), (str(c), "added")]


def test_a_gzip_file_appended_to_is_read_as_fingerprinted(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl.gz", random_records(5, seed=6), gz=True)
    snap = snapshot_data([data], data)
    with gzip.open(data, "ab") as fh:  # a second gzip member
        fh.write("".join(EXTRA[:2]).encode())
    assert len(list(snap.lines())) == 5 and snap.records == 5
    [changed] = snap.changes_since_start()
    assert changed.code == "extract.data-changed-during-run" and changed.fields["file"] == str(data)
    data.write_bytes(data.read_bytes()[:20])  # truncated below the fingerprinted size
    with pytest.raises(InputError) as err:
        list(snap.lines())
    assert err.value.code == "runtime.file-unreadable" and err.value.fields["file"] == str(data)
    plain = write_jsonl(tmp_path / "p.jsonl", random_records(5, seed=6))
    snap = snapshot_data([plain], plain)
    plain.write_text(plain.read_text()[::-1])
    with pytest.raises(FileChangedError) as err:
        list(snap.lines())
    assert err.value.code == "runtime.file-changed-while-read" and err.value.fields["file"] == str(plain)
