"""Resume is exact: a run killed (SIGKILL) or stopped (SIGINT/SIGTERM) at a random step and
resumed ends with the same weights, bit for bit, as a run that was never interrupted."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import assert_same_weights, final_weights, read_metrics, tiny_train_config
from dflash.train.cli import main
from dflash.train.loop import train

STEPS = 30
SETTINGS = dict(max_steps=STEPS, epochs=5, grad_accum=2, save_interval=3, keep_checkpoints=2, num_workers=1,
                noise_type="uniform", noise_start=0.05, noise_end=0.0, eval_fraction=0.1)


def config_file(world: dict[str, Path], path: Path) -> Path:
    values = tiny_train_config(world["cache"], world["target"], Path("unused"), **SETTINGS).to_dict()
    del values["output_dir"]
    path.write_text(json.dumps(values))
    return path


@pytest.fixture(scope="module")
def reference(tiny_world, tmp_path_factory) -> dict:
    """The uninterrupted run, trained in this process."""
    out = tmp_path_factory.mktemp("reference") / "run"
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, **SETTINGS))
    assert result.step == STEPS and result.exit_status == 0
    return final_weights(out)


def start_run(zygote, config: Path, out: Path):
    """The CLI as a forked run of the session's zygote (a faults.helpers.Run)."""
    return zygote.run("train", ["--config", config, "--output-dir", out])


def assert_same_threads(out: Path) -> None:
    """The run computed on this process's thread count: the reference and the resumes run in
    this process, and on some CPUs the kernels sum in an order that depends on it
    (docs/RELIABILITY.md)."""
    meta = json.loads(sorted((out / "checkpoints").glob("step-*"))[0].joinpath("meta.json").read_text())
    assert meta["compute"]["cpu_threads"] == torch.get_num_threads()


def wait_for_step(run, out: Path, step: int) -> int:
    """Poll metrics.jsonl until the run logged `step`; returns the last logged step."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        logged = [r["step"] for r in read_metrics(out) if r["kind"] == "train"] if (out / "metrics.jsonl").exists() else []
        if logged and logged[-1] >= step:
            return logged[-1]
        if run.wait(timeout=0) is not None:
            pytest.fail(f"the run ended before step {step}: {run.output()}")
        time.sleep(0.002)
    pytest.fail(f"the run did not reach step {step} in time")


def test_resume_after_sigkill_at_a_random_step_gives_identical_weights(tiny_world, reference, zygote, tmp_path):
    out = tmp_path / "run"
    kill_at = random.Random(1234).randint(5, 15)
    proc = start_run(zygote, config_file(tiny_world, tmp_path / "train.json"), out)
    wait_for_step(proc, out, kill_at)
    proc.signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert_same_threads(out)
    killed_at = max(r["step"] for r in read_metrics(out) if r["kind"] == "train")
    assert killed_at < STEPS
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, resume=True, **SETTINGS))
    assert result.step == STEPS and result.exit_status == 0
    assert_same_weights(final_weights(out), reference)
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_sigint_stops_within_seconds_with_a_checkpoint_and_the_rerun_resumes_exactly(
        tiny_world, reference, zygote, tmp_path):
    signum, status = signal.SIGINT, 130
    out = tmp_path / "run"
    config = config_file(tiny_world, tmp_path / "train.json")
    proc = start_run(zygote, config, out)
    wait_for_step(proc, out, random.Random(int(signum)).randint(5, 15))
    sent = proc.signal(signum)
    returncode, stderr = proc.wait(timeout=30), proc.output()
    assert time.monotonic() - sent < 10
    assert returncode == status, stderr
    assert_same_threads(out)
    assert "finishing this step, writing a checkpoint" in stderr
    last_logged = max(r["step"] for r in read_metrics(out) if r["kind"] == "train")
    latest = sorted((out / "checkpoints").glob("step-*"))[-1]
    assert latest.name == f"step-{last_logged:06d}"  # the checkpoint is of the last finished step

    # Rerunning the same command resumes (and says so), then finishes identically.
    result = CliRunner().invoke(main, ["--config", str(config), "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    assert f"Resuming from {latest}" in result.output
    assert_same_weights(final_weights(out), reference)
    assert (out / "final" / "model.safetensors").is_file()


def test_sigterm_then_a_second_signal_exits_at_once(tiny_world, zygote, tmp_path):
    out = tmp_path / "run"
    proc = start_run(zygote, config_file(tiny_world, tmp_path / "train.json"), out)
    wait_for_step(proc, out, 2)
    assert proc.watch_children()  # its DataLoader worker
    os.kill(proc.pid, signal.SIGSTOP)  # both signals arrive before the step can finish
    proc.signal(signal.SIGINT)
    proc.signal(signal.SIGTERM)  # (two pending SIGINTs would merge into one)
    os.kill(proc.pid, signal.SIGCONT)
    sent = time.monotonic()
    status = proc.wait(timeout=10)
    assert proc.surviving_children(grace=max(0.0, sent + 2 - time.monotonic())) == []  # the worker too
    assert time.monotonic() - sent < 2
    # The status is the second signal's. Which of the two pending signals the run handles first
    # depends on the thread the kernel gives each: either order is a first and a second signal.
    output = proc.output()
    first, second = ("SIGINT", "SIGTERM") if "Second SIGTERM" in output else ("SIGTERM", "SIGINT")
    assert status == {"SIGTERM": 143, "SIGINT": 130}[second], output
    assert f"{first} received: finishing" in output
    assert f"Second {second}: exiting now without a checkpoint" in output
