"""Outputs that are inputs, and one writer per output file: dflash-prepare and dflash-generate
refuse an --output that is (or links to) the --data they read, and a second writer of one output;
dflash-generate does not count the records of a JSONL it did not write as done (issue #33, bugs 7
and 8)."""

from __future__ import annotations

import os

import pytest
from chat_utils import QWEN3_TEMPLATE, make_tokenizer
from click.testing import CliRunner
from conftest import write_jsonl
from dflash.prepare.cli import main as prepare_main
from dflash.prepare.generate_cli import main as generate_main
from dflash.runtime.locks import WriterLock

CHATS = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Q{i}"},
                                      {"role": "assistant", "content": f"A{i}"}]} for i in range(4)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tok"
    make_tokenizer(path, QWEN3_TEMPLATE)
    return path


def prepare(tok, data, out):
    return CliRunner().invoke(prepare_main, ["--target-model", str(tok), "--data", str(data), "--output",
                                             str(out), "--no-progress"])


def generate(tok, data, out):
    return CliRunner().invoke(generate_main, ["--target-model", str(tok), "--data", str(data), "--output",
                                              str(out), "--no-progress", "--dtype", "fp32", "--thinking", "off"])


@pytest.mark.parametrize("command", [prepare, generate])
@pytest.mark.parametrize("how", ["same path", "through a link", "a file of the data directory"])
def test_an_output_that_is_an_input_is_refused_and_the_input_is_kept(tok, tmp_path, command, how):
    data = write_jsonl(tmp_path / "chats" / "chat.jsonl", CHATS)
    before = data.read_bytes()
    out = {"same path": data, "a file of the data directory": data}.get(how)
    if how == "through a link":
        (tmp_path / "link").symlink_to(data.parent)
        out = tmp_path / "link" / "chat.jsonl"
    given = data.parent if how == "a file of the data directory" else data
    result = command(tok, given, out)
    assert result.exit_code == 2, result.output
    assert "would overwrite the data being read" in result.output and "Traceback" not in result.output
    assert data.read_bytes() == before


def test_generate_onto_a_jsonl_it_did_not_write_is_refused_instead_of_counting_it_done(tok, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    out = write_jsonl(tmp_path / "other.jsonl", [{"id": f"c{i}", "input_ids": [1, 2]} for i in range(4)])
    result = generate(tok, data, out)
    assert result.exit_code == 2, result.output
    assert "has no sidecar other.jsonl.meta.json" in result.output and "done" in result.output
    assert "records written" not in result.output


@pytest.mark.parametrize("command", [prepare, generate])
def test_a_second_writer_of_one_output_is_refused_with_the_holders_pid(tok, tmp_path, command):
    data = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    out = tmp_path / "out.jsonl"
    with WriterLock(tmp_path / ".out.jsonl.lock", purpose="prepare", output=out):  # a live writer of `out`
        result = command(tok, data, out)
    assert result.exit_code == 2, result.output
    assert f"being written by another process (pid {os.getpid()} on " in result.output
    assert not out.exists()
