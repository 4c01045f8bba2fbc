"""A small run's startup summary (everything before its first step line) is short: at most 12
lines of at most 120 characters; benchmark figures live in docs/, not in every run's output."""

from __future__ import annotations

from click.testing import CliRunner
from dflash.train.cli import main

MAX_LINES, MAX_WIDTH = 12, 120


def test_a_small_runs_startup_is_at_most_12_lines_of_at_most_120_characters(tiny_world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short relative paths, as a person types them
    (tmp_path / "C").symlink_to(tiny_world["cache"])
    (tmp_path / "T").symlink_to(tiny_world["target"])
    result = CliRunner().invoke(main, ["--cache", "C", "--target-model", "T", "--output-dir", "R", "--max-steps", "6",
                                       "--num-draft-layers", "1", "--block-size", "4", "--no-progress"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("[train step 1]"))
    startup = lines[:first_step]
    assert 0 < len(startup) <= MAX_LINES, startup
    assert all(len(line) <= MAX_WIDTH for line in startup), [line for line in startup if len(line) > MAX_WIDTH]
    # what it says is about this run: its data, length, labels and drafter, no benchmark figures
    said = "\n".join(startup)
    assert "data: 1 cache(s), 48 samples" in said and "--max-steps 6" in said and "drafter: DFlash2" in said
    assert "BPE benchmark" not in said and "H200" not in said
