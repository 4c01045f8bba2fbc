"""A truncated model.safetensors is one clear error everywhere it is read (issue #33, bug 5):
a checkpoint's on resume, `dflash-train export`, `estimate`, `dflash-eval --drafter`, and a
target's in extract, train and eval: exit 2, the file named with what to do, no traceback (it
was SafetensorError's traceback and exit 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from dflash.eval.cli import main as eval_main
from dflash.extract.cli import main as extract_main
from dflash.runtime.safetensors_files import safetensors_problem
from dflash.train.cli import main as train_main

from .helpers import extract_argv, train_config_file


def truncate(path: Path, keep: float = 0.6) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def assert_clear(result, damaged: Path, fix: str) -> None:
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())  # the paragraph is wrapped
    assert f"{damaged} is not a complete safetensors file" in text and fix in text, text
    assert "Traceback" not in result.output and "SafetensorError" not in result.output


@pytest.fixture
def run_copy(world, tmp_path) -> Path:
    return Path(shutil.copytree(world["run"], tmp_path / "run"))


def latest_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step-*"))[-1]


def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"input_ids": [3, 4, 5, 6]}) + "\n")
    return path


def test_a_checkpoint_truncated_before_resume_or_export(world, tmp_path, run_copy):
    damaged = truncate(latest_checkpoint(run_copy) / "model.safetensors")
    config = train_config_file(tmp_path / "train.json", world["cache"], world["target"])
    result = CliRunner().invoke(train_main, ["--config", str(config), "--output-dir", str(run_copy)])
    assert_clear(result, damaged, "Delete that checkpoint to resume from the one before")
    result = CliRunner().invoke(train_main, ["export", str(damaged.parent), str(tmp_path / "out")])
    assert_clear(result, damaged, "Export an earlier checkpoint")


def test_a_drafter_export_truncated_for_estimate_and_eval(world, tmp_path, run_copy):
    damaged = truncate(run_copy / "final" / "model.safetensors")
    result = CliRunner().invoke(train_main, ["estimate", str(damaged.parent), "--cache", str(world["cache"]),
                                             "--target-model", str(world["target"])])
    assert_clear(result, damaged, "Export the drafter again")
    result = CliRunner().invoke(eval_main, ["--target-model", str(world["target"]), "--drafter",
                                            str(damaged.parent), "--prompts", str(prompts(tmp_path))])
    assert_clear(result, damaged, "Export the drafter again")


@pytest.mark.parametrize("keep", [0.6, 0.0001])  # short data; short of the header itself
def test_a_target_truncated_for_extract_train_and_eval(world, tmp_path, keep):
    target = Path(shutil.copytree(world["target"], tmp_path / "target"))
    damaged = truncate(target / "model.safetensors", keep)
    fix = "Copy the target model's weight files again"
    result = CliRunner().invoke(extract_main, extract_argv(target, world["data"], tmp_path / "cache"))
    assert_clear(result, damaged, fix)
    config = train_config_file(tmp_path / "train.json", world["cache"], target)
    result = CliRunner().invoke(train_main, ["--config", str(config), "--output-dir", str(tmp_path / "run")])
    assert_clear(result, damaged, fix)
    result = CliRunner().invoke(eval_main, ["--target-model", str(target), "--drafter", str(world["run"] / "final"),
                                            "--prompts", str(prompts(tmp_path))])
    assert_clear(result, damaged, fix)


def test_a_complete_file_passes_the_check(world):
    assert safetensors_problem(world["target"] / "model.safetensors") is None
    assert safetensors_problem(world["run"] / "final" / "model.safetensors") is None
