"""One reader of the input record and its sidecar (runtime/records.py), torch-free, that the
stages agree through: dflash-extract's loss mask and dflash-eval's prompt cut are the same
record read once, and a sidecar written by dflash-prepare is the one extract reads back."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest
from dflash.eval.run import load_prompts
from dflash.extract.data import fingerprint_data
from dflash.runtime.errors import InputError
from dflash.runtime.records import (
    RENDERING_KEYS,
    completion_start,
    json_document,
    parse_record,
    read_rendering,
    read_sidecar,
    write_sidecar,
)

RECORDS = [
    {"input_ids": [4, 5, 6, 7], "prompt_len": 2},
    {"input_ids": [4, 5, 6, 7], "loss_mask": [0, 0, 0, 1]},
    {"input_ids": [4, 5, 6, 7], "labels": [-100, 5, 6, 7]},
    {"input_ids": [4, 5, 6, 7], "labels": [-100, -100, -100, -100], "prompt_len": 1},
    # loss_mask is used before labels and prompt_len, by both readers
    {"input_ids": [4, 5, 6, 7], "loss_mask": [0, 1, 1, 1], "labels": [-100, -100, -100, 7], "prompt_len": 3},
]


def test_the_module_imports_no_torch():
    code = ("import sys, dflash.runtime.records; "
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("record", RECORDS, ids=range(len(RECORDS)))
def test_evals_prompt_ends_where_extracts_loss_starts(tmp_path, record):
    _, mask = parse_record(json.dumps(record).encode(), vocab_size=32)
    first_loss = int(np.argmax(mask)) if mask.any() else None
    assert completion_start(record) == first_loss
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(record) + "\n")
    assert load_prompts(path, 32) == [record["input_ids"][:first_loss]]


def test_a_prepared_sidecar_is_what_extract_reads(tmp_path):
    data = tmp_path / "out.jsonl"
    data.write_text(json.dumps(RECORDS[0]) + "\n")
    meta = {"producer": "dflash-prepare", "chat_template_sha256": "ab" * 32, "loss_on": "assistant",
            "stats": {"records": 1}}
    write_sidecar(data, meta)
    assert read_sidecar(data)["stats"] == {"records": 1}
    rendering = read_rendering(data)
    assert rendering == {k: meta[k] for k in RENDERING_KEYS if k in meta}
    assert fingerprint_data([data], data)["files"][0]["rendering"] == rendering
    assert read_rendering(tmp_path / "none.jsonl") is None


@pytest.mark.parametrize("content", ['{"producer": "dflash-prep', '["not", "an", "object"]'])
def test_a_damaged_sidecar_names_the_file_and_the_fix(tmp_path, content):
    data = tmp_path / "out.jsonl"
    data.write_text(json.dumps(RECORDS[0]) + "\n")
    (tmp_path / "out.jsonl.meta.json").write_text(content)
    with pytest.raises(InputError) as err:
        read_rendering(data)
    assert err.value.code in ("runtime.sidecar-unreadable", "runtime.sidecar-not-object")
    assert err.value.fields["file"] == str(tmp_path / "out.jsonl.meta.json")


def test_a_prompt_line_that_is_not_utf8_is_a_clear_error(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"input_ids": [1]}\n{"input_ids": [1], "id": "\xff"}\n')
    with pytest.raises(InputError) as err:
        load_prompts(path, 32)
    assert err.value.code == "eval.prompt-not-json" and err.value.fields["where"] == f"{path}, line 2"
    assert err.value.fields["error"].startswith("not UTF-8")  # the reason, with the offending byte's offset


JSON_FILES = [  # (content, what it holds as one JSON document, what as records: None for JSON Lines)
    (json.dumps({"a": 1, "b": [1, 2]}, indent=2), "one JSON document spanning 7 lines (an object with keys a, b)", None),
    ("\ufeff" + json.dumps([1, 2], indent=1), "one JSON document spanning 4 lines (an array of 2 items)", None),
    ('{ "hand": "written",\n  "config": 1 }\n', "one JSON document spanning 2 lines (an object with keys hand, config)",
     None),
    ('{\n  "damaged": 1,,\n}\n', "one JSON document spanning lines (its line 1 is a lone {)", None),
    ("\n" + json.dumps({"num_rows": 6}), None,
     "line 2 is an object with keys num_rows, not a record (a JSON object with input_ids)"),
    (json.dumps([{"input_ids": [1]}]), None, "one JSON document on line 1 (an array of 1 item), not one record a line"),
    ('"text"\n', None, "line 1 is a JSON string, not a record (a JSON object with input_ids)"),
    ('{"input_ids": [1], "prompt_len": 0}\n{"input_ids": [2], "prompt_len": 0}\n', None, None),
    ('{"input_ids": [1, 2\n{"input_ids": [2], "prompt_len": 0}\n', None, None),  # a damaged line: the run names it
    ("\n\n", None, None),
]


@pytest.mark.parametrize("content, document, as_records", JSON_FILES)
def test_a_json_document_is_told_from_json_lines_by_its_first_line(tmp_path, content, document, as_records):
    path = tmp_path / "f.json"
    path.write_text(content)
    assert json_document(path) == document
    assert json_document(path, records_only=True) == (document or as_records)
    with gzip.open(tmp_path / "f.json.gz", "wt") as f:
        f.write(content)
    assert json_document(tmp_path / "f.json.gz") == document
