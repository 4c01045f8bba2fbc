"""Bad input that tests/test_extract_inputs.py and tests/test_train_errors.py do not already
cover (docs/RELIABILITY.md has the full table): samples without loss tokens and over-long
samples through the trainer, a target without weights given to the trainer, a bad record in
the middle of a run, an input file without records."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from dflash.extract.cli import main as extract_main
from dflash.train.cli import main as train_main

from .helpers import (
    committed_parts,
    extract_argv,
    make_records,
    train_config_file,
    write_jsonl,
)


def extract(target, data, out, *extra):
    return CliRunner().invoke(extract_main, extract_argv(target, data, out, *extra))


def train(cache, target, out, tmp_path, **overrides):
    config = train_config_file(tmp_path / "train.json", cache, target, **overrides)
    return CliRunner().invoke(train_main, ["--config", str(config), "--output-dir", str(out)])


def test_samples_without_loss_tokens_are_extracted_and_the_trainer_runs_on_them(world, tmp_path):
    """Extraction keeps all-prompt samples (their hidden states are context); the trainer draws
    no anchor in them and its loss stays finite."""
    records = make_records(24, seed=3)
    for r in records[::2]:
        r["prompt_len"] = len(r["input_ids"])  # no completion token at all
    data = write_jsonl(tmp_path / "data.jsonl", records)
    res = extract(world["target"], data, tmp_path / "cache")
    assert res.exit_code == 0, res.output
    run = train(tmp_path / "cache", world["target"], tmp_path / "run", tmp_path, epochs=1, save_interval=0)
    assert run.exit_code == 0, run.output
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if m["kind"] == "train"]
    assert losses and all(loss == loss and loss < 1e4 for loss in losses)  # no NaN


def test_a_cache_of_only_prompt_tokens_trains_without_crashing(world, tmp_path):
    records = [{"input_ids": r["input_ids"], "prompt_len": len(r["input_ids"])} for r in make_records(12, seed=4)]
    data = write_jsonl(tmp_path / "data.jsonl", records)
    assert extract(world["target"], data, tmp_path / "cache").exit_code == 0
    run = train(tmp_path / "cache", world["target"], tmp_path / "run", tmp_path, epochs=1, save_interval=0)
    assert "Traceback" not in run.output
    assert run.exit_code == 0, run.output
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["loss"] == m["loss"] for m in metrics if m["kind"] == "train")  # no NaN


def test_over_long_samples_are_truncated_by_the_trainer_and_reported(world, tmp_path):
    records = make_records(12, seed=5)
    records[3] = {"input_ids": [7] * 300, "prompt_len": 10}  # far over the trainer's max_seq_len
    data = write_jsonl(tmp_path / "data.jsonl", records)
    assert extract(world["target"], data, tmp_path / "cache").exit_code == 0
    run = train(tmp_path / "cache", world["target"], tmp_path / "run", tmp_path, epochs=1, save_interval=0)
    assert run.exit_code == 0, run.output
    assert "longer than --max-seq-len 64" in run.output and "236 tokens dropped" in run.output
    # (a sample longer than --token-budget is refused: tests/test_train_errors.py)


def test_a_target_directory_without_weights_is_refused_by_the_trainer(world, tmp_path):
    bare = tmp_path / "bare-target"
    bare.mkdir()
    (bare / "config.json").write_text((world["target"] / "config.json").read_text())
    run = train(world["cache"], bare, tmp_path / "run", tmp_path)
    assert run.exit_code == 2 and "Traceback" not in run.output, run.output
    assert str(bare) in run.output.replace("\n", " ")


def test_a_bad_record_midway_keeps_the_parts_before_it_and_the_fixed_data_needs_force(world, tmp_path):
    """Parts are committed as the input streams: a bad line stops the run after the parts
    before it. Fixing the line changes the data's fingerprint, so the rerun refuses to mix the
    two versions unless --force; --skip-bad instead keeps the line's sample id unused."""
    records = make_records(40, seed=6)
    records[30] = '{"input_ids": [1, 2, 999], "prompt_len": 1}'
    data = write_jsonl(tmp_path / "data.jsonl", records)
    out = tmp_path / "cache"
    res = extract(world["target"], data, out)
    assert res.exit_code == 2
    assert (f"Error: {data}, line 31: token id 999 is outside the target's vocabulary (64 entries). "
            "Fix the record or pass --skip-bad to skip it.") in res.output
    kept = committed_parts(out)
    assert kept  # the parts before line 31 are committed and kept
    # A plan promises every part: none is written for input that stops at a bad record (a
    # follower would take the parts before it for the whole cache).
    assert not (out / "manifest.plan.json").exists()
    records[30] = {"input_ids": [1, 2, 3], "prompt_len": 1}
    write_jsonl(data, records)
    res = extract(world["target"], data, out)
    text = res.output.replace("\n", " ")
    assert res.exit_code == 2 and f"{data} changed since the cache was extracted from it" in text, res.output
    assert "pass --force" in text
    assert committed_parts(out) == kept
    res = extract(world["target"], data, out, "--force")
    assert res.exit_code == 0, res.output
    assert (out / "manifest.plan.json").exists()


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_an_input_file_without_records_is_a_clear_error(world, tmp_path, content):
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    res = extract(world["target"], data, tmp_path / "cache")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert str(data) in res.output and "no usable sample" in res.output and "--data" in res.output
