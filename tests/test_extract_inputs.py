"""Bad input gets one clear paragraph naming file and line, or a counted skip."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_target, random_records, write_jsonl
from dflash.cache_tools.manifest import read_manifest
from extract_utils import cache_contents, make_target, run_cli

GOOD = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("inputs") / "model", "qwen3", layers=4)


def extract(target, data, out, *extra):
    return run_cli(["--target-model", target, "--data", data, "--output", out, "--dtype", "fp32",
                    "--target-layer-ids", "1,2", *extra])


BAD_LINES = [
    ("{not json", "the line is not valid JSON"),
    ('{"input_ids": [1, 2], "loss_mask": [1, 1]', "the line is not valid JSON"),
    ('"just a string"', "the record must be a JSON object"),
    ('{"input_ids": "1 2 3", "loss_mask": [1, 1, 1]}', "input_ids must be a list of integers"),
    ('{"input_ids": [1, 2.5], "loss_mask": [1, 1]}', "input_ids must be a flat list of integers"),
    ('{"input_ids": [1, 128], "loss_mask": [1, 1]}',
     "token id 128 is outside the target's vocabulary (128 entries)"),
    ('{"input_ids": [1, -3], "loss_mask": [1, 1]}', "token id -3 is negative"),
    ('{"input_ids": [], "loss_mask": []}', "the sample is empty"),
    ('{"input_ids": [1, 2]}', "the record has no loss mask: give loss_mask, labels or prompt_len"),
    ('{"loss_mask": [1, 1]}', "the record has no input_ids"),
    ('{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}', "loss_mask has 2 entries but input_ids has 3"),
    ('{"input_ids": [1, 2, 3], "loss_mask": [1, 2, 1]}', "loss_mask must hold only 0 and 1"),
    ('{"input_ids": [1, 2, 3], "labels": [-100, 2]}', "labels has 2 entries but input_ids has 3"),
    ('{"input_ids": [1, 2, 3], "prompt_len": 4}', "prompt_len must be an integer between 0 and 3"),
]


@pytest.mark.parametrize("line,message", BAD_LINES, ids=[m for _l, m in BAD_LINES])
def test_malformed_record_names_file_and_line(target, tmp_path, line, message):
    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps(GOOD) + "\n\n" + line + "\n" + json.dumps(GOOD) + "\n")
    res = extract(target, data, tmp_path / "cache")
    assert res.exit_code == 2
    assert f"{data}, line 3: {message}" in res.output
    assert "--skip-bad" in res.output
    assert "Traceback" not in res.output


def test_non_utf8_bytes_are_reported(target, tmp_path):
    data = tmp_path / "a.jsonl"
    data.write_bytes(json.dumps(GOOD).encode() + b'\n{"input_ids": [1], "id": "\xff\xfe"}\n')
    res = extract(target, data, tmp_path / "cache")
    assert res.exit_code == 2
    assert f"{data}, line 2: the line is not valid UTF-8" in res.output


def test_skip_bad_counts_skips_in_the_manifest(target, tmp_path):
    lines = [json.dumps(GOOD)] + [line for line, _m in BAD_LINES[:6]] + [json.dumps(GOOD)]
    data = tmp_path / "a.jsonl"
    data.write_text("\n".join(lines) + "\n")
    res = extract(target, data, tmp_path / "cache", "--skip-bad")
    assert res.exit_code == 0, res.output
    assert "skipped 6 bad" in res.output
    parts = read_manifest(tmp_path / "cache").parts
    assert sum(p.stats["skipped_bad"] for p in parts) == 6
    skips = [s for p in parts for s in p.stats["skips"]]
    assert [s["where"] for s in skips] == [f"{data}, line {i}" for i in range(2, 8)]
    assert sorted(cache_contents(tmp_path / "cache")) == [0, 7]  # ids still name the lines


@pytest.mark.parametrize("policy,expected_lengths,key", [("truncate", [3, 5, 5], "truncated"),
                                                          ("skip", [3], "skipped_long")])
def test_long_samples_are_truncated_or_skipped_and_counted(target, tmp_path, policy,
                                                           expected_lengths, key):
    recs = [{"input_ids": [1] * n, "prompt_len": 0} for n in (3, 9, 6)]
    data = write_jsonl(tmp_path / "a.jsonl", recs)
    res = extract(target, data, tmp_path / "cache", "--max-seq-len", 5, "--long-samples", policy)
    assert res.exit_code == 0, res.output
    manifest = read_manifest(tmp_path / "cache")
    cached = cache_contents(tmp_path / "cache")
    assert [len(cached[sid]["input_ids"]) for sid in sorted(cached)] == expected_lengths
    assert sorted(n for p in manifest.parts for n in p.lengths) == sorted(expected_lengths)
    assert sum(p.stats[key] for p in manifest.parts) == 2


def test_directory_of_plain_and_gzip_files_in_sorted_order(target, tmp_path):
    recs = random_records(6, seed=4)
    write_jsonl(tmp_path / "d" / "b.jsonl.gz", recs[3:], gz=True)
    write_jsonl(tmp_path / "d" / "a.jsonl", recs[:3])
    res = extract(target, tmp_path / "d", tmp_path / "cache")
    assert res.exit_code == 0, res.output
    cached = cache_contents(tmp_path / "cache")
    for sid, rec in enumerate(recs):
        assert cached[sid]["input_ids"].tolist() == rec["input_ids"]


def test_a_directory_reached_twice_through_links_is_read_once_and_said(target, tmp_path):
    recs = random_records(5, seed=6)
    write_jsonl(tmp_path / "d" / "v2" / "train.jsonl", recs)
    (tmp_path / "d" / "latest").symlink_to("v2")  # a second path to the same directory
    (tmp_path / "d" / "v2" / "self").symlink_to(".")  # a loop
    (tmp_path / "d" / "again.jsonl").symlink_to(tmp_path / "d" / "v2" / "train.jsonl")  # a second path to a file
    res = extract(target, tmp_path / "d", tmp_path / "cache")
    assert res.exit_code == 0, res.output
    cached = cache_contents(tmp_path / "cache")
    assert sorted(c["input_ids"].tolist() for c in cached.values()) == sorted(r["input_ids"] for r in recs)
    assert "through symbolic links" in res.output and "read that data once" in res.output


def test_empty_directory_and_missing_paths_are_clear_errors(target, tmp_path):
    (tmp_path / "empty").mkdir()
    res = extract(target, tmp_path / "empty", tmp_path / "c1")
    assert res.exit_code == 2 and "holds no data files" in res.output
    res = extract(target, tmp_path / "nope.jsonl", tmp_path / "c2")
    assert res.exit_code == 2 and "does not exist" in res.output
    data = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    res = extract(tmp_path / "noweights", data, tmp_path / "c3")
    assert res.exit_code == 2 and "no weights" in res.output
    res = extract(tmp_path, data, tmp_path / "c4")
    assert res.exit_code == 2 and "no config.json" in res.output


def test_config_file_sets_flags_and_rejects_unknown_keys(target, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    cfg = tmp_path / "extract.json"
    cfg.write_text(json.dumps({"target-model": str(target), "data": str(data),
                               "output": str(tmp_path / "cache"), "dtype": "fp32",
                               "target_layer_ids": [0, 2]}))
    res = run_cli(["--config", cfg, "--target-layer-ids", "1,2"])  # the flag wins
    assert res.exit_code == 0, res.output
    assert read_manifest(tmp_path / "cache").target_layer_ids == [1, 2]
    cfg.write_text(json.dumps({"data": str(data), "tokens_budget": 5}))
    res = run_cli(["--config", cfg])
    assert res.exit_code == 2 and "unknown setting(s) tokens_budget" in res.output


@pytest.mark.parametrize("policy", ["truncate", "skip"])
def test_samples_past_the_targets_positions_are_held_to_them_and_said(tmp_path, policy):
    short = make_tiny_target(tmp_path / "model", layers=4, max_positions=16)  # --max-seq-len stays 8192
    data = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1] * n, "prompt_len": 0} for n in (8, 40, 16, 17)])
    res = extract(short, data, tmp_path / "cache", "--long-samples", policy)
    assert res.exit_code == 0, res.output
    manifest = read_manifest(tmp_path / "cache")
    cached = cache_contents(tmp_path / "cache")
    lengths = {sid: len(c["input_ids"]) for sid, c in cached.items()}
    assert lengths == ({0: 8, 1: 16, 2: 16, 3: 16} if policy == "truncate" else {0: 8, 2: 16})
    assert manifest.header["settings"]["max_seq_len"] == 16  # the length the samples were held to
    key = "truncated" if policy == "truncate" else "skipped_long"
    assert sum(p.stats[key] for p in manifest.parts) == 2
    assert "2 samples longer than the target's 16 positions (max_position_embeddings 16 of its config)" in res.output
    if policy == "skip":
        reasons = {s["sample_id"]: s["reason"] for p in manifest.parts for s in p.stats["skips"]}
        assert reasons == {1: "40 tokens > the target's 16 positions (max_position_embeddings 16 of its config)",
                           3: "17 tokens > the target's 16 positions (max_position_embeddings 16 of its config)"}


def test_a_rope_scaling_factor_extends_the_positions_samples_are_held_to(tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    scaled = make_tiny_target(tmp_path / "model", family="llama", layers=4, max_positions=16, rope_parameters=yarn)
    data = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1] * n, "prompt_len": 0} for n in (40, 70)])
    res = extract(scaled, data, tmp_path / "cache")
    assert res.exit_code == 0, res.output
    assert sorted(len(c["input_ids"]) for c in cache_contents(tmp_path / "cache").values()) == [40, 64]
    assert "rope_scaling yarn x4 of 16" in res.output


def test_a_cache_extracted_past_the_targets_positions_is_refused_on_resume_naming_why(tmp_path, monkeypatch):
    from dflash.extract import pipeline

    short = make_tiny_target(tmp_path / "model", layers=4, max_positions=16)
    data = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1] * n, "prompt_len": 0} for n in (8, 40)])
    with monkeypatch.context() as m:  # an extraction that did not read the target's positions
        m.setattr(pipeline, "target_positions", lambda config: None)
        assert extract(short, data, tmp_path / "cache").exit_code == 0
    before = (tmp_path / "cache" / "manifest.parts.jsonl").read_text()
    res = extract(short, data, tmp_path / "cache")
    assert res.exit_code == 2
    assert "was extracted with max_seq_len 8192, more than the target's 16 positions" in res.output
    assert "--force" in res.output and "Traceback" not in res.output
    assert (tmp_path / "cache" / "manifest.parts.jsonl").read_text() == before  # nothing touched
    res = extract(short, data, tmp_path / "cache", "--force")
    assert res.exit_code == 0, res.output
    assert sorted(len(c["input_ids"]) for c in cache_contents(tmp_path / "cache").values()) == [8, 16]


def write_json_documents(d):
    """What a data directory often holds beside its data: not JSON Lines."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "stats.json").write_text(json.dumps({"records": 6, "tokens": 300}, indent=2) + "\n")
    (d / "dataset_info.json").write_text(json.dumps({"features": {"input_ids": "list"}, "num_rows": 6}) + "\n")
    (d / "ids.json").write_text(json.dumps([{"input_ids": [1, 2], "prompt_len": 0}]) + "\n")


@pytest.mark.parametrize("extra", [[], ["--skip-bad"]], ids=["plain", "skip-bad"])
def test_json_documents_beside_the_data_are_left_out_and_named_while_json_lines_named_json_are_read(
        target, tmp_path, extra):
    recs = random_records(6, seed=8)
    write_jsonl(tmp_path / "d" / "a.json", recs[:2])  # JSON Lines named .json, as Dataset.to_json writes
    write_jsonl(tmp_path / "d" / "train.jsonl", recs[2:])
    write_json_documents(tmp_path / "d")
    res = extract(target, tmp_path / "d", tmp_path / "cache", *extra)
    assert res.exit_code == 0, res.output
    cached = cache_contents(tmp_path / "cache")
    assert {sid: c["input_ids"].tolist() for sid, c in cached.items()} == {
        sid: rec["input_ids"] for sid, rec in enumerate(recs)}  # nothing mixed in, the ids name the data's lines
    manifest = read_manifest(tmp_path / "cache")
    assert [f["path"] for f in manifest.header["data"]["files"]] == ["a.json", "train.jsonl"]
    assert sum(p.stats["skipped_bad"] for p in manifest.parts) == 0
    assert "left out 3 .json files that are not JSON Lines of records" in res.output
    assert "stats.json, one JSON document spanning 4 lines (an object with keys records, tokens)" in res.output
    assert "dataset_info.json, line 1 is an object with keys features, num_rows, not a record" in res.output
    assert "ids.json, one JSON document on line 1 (an array of 1 item)" in res.output


def test_a_json_document_given_as_data_or_alone_in_its_directory_is_a_clear_error(target, tmp_path):
    write_json_documents(tmp_path / "d")
    res = extract(target, tmp_path / "d" / "stats.json", tmp_path / "c1")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert (f"{tmp_path / 'd' / 'stats.json'} is not JSON Lines of records: one JSON document spanning 4 lines"
            in res.output)
    res = extract(target, tmp_path / "d" / "dataset_info.json", tmp_path / "c2")
    assert res.exit_code == 2 and "line 1 is an object with keys features, num_rows, not a record" in res.output
    res = extract(target, tmp_path / "d", tmp_path / "c3")
    assert res.exit_code == 2 and "holds no data files" in res.output and "stats.json, one JSON document" in res.output
    assert not (tmp_path / "c1").exists() and not (tmp_path / "c3").exists()
    lines = write_jsonl(tmp_path / "one.json", [GOOD, GOOD])  # JSON Lines named .json, given as --data
    assert extract(target, lines, tmp_path / "c4").exit_code == 0


def test_a_jsonl_file_that_is_one_json_document_is_refused_naming_it(target, tmp_path):
    write_jsonl(tmp_path / "d" / "a.jsonl", [GOOD])
    (tmp_path / "d" / "b.jsonl").write_text(json.dumps([GOOD, GOOD], indent=2) + "\n")
    res = extract(target, tmp_path / "d", tmp_path / "cache", "--skip-bad")  # not a line of it is read
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"{tmp_path / 'd' / 'b.jsonl'} is not JSON Lines of records: one JSON document spanning" in res.output
    assert "Move it out of --data" in res.output


def test_a_cache_that_read_a_json_document_as_data_is_not_resumed_without_it_silently(target, tmp_path, monkeypatch):
    from dflash.extract import data as extract_data

    write_jsonl(tmp_path / "d" / "train.jsonl", random_records(3, seed=9))
    write_json_documents(tmp_path / "d")
    with monkeypatch.context() as m:  # a scan that read every .json file as data
        m.setattr(extract_data, "json_document", lambda path, records_only=False: None)
        assert extract(target, tmp_path / "d", tmp_path / "cache", "--skip-bad").exit_code == 0
    res = extract(target, tmp_path / "d", tmp_path / "cache", "--skip-bad")
    assert res.exit_code == 2
    assert (f"{tmp_path / 'd' / 'stats.json'} was extracted into the cache, but the scan of --data leaves it out "
            "as not JSON Lines of records (one JSON document spanning 4 lines") in res.output
    assert "--force" in res.output
