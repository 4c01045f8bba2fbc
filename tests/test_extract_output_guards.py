"""An extraction's --output among its inputs (issue #33, bug 10): a cache kept inside its --data
directory is not read as data (its manifest and part metadata are .json files), so the rerun of
the same command resumes and --force re-extracts; an --output that is the data is refused."""

from __future__ import annotations

import pytest
from conftest import random_records, write_jsonl
from dflash.runtime.locks import OutputIsInputError
from extract_utils import assert_same_contents, cache_contents, extract, make_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("t") / "target", layers=4)


def test_a_cache_inside_its_data_directory_is_not_read_as_data(target, tmp_path):
    data_dir = tmp_path / "data"
    write_jsonl(data_dir / "a.jsonl", random_records(12, seed=1, max_len=40))
    (tmp_path / "elsewhere").mkdir()
    clean = tmp_path / "elsewhere" / "cache"
    extract(target, data_dir, clean)
    inside = data_dir / "cache"
    first = extract(target, data_dir, inside)
    assert first.parts_written > 1
    assert_same_contents(cache_contents(inside), cache_contents(clean))
    again = extract(target, data_dir, inside)  # the same command: nothing left to do, no mismatch
    assert again.parts_written == 0 and again.parts_done_before == first.parts_written
    kept = extract(target, data_dir, inside, force=True)  # the same settings: resumed, nothing deleted
    assert kept.parts_written == 0 and kept.parts_done_before == first.parts_written
    forced = extract(target, data_dir, inside, force=True, part_tokens=97)  # other settings: anew, and completes
    assert forced.parts_written > 1 and forced.parts_done_before == 0
    # (against a clean extraction of the same settings: other parts batch the samples otherwise, and
    # a float32 forward of another batch may round one value to another bf16)
    extract(target, data_dir, tmp_path / "elsewhere" / "cache-97", part_tokens=97)
    assert_same_contents(cache_contents(inside), cache_contents(tmp_path / "elsewhere" / "cache-97"))
    # also a cache of another run (not this --output) inside the directory is skipped
    assert extract(target, data_dir, tmp_path / "elsewhere" / "second").samples == 12


@pytest.mark.parametrize("which", ["the data file", "the data directory", "a link to the data"])
def test_an_output_that_is_the_data_is_refused(target, tmp_path, which):
    data = write_jsonl(tmp_path / "data" / "a.jsonl", random_records(4, seed=1))
    before = data.read_bytes()
    out = {"the data file": data, "the data directory": data.parent}.get(which)
    if which == "a link to the data":
        (tmp_path / "link").symlink_to(data)
        out = tmp_path / "link"
    with pytest.raises(OutputIsInputError) as e:
        extract(target, data if which != "the data directory" else data.parent, out)
    assert e.value.code == "runtime.output-is-input" and e.value.fields["output"] == str(out)
    assert data.read_bytes() == before
