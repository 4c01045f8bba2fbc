"""A hand-edited manifest is named as the damaged file, with the fix (issue #33, weak spot: a
header of the wrong types ended in a KeyError or ValueError traceback, one whose fields disagree
made verify blame every part; an edited commit record told to "re-extract that part" with no
command to do it)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.errors import CacheCorruptError
from dflash.cache_tools.manifest import LOG_FILE
from dflash.cache_tools.reader import CacheReader
from test_cache_cli import make_cache

EDITS = {  # the edit, the paragraph's words, and the finding's key and problem code
    "hidden_size is a string": (lambda h: h["hidden"].update(hidden_size="32x"),
                                "hidden.hidden_size is '32x', not a positive integer", "hidden.hidden_size",
                                "not-positive"),
    "chunk_rows removed": (lambda h: h["hidden"].pop("chunk_rows"), "hidden.chunk_rows is None", "hidden.chunk_rows",
                           "not-positive"),
    "extras null": (lambda h: h.update(extras=None), "extras is None, not an object", "extras", "not-an-object"),
    "layers as text": (lambda h: h.update(target_layer_ids="1,5"),
                       "target_layer_ids is '1,5', not a list of layer numbers", "target_layer_ids", "not-layer-ids"),
    "a layer dropped alone": (lambda h: h.update(target_layer_ids=[1]),
                              "hidden.num_layers is 2, but target_layer_ids names 1 layers", "hidden.num_layers",
                              "layer-count"),
    "codec renamed alone": (lambda h: h["hidden"]["codec"].update(name="fp8"),
                            "hidden.storage_dtype is 'uint16', but the codec fp8 stores uint8", "hidden.storage_dtype",
                            "storage-dtype"),
    "codec unknown": (lambda h: h["hidden"]["codec"].update(name="zzz"), "hidden.codec: Unknown codec 'zzz'",
                      "hidden.codec", "codec-refused"),
    "topk a string": (lambda h: h["extras"].update(topk="x"), "extras.topk is 'x', not a count", "extras.topk",
                      "not-a-count"),
}


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_hand_edited_header_is_named_as_the_damaged_file(tmp_path, edit):
    cache = tmp_path / "c"
    make_cache(cache)
    change, problem, key, code = EDITS[edit]
    header = json.loads((cache / "manifest.json").read_text())
    change(header)
    (cache / "manifest.json").write_text(json.dumps(header))
    for command in ("info", "verify"):
        res = CliRunner().invoke(cache_main, [command, str(cache)])
        assert res.exit_code == 2, res.output
        text = flat(res.output)
        assert f"Error: {cache / 'manifest.json'} is not a valid cache manifest: {problem}" in text, text
        assert "undo the edit or restore manifest.json from a backup" in text and "Traceback" not in text
    with pytest.raises(CacheCorruptError) as err:
        CacheReader(cache)
    assert err.value.code == "cache.manifest-invalid" and err.value.fields["file"] == str(cache / "manifest.json")
    assert (err.value.fields["key"], err.value.fields["problem"]) == (key, code)


def test_a_hand_edited_commit_record_names_the_log_line_and_the_command_that_repairs_it(tmp_path):
    cache = tmp_path / "c"
    make_cache(cache, parts=3)
    lines = (cache / LOG_FILE).read_text().splitlines(keepends=True)
    lines[1] = lines[1].replace('"samples":3', '"samples":4')
    (cache / LOG_FILE).write_text("".join(lines))
    with pytest.raises(CacheCorruptError) as caught:
        CacheReader(cache)
    # (cache.commit-record-checksum renders the repair: dflash-cache verify --quarantine CACHE)
    assert caught.value.code == "cache.commit-record-checksum"
    assert caught.value.fields == {"where": f"{cache / LOG_FILE}, line 2"}
    res = CliRunner().invoke(cache_main, ["verify", str(cache), "--quarantine", "--no-progress"])
    assert res.exit_code == 1 and "quarantined part-000001 ->" in res.output, res.output
    assert len(CacheReader(cache).parts) == 2  # readable again, without the part it can no longer trust


def test_quarantine_does_not_empty_a_cache_whose_every_part_disagrees_with_an_edited_manifest(tmp_path):
    cache = tmp_path / "c"
    make_cache(cache, parts=3)
    header = json.loads((cache / "manifest.json").read_text())
    header["hidden"]["chunk_rows"] *= 2  # consistent in itself, but no part was written so
    (cache / "manifest.json").write_text(json.dumps(header))
    res = CliRunner().invoke(cache_main, ["verify", str(cache), "--quarantine", "--no-progress"])
    assert res.exit_code != 0 and "Every one of the 3 parts" in res.output and "nothing was moved" in res.output
    assert "quarantined" not in res.output and not (cache / "quarantine").exists()
    assert len((cache / LOG_FILE).read_text().splitlines()) == 3  # every commit record kept
