"""Resume is exact: a run killed (SIGKILL) or stopped (SIGINT/SIGTERM) at a random step and
resumed ends with the same weights, bit for bit, as a run that was never interrupted; for
DFlash2 too (its convolutions and candidate selector), whose resume refuses other DFlash2 shapes."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import assert_same_weights, final_weights, read_metrics, tiny_train_config
from dflash.runtime.cli import paragraph
from dflash.runtime.findings import collected
from dflash.train.cli import main
from dflash.train.run.loop import train

STEPS = 30
SETTINGS = dict(max_steps=STEPS, epochs=5, grad_accum=2, save_interval=3, keep_checkpoints=2, num_workers=1,
                noise_type="uniform", noise_start=0.05, noise_end=0.0, eval_fraction=0.1)


def config_file(world: dict[str, Path], path: Path, **overrides) -> Path:
    values = tiny_train_config(world["cache"], world["target"], Path("unused"), **{**SETTINGS, **overrides}).to_dict()
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


def logged_train_steps(out: Path) -> list[int]:
    """The train steps of metrics.jsonl's complete lines: read while the run appends, its last line
    may be half written."""
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    complete = text[:text.rfind("\n") + 1]
    return [r["step"] for r in (json.loads(line) for line in complete.splitlines() if line.strip())
            if r["kind"] == "train"]


def wait_for_step(run, out: Path, step: int) -> int:
    """Poll metrics.jsonl until the run logged `step`; returns the last logged step."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        logged = logged_train_steps(out)
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
    killed_at = max(logged_train_steps(out))  # (a kill may leave a half-written last line)
    assert killed_at < STEPS
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, resume=True, **SETTINGS))
    assert result.step == STEPS and result.exit_status == 0
    assert_same_weights(final_weights(out), reference)
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    # each step logged once: the killed run's steps past its last checkpoint were dropped
    assert [r["step"] for r in read_metrics(out) if r["kind"] == "train"] == list(range(1, STEPS + 1))


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


# -- DFlash2 ------------------------------------------------------------------------------------

DFLASH2_STEPS = 12
DFLASH2 = dict(max_steps=DFLASH2_STEPS, drafter_type="dflash2", selector_rank=8, selector_top_k=4, conv_group_size=8,
               conv_kernel_size=2, num_workers=0)  # (the DataLoader worker's side of resume is DFlash's test's)


@pytest.fixture(scope="module")
def dflash2_reference(tiny_world, tmp_path_factory) -> Path:
    """The uninterrupted DFlash2 run (its directory), trained in this process."""
    out = tmp_path_factory.mktemp("dflash2-reference") / "run"
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, **{**SETTINGS, **DFLASH2}))
    assert result.step == DFLASH2_STEPS and result.exit_status == 0
    return out


def test_a_dflash2_run_killed_at_a_random_step_resumes_to_identical_weights(
        tiny_world, dflash2_reference, zygote, tmp_path):
    reference = final_weights(dflash2_reference)
    # Every DFlash2 tensor left its init (the convolutions' identity, the selector's zero
    # projection), so the comparison below covers what DFlash2 adds.
    assert reference["candidate_selector.hidden_projection.weight"].abs().amax() > 0
    for conv in ("attention_conv", "mlp_conv"):
        assert reference[f"layers.0.{conv}.kernel_projection.weight"].abs().amax() > 0
        assert reference[f"layers.0.{conv}.base_kernel"][:, 1].abs().amax() > 0
    out = tmp_path / "run"
    # (a sleep per batch keeps the run alive past the kill; it changes no number)
    proc = zygote.run("train", ["--config", config_file(tiny_world, tmp_path / "train.json", **DFLASH2),
                                "--output-dir", out], env={"DFLASH_TEST_SLEEP_PER_BATCH": "0.02"})
    wait_for_step(proc, out, random.Random(2).randint(4, 8))
    proc.signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert_same_threads(out)
    assert max(logged_train_steps(out)) < DFLASH2_STEPS  # (a kill may leave a half-written last line)
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, resume=True,
                                     **{**SETTINGS, **DFLASH2}))
    assert result.step == DFLASH2_STEPS and result.exit_status == 0
    assert_same_weights(final_weights(out), reference)


def test_a_dflash2_resume_with_another_selector_top_k_is_refused_in_one_paragraph(
        tiny_world, dflash2_reference, tmp_path):
    latest = sorted((dflash2_reference / "checkpoints").glob("step-*"))[0]
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(latest, out / "checkpoints" / latest.name)
    config = config_file(tiny_world, tmp_path / "train.json", **{**DFLASH2, "selector_top_k": 3})
    result = CliRunner().invoke(main, ["--config", str(config), "--output-dir", str(out)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    text = paragraph(result.output)
    assert f"Cannot resume from {out / 'checkpoints' / latest.name}" in text
    assert "model.selector_top_k: checkpoint has 4, this run has 3" in text
    assert "Rerun with the checkpoint's settings, or start a new run with another --output-dir." in text
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [latest.name]  # nothing written


def test_a_run_of_the_former_default_epochs_resumed_under_the_new_one_is_told_how_to_finish_as_it_started(
        tiny_world, tmp_path):
    run = tmp_path / "run"
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, epochs=6, max_steps=2, save_interval=2))
    with collected() as found:
        train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, epochs=10, max_steps=3,
                                save_interval=3))
    [changed] = [f for f in found if f.code == "train.resume-settings-changed"]
    # the former default: rendered as the flag that finishes the run as it started (--epochs 6)
    assert ["epochs", 6, 10] in changed.fields["changes"] and changed.fields["former_defaults"] == [["epochs", 6]]
    # a change that is no former default's gets no such hint
    with collected() as found:
        train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, epochs=12, max_steps=4,
                                save_interval=4))
    [changed] = [f for f in found if f.code == "train.resume-settings-changed"]
    assert ["epochs", 10, 12] in changed.fields["changes"] and changed.fields["former_defaults"] == []


def test_a_dflash_run_resumed_under_the_dflash2_default_is_refused_with_the_flag_that_finishes_it(tiny_world, tmp_path):
    from dflash.train.config import ResumeMismatchError

    run = tmp_path / "run"
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, drafter_type="dflash", max_steps=2,
                            save_interval=2))
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(ResumeMismatchError) as e:  # the same command, after the default moved to dflash2
        train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=3, save_interval=3))
    # the run's head and the default's: rendered as the flag that finishes it (--drafter-type dflash)
    assert e.value.code == "train.resume-other-run" and e.value.fields["default_head"] == ["dflash", "dflash2"]
    assert e.value.fields["checkpoint"] == str(run / "checkpoints" / saved[-1])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == saved  # nothing written
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, drafter_type="dflash",
                                     max_steps=3, save_interval=3))
    assert result.step == 3 and result.exit_status == 0
    config = json.loads((run / "final" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]


def test_a_checkpoint_from_before_drafters_had_a_type_exports_as_the_dflash_drafter_it_is(tiny_world, tmp_path):
    from dflash.train.cli import main as train_main

    run = tmp_path / "run"
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, drafter_type="dflash", max_steps=2,
                            save_interval=2))
    checkpoint = sorted((run / "checkpoints").glob("step-*"))[-1]
    meta = json.loads((checkpoint / "meta.json").read_text())
    for key in ("drafter_type", "selector_top_k", "selector_rank", "conv_kernel_size", "conv_group_size"):
        meta["drafter_config"].pop(key)  # what a checkpoint written before DFlash2 records
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    result = CliRunner().invoke(train_main, ["export", str(checkpoint), str(tmp_path / "export")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "conv_kernel_size" not in config.get("dflash_config", {})
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and not any("candidate_selector" in n or "_conv." in n for n in names)
