"""dflash-prepare reads the common chat shapes and file types into the same records."""

from __future__ import annotations

import gzip
import json

import pytest
from chat_utils import QWEN3_TEMPLATE, make_tokenizer
from click.testing import CliRunner
from conftest import read_jsonl, write_jsonl
from dflash.prepare.cli import main as prepare_main

MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"}]
SHAREGPT = {"id": "x", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q1"},
                                         {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"},
                                         {"from": "gpt", "value": "A2"}]}


def prepare(tmp_path, data, *args):
    tok_dir = tmp_path / "tok"
    if not tok_dir.exists():
        make_tokenizer(tok_dir, QWEN3_TEMPLATE)
    out = tmp_path / f"out-{data.name}.jsonl"
    result = CliRunner().invoke(prepare_main, ["--target-model", str(tok_dir), "--data", str(data),
                                               "--output", str(out), "--no-progress", *args])
    return result, (read_jsonl(out) if result.exit_code == 0 else None)


def test_sharegpt_and_messages_give_the_same_record(tmp_path):
    _, a = prepare(tmp_path, write_jsonl(tmp_path / "m.jsonl", [{"id": "x", "messages": MESSAGES}]))
    _, b = prepare(tmp_path, write_jsonl(tmp_path / "s.jsonl", [SHAREGPT]))
    assert a == b and sum(a[0]["loss_mask"]) > 0


def test_prompt_response_pairs_with_system(tmp_path):
    rec = {"id": "x", "system": "S", "prompt": "Q2", "response": "A2"}
    _, a = prepare(tmp_path, write_jsonl(tmp_path / "p.jsonl", [rec]))
    _, b = prepare(tmp_path, write_jsonl(tmp_path / "m.jsonl", [{"id": "x", "messages": [MESSAGES[0], *MESSAGES[3:]]}]))
    assert a == b


def test_gzip_and_parquet_inputs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    _, plain = prepare(tmp_path, write_jsonl(tmp_path / "m.jsonl", [{"id": "x", "messages": MESSAGES}]))
    gz = tmp_path / "m2.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"id": "x", "messages": MESSAGES}) + "\n")
    _, zipped = prepare(tmp_path, gz)
    table = pa.Table.from_pylist([{"id": "x", "messages": MESSAGES}])
    pq.write_table(table, tmp_path / "m3.parquet")
    _, parquet = prepare(tmp_path, tmp_path / "m3.parquet")
    assert plain == zipped == parquet


def test_forced_format_mismatch_names_the_line(tmp_path):
    data = write_jsonl(tmp_path / "m.jsonl", [{"id": "x", "messages": MESSAGES}])
    result, _ = prepare(tmp_path, data, "--format", "sharegpt")
    assert result.exit_code == 2 and "m.jsonl, line 1" in result.output and "conversations" in result.output


def test_missing_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *a, **k):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    result, _ = prepare(tmp_path, tmp_path / "d.parquet")
    assert result.exit_code == 2 and "pip install 'dflash-pipeline[parquet]'" in result.output


def test_worker_processes_write_the_same_output(tmp_path):
    records = [{"id": f"r{i}", "messages": MESSAGES[: 3 + 2 * (i % 2)]} for i in range(40)]
    records[7] = {"id": "r7", "messages": [{"role": "user", "content": "unanswered"}]}
    data = write_jsonl(tmp_path / "m.jsonl", records)
    _, serial = prepare(tmp_path, data)
    (tmp_path / "out-m.jsonl.jsonl").rename(tmp_path / "serial.jsonl")
    result, parallel = prepare(tmp_path, data, "--num-workers", "2")
    assert result.exit_code == 0, result.output
    assert parallel == serial and len(serial) == 39


def test_config_file_gives_the_same_settings_as_flags(tmp_path):
    data = write_jsonl(tmp_path / "m.jsonl", [{"id": "x", "messages": MESSAGES}])
    _, flags = prepare(tmp_path, data, "--chat-template-kwargs", '{"enable_thinking": false}', "--loss-on", "last-assistant")
    config = tmp_path / "prepare.json"
    config.write_text(json.dumps({"chat-template-kwargs": {"enable_thinking": False}, "loss_on": "last-assistant"}))
    (tmp_path / "out-m.jsonl.jsonl").rename(tmp_path / "flags.jsonl")
    result, from_file = prepare(tmp_path, data, "--config", str(config))
    assert result.exit_code == 0, result.output
    assert from_file == flags
    meta = json.loads((tmp_path / "out-m.jsonl.jsonl.meta.json").read_text())
    assert meta["chat_template_kwargs"] == {"enable_thinking": False} and meta["loss_on"] == "last-assistant"


def test_text_content_parts_are_joined(tmp_path):
    parts = [dict(m, content=[{"type": "text", "text": m["content"][:1]}, {"type": "text", "text": m["content"][1:]}])
             for m in MESSAGES]
    _, a = prepare(tmp_path, write_jsonl(tmp_path / "m.jsonl", [{"id": "x", "messages": MESSAGES}]))
    _, b = prepare(tmp_path, write_jsonl(tmp_path / "p.jsonl", [{"id": "x", "messages": parts}]))
    assert a == b


def test_a_directory_reads_json_lines_named_json_and_names_the_files_it_leaves_out(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", [{"id": "a", "messages": MESSAGES}])
    write_jsonl(data / "b.json", [{"id": "b", "messages": MESSAGES}])  # JSON Lines, as Dataset.to_json names it
    (data / "config.json").write_text(json.dumps({"name": "chats", "splits": ["train"]}, indent=2))
    (data / "README.txt").write_text("chats from the support desk\n")
    result, records = prepare(tmp_path, data)
    assert result.exit_code == 0, result.output
    assert sorted(r["id"] for r in records) == ["a", "b"]
    assert "left out 2 other files: README.txt, config.json" in " ".join(result.output.split())
