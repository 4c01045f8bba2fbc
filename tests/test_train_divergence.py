"""A run whose loss diverges (nan or inf) stops at once with one paragraph naming the step and
a lower --lr (exit status 2): no checkpoint and no final/ of nan weights, the last good
checkpoint and an earlier final/ kept; the console shows the nan, and metrics.jsonl stays strict JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_train_config
from dflash.train.cli import main
from dflash.train.config import DivergedError
from dflash.train.run.loop import train
from safetensors.torch import load_file

DIVERGING_LR = "6e4"


def cli_args(world: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["--cache", str(world["cache"]), "--target-model", str(world["target"]), "--output-dir", str(out),
            "--num-draft-layers", "1", "--block-size", "4", "--max-anchors", "4", "--token-budget", "128",
            "--max-seq-len", "64", "--num-workers", "0", "--no-progress", "--no-tensorboard", "--epochs", "10",
            "--max-steps", "40", *extra]


def strict_records(run: Path) -> list[dict]:
    def refuse(constant: str):
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_finite_checkpoints(run: Path) -> None:
    for checkpoint in sorted((run / "checkpoints").glob("step-*")):
        for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
            assert torch.isfinite(tensor).all(), f"{checkpoint.name}: {name} is not finite"


def test_a_diverging_run_stops_with_exit_2_naming_the_step_and_a_lower_lr_and_exports_nothing(tiny_world, tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(main, cli_args(tiny_world, run, "--lr", DIVERGING_LR, "--log-interval", "1",
                                               "--save-interval", "1"))
    assert result.exit_code == 2, result.output
    error = " ".join(result.output[result.output.index("Error: "):].split())
    assert "The loss diverged at step " in error and "Rerun with a lower --lr (this run's is 60000" in error
    assert "Traceback" not in result.output
    assert not (run / "final").exists()
    assert_finite_checkpoints(run)
    # The console shows the non-finite value it stopped on rather than dropping it.
    last_line = [line for line in result.output.splitlines() if line.startswith("[train step")][-1]
    assert "loss=nan" in last_line or "grad_norm=nan" in last_line or "=inf" in last_line, last_line
    # metrics.jsonl stays strict JSON: the non-finite value is null, its key still there.
    last = [r for r in strict_records(run) if r["kind"] == "train"][-1]
    assert last["loss"] is None or last["grad_norm"] is None
    assert f"step {last['step']}" in error


def test_a_divergence_between_logs_never_reaches_a_checkpoint(tiny_world, tmp_path):
    """Logged rarely, checkpointed often: the step's device-side note stops the run before a save."""
    run = tmp_path / "run"
    result = CliRunner().invoke(main, cli_args(tiny_world, run, "--lr", DIVERGING_LR, "--log-interval", "1000",
                                               "--eval-interval", "0", "--save-interval", "3"))
    assert result.exit_code == 2, result.output
    assert "The loss diverged at step " in result.output
    assert_finite_checkpoints(run)
    assert not (run / "final").exists()


def test_a_resume_that_diverges_keeps_the_last_good_checkpoint_and_the_earlier_final(tiny_world, tmp_path):
    run = tmp_path / "run"
    good = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, epochs=10, max_steps=4,
                                   save_interval=2))
    assert good.exit_status == 0
    final_before = {p.name: p.read_bytes() for p in (run / "final").iterdir()}
    with pytest.raises(DivergedError) as e:
        train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, epochs=10, max_steps=40,
                                save_interval=2, lr=float(DIVERGING_LR)))
    assert e.value.code == "train.loss-diverged"
    fields = e.value.fields
    assert fields["final_kept"] is True and fields["final"] == str(run / "final")
    assert Path(fields["checkpoint"]).is_dir()  # kept: the one to resume from with a lower --lr
    step = fields["step"]
    assert step > 4
    assert {p.name: p.read_bytes() for p in (run / "final").iterdir()} == final_before
    assert_finite_checkpoints(run)
    assert (run / "checkpoints" / "step-000004").is_dir()
