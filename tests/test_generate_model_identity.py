"""dflash-generate's output records the model that wrote its answers: a resume with another
model (the same tokenizer, template and config, other weights; or another --model of a
server) is refused and the file left as it was, instead of mixing two models' answers in one
file; the same model resumes, and a sidecar written before the model was recorded resumes
with a note that it was not checked."""

from __future__ import annotations

import json

import pytest
from chat_utils import QWEN3_TEMPLATE, make_chat_target
from click.testing import CliRunner
from conftest import read_jsonl, write_jsonl
from dflash.prepare.generate_cli import main as generate_main

N = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny chat targets of one config.json, tokenizer and template, with other weights."""
    root = tmp_path_factory.mktemp("models")
    first = make_chat_target(root / "chatA", QWEN3_TEMPLATE, seed=0)
    second = make_chat_target(root / "chatB", QWEN3_TEMPLATE, seed=1)
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()
    assert (first / "model.safetensors").read_bytes() != (second / "model.safetensors").read_bytes()
    data = write_jsonl(root / "chat.jsonl", [
        {"id": f"q{i}", "messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": "x"}]}
        for i in range(N)])
    return {"first": first, "second": second, "data": data}


def run(model, data, out):
    return CliRunner().invoke(generate_main, [
        "--target-model", str(model), "--data", str(data), "--output", str(out), "--no-progress",
        "--dtype", "fp32", "--thinking", "off", "--max-tokens", "8"])


def interrupted(models, out):
    """The output as a run of the first model stopped after half its records leaves it."""
    assert run(models["first"], models["data"], out).exit_code == 0
    lines = out.read_text().splitlines(keepends=True)
    assert len(lines) == N
    out.write_text("".join(lines[: N // 2]))


def test_a_resume_with_other_weights_of_the_same_config_is_refused_and_the_file_is_unchanged(models, tmp_path):
    out = tmp_path / "gen.jsonl"
    interrupted(models, out)
    sidecar = tmp_path / "gen.jsonl.meta.json"
    before = out.read_bytes(), sidecar.read_bytes()
    refused = run(models["second"], models["data"], out)
    assert refused.exit_code == 2, refused.output
    text = " ".join(refused.output.split())
    assert "holds the answers of another model" in text and "weights_hash" in text
    assert str(models["first"]) in text and str(models["second"]) in text and str(out) in text
    assert "another --output" in text and "the model that wrote it" in text and "start anew" in text
    assert (out.read_bytes(), sidecar.read_bytes()) == before


def test_the_same_model_resumes(models, tmp_path):
    out = tmp_path / "gen.jsonl"
    interrupted(models, out)
    resumed = run(models["first"], models["data"], out)
    assert resumed.exit_code == 0, resumed.output
    assert f"{N // 2} records written ({N // 2} done before)" in resumed.output
    assert "not checked" not in resumed.output
    whole = tmp_path / "whole.jsonl"
    assert run(models["first"], models["data"], whole).exit_code == 0
    assert sorted(map(json.dumps, read_jsonl(out))) == sorted(map(json.dumps, read_jsonl(whole)))


def test_a_sidecar_written_before_the_model_was_recorded_resumes_with_a_note(models, tmp_path):
    out = tmp_path / "gen.jsonl"
    interrupted(models, out)
    sidecar = tmp_path / "gen.jsonl.meta.json"
    meta = json.loads(sidecar.read_text())
    assert meta["target"]["weights_hash"] and meta["target"]["backend"] == "in-process"
    del meta["target"], meta["target_provenance"]
    sidecar.write_text(json.dumps(meta))
    resumed = run(models["first"], models["data"], out)
    assert resumed.exit_code == 0, resumed.output
    assert f"{N // 2} records written ({N // 2} done before)" in resumed.output
    text = " ".join(resumed.output.split())
    assert "records no identity of the model that wrote its answers" in text and "is not checked" in text
