"""SIGINT and SIGTERM at several points of extraction and training.

Each time: the run exits within 10 s with 130 (SIGINT) or 143 (SIGTERM) and one sentence, no
traceback; it leaves only committed parts / complete checkpoints; no writer process or
DataLoader worker outlives it; and rerunning the same command ends with exactly the result of
an uninterrupted run (the cache's content hash, the drafter's final weights). A second signal
exits at once.
"""

from __future__ import annotations

import signal
import time

import pytest

from .helpers import (
    cache_hash,
    committed_parts,
    complete_checkpoints,
    extract_argv,
    logged_steps,
    temp_parts,
    train_config_file,
    wait_until,
    weights_hash,
)

STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}
SIGNALS = [signal.SIGINT, signal.SIGTERM]


def assert_stopped(run, signum, sent: float, *, within: float = 10.0) -> str:
    status = run.wait(timeout=within + 5)
    took = time.monotonic() - sent
    out = run.output()
    assert status == STATUS[signum], f"status {status}, output:\n{out}"
    assert took < within, f"took {took:.1f} s to stop"
    assert "Traceback" not in out, out
    assert run.surviving_children(grace=0.5) == [], "a child process outlived the main process"
    return out


def busy_parts(cache) -> list[str]:
    """Temporary part directories (a part's files being written), not just liveness locks."""
    return [p for p in temp_parts(cache) if not p.endswith(".lock") and (cache / "parts" / p).is_dir()]


def finish_extraction(zygote, world, out) -> None:
    rerun = zygote.run("extract", extract_argv(world["target"], world["data"], out))
    assert rerun.wait() == 0, rerun.output()
    assert temp_parts(out) == []
    assert cache_hash(out) == world["cache_hash"]


# -- extraction ------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_extract_signal_during_startup_exits_cleanly_with_nothing_written(zygote, world, tmp_path, signum):
    out = tmp_path / "cache"
    run = zygote.run("extract", extract_argv(world["target"], world["data"], out))
    wait_until(lambda: run.handles(signal.SIGTERM), what="the CLI's startup handler")  # in main()
    sent = run.signal(signum)  # (model loading takes longer than this)
    text = assert_stopped(run, signum, sent)
    assert (f"dflash-extract stopped by {signal.Signals(signum).name} outside the extraction loop; committed "
            "parts are kept. Rerun the same command to resume.") in text
    assert committed_parts(out) == []
    finish_extraction(zygote, world, out)


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_extract_signal_during_a_forward_keeps_committed_parts_and_resumes(zygote, world, tmp_path, signum):
    out = tmp_path / "cache"
    run = zygote.run("extract", extract_argv(world["target"], world["data"], out),
                     env={"DFLASH_TEST_SLEEP_PER_FORWARD": "0.3"})
    wait_until(lambda: len(committed_parts(out)) >= 1, what="a first commit")
    sent = run.signal(signum)  # the loop is inside the next forward (it sleeps 0.3 s there)
    text = assert_stopped(run, signum, sent)
    assert f"dflash-extract stopped by {signal.Signals(signum).name}" in text
    done = committed_parts(out)
    assert 1 <= len(done) < len(committed_parts(world["cache"])) and temp_parts(out) == []
    finish_extraction(zygote, world, out)


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_extract_signal_during_a_part_write_commits_that_part_then_stops(zygote, world, tmp_path, signum):
    out = tmp_path / "cache"
    run = zygote.run("extract", extract_argv(world["target"], world["data"], out),
                     env={"DFLASH_TEST_SLEEP_BEFORE_COMMIT": "0.4"})
    wait_until(lambda: len(committed_parts(out)) >= 1 and busy_parts(out), what="a part being written")
    writing = busy_parts(out)[0].split(".")[1][len("tmp-"):]  # .tmp-part-000003.<pid>.<rand>
    sent = run.signal(signum)
    assert_stopped(run, signum, sent)
    done = committed_parts(out)
    assert writing in done and len(done) < len(committed_parts(world["cache"]))  # then it stopped
    assert temp_parts(out) == []
    finish_extraction(zygote, world, out)


def test_extract_signal_while_writer_processes_write_leaves_no_writer_behind(zygote, world, tmp_path):
    signum = signal.SIGTERM  # (SIGINT takes the same path; writer processes cost seconds to spawn)
    out = tmp_path / "cache"
    run = zygote.run("extract", extract_argv(world["target"], world["data"], out, "--num-writers", "2"),
                     env={"DFLASH_TEST_SLEEP_BEFORE_COMMIT": "0.4"})
    wait_until(lambda: busy_parts(out), what="a writer process writing a part")
    assert len(run.watch_children()) >= 2  # the writers (and multiprocessing's helpers)
    sent = run.signal(signum)
    assert_stopped(run, signum, sent)
    assert temp_parts(out) == []
    finish_extraction(zygote, world, out)


def test_extract_second_signal_exits_at_once_and_stops_the_writers(zygote, world, tmp_path):
    out = tmp_path / "cache"
    run = zygote.run("extract", extract_argv(world["target"], world["data"], out, "--num-writers", "1"),
                     env={"DFLASH_TEST_SLEEP_BEFORE_COMMIT": "30"})
    wait_until(lambda: busy_parts(out), what="a writer process writing a part")
    run.signal(signal.SIGINT)
    time.sleep(0.2)
    sent = run.signal(signal.SIGTERM)
    assert_stopped(run, signal.SIGTERM, sent, within=3.0)
    assert committed_parts(out) == []  # the part in the writer's hands was abandoned, not committed
    finish_extraction(zygote, world, out)  # and its leftovers are removed at the next open


# -- training --------------------------------------------------------------------------------


def finish_training(zygote, world, config, out, expected: str | None = None) -> None:
    """Rerun the command; it must end with `expected` (the reference run's weights hash)."""
    had_checkpoint = bool(complete_checkpoints(out))
    rerun = zygote.run("train", ["--config", config, "--output-dir", out])
    assert rerun.wait() == 0, rerun.output()
    assert ("Resuming from" in rerun.output()) == had_checkpoint
    assert weights_hash(out) == (expected or world["weights_hash"])


def no_staging(out) -> bool:
    d = out / "checkpoints"
    return not d.is_dir() or not [p for p in d.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_train_signal_during_startup_exits_cleanly_without_a_checkpoint(zygote, world, tmp_path, signum):
    out, config = tmp_path / "run", train_config_file(tmp_path / "train.json", world["cache"], world["target"])
    run = zygote.run("train", ["--config", config, "--output-dir", out])
    wait_until(lambda: run.handles(signal.SIGTERM), what="the CLI's startup handler")  # in main()
    sent = run.signal(signum)  # (opening the cache and building the drafter take longer)
    text = " ".join(assert_stopped(run, signum, sent).split())
    assert (f"dflash-train stopped by {signal.Signals(signum).name} outside a training step; complete "
            "checkpoints are kept. Rerun the same command to resume.") in text
    assert complete_checkpoints(out) == []
    finish_training(zygote, world, config, out)


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_train_signal_while_dataloader_workers_are_busy_checkpoints_and_resumes(zygote, world, tmp_path, signum):
    out = tmp_path / "run"
    config = train_config_file(tmp_path / "train.json", world["cache"], world["target"], num_workers=2)
    run = zygote.run("train", ["--config", config, "--output-dir", out],
                     env={"DFLASH_TEST_SLEEP_PER_BATCH": "0.15"})
    wait_until(lambda: len(logged_steps(out)) >= 3, what="step 3")
    assert len(run.watch_children()) >= 2  # the DataLoader workers
    sent = run.signal(signum)
    text = assert_stopped(run, signum, sent)
    assert "finishing this step, writing a checkpoint" in text
    last = logged_steps(out)[-1]
    assert complete_checkpoints(out)[-1] == f"step-{last:06d}" and no_staging(out)
    finish_training(zygote, world, config, out)


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_train_signal_during_a_checkpoint_save_leaves_complete_checkpoints(zygote, world, tmp_path, signum):
    out = tmp_path / "run"
    config = train_config_file(tmp_path / "train.json", world["cache"], world["target"])
    run = zygote.run("train", ["--config", config, "--output-dir", out],
                     env={"DFLASH_TEST_SLEEP_IN_CHECKPOINT": "0.5"})
    wait_until(lambda: not no_staging(out), what="a checkpoint being saved")
    sent = run.signal(signum)
    text = assert_stopped(run, signum, sent)
    assert "finishing this step, writing a checkpoint" in text
    assert no_staging(out)
    ckpts = complete_checkpoints(out)
    assert ckpts and ckpts[-1] == f"step-{logged_steps(out)[-1]:06d}"
    for name in ckpts:
        assert {p.name for p in (out / "checkpoints" / name).iterdir()} == {
            "model.safetensors", "optimizer.pt", "trainer.pt", "meta.json"}
    finish_training(zygote, world, config, out)


def test_train_dflash2_sigint_checkpoints_and_the_rerun_ends_like_an_uninterrupted_run(zygote, world, tmp_path):
    # DFlash2's convolutions and candidate selector are in the checkpoint and the resumed state.
    config = train_config_file(tmp_path / "train.json", world["cache"], world["target"], drafter_type="dflash2",
                               selector_rank=8, selector_top_k=4, conv_group_size=8)
    reference = zygote.run("train", ["--config", config, "--output-dir", tmp_path / "reference"])
    out = tmp_path / "run"
    run = zygote.run("train", ["--config", config, "--output-dir", out], env={"DFLASH_TEST_SLEEP_PER_BATCH": "0.05"})
    wait_until(lambda: len(logged_steps(out)) >= 3, what="step 3")
    sent = run.signal(signal.SIGINT)
    text = assert_stopped(run, signal.SIGINT, sent)
    assert "finishing this step, writing a checkpoint" in text
    last = logged_steps(out)[-1]
    assert complete_checkpoints(out)[-1] == f"step-{last:06d}" and no_staging(out)
    assert reference.wait(timeout=120) == 0, reference.output()
    assert last < logged_steps(tmp_path / "reference")[-1]  # stopped before the end
    finish_training(zygote, world, config, out, expected=weights_hash(tmp_path / "reference"))
    assert weights_hash(out) != world["weights_hash"]  # (a DFlash2 run: not the DFlash reference's weights)


def test_train_second_signal_exits_at_once_and_stops_the_workers(zygote, world, tmp_path):
    out = tmp_path / "run"
    config = train_config_file(tmp_path / "train.json", world["cache"], world["target"], num_workers=2)
    run = zygote.run("train", ["--config", config, "--output-dir", out],
                     env={"DFLASH_TEST_SLEEP_IN_CHECKPOINT": "30"})
    wait_until(lambda: not no_staging(out), what="a checkpoint being saved")
    assert len(run.watch_children()) >= 2
    run.signal(signal.SIGINT)
    time.sleep(0.2)
    sent = run.signal(signal.SIGTERM)
    text = assert_stopped(run, signal.SIGTERM, sent, within=3.0)
    assert "exiting now without a checkpoint" in text
    assert complete_checkpoints(out) == []  # the save in progress never became a checkpoint
    finish_training(zygote, world, config, out)


_SECOND_SIGNAL_SCRIPT = r"""
import multiprocessing, os, signal, sys, time
from dflash.runtime.signals import StopRequest

def sleeper():
    time.sleep(60)

class RaisingChild:
    # What torch's DataLoader does when a worker dies: its SIGCHLD handler raises RuntimeError,
    # and it may run in the middle of the kill loop.
    def kill(self):
        raise RuntimeError("DataLoader worker is killed by signal: Killed.")

if __name__ == "__main__":
    child = multiprocessing.get_context("fork").Process(target=sleeper)
    child.start()
    print(child.pid, flush=True)
    signal.signal(signal.SIGCHLD, lambda *a: (_ for _ in ()).throw(RuntimeError("worker died")))
    real = multiprocessing.active_children
    multiprocessing.active_children = lambda: real() + [RaisingChild()]
    with StopRequest(abandoning="exiting now without a checkpoint"):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    print("not reached", flush=True)
"""


def test_train_second_signal_exits_with_its_status_even_if_stopping_a_worker_raises(tmp_path):
    """The second signal's exit must not turn into a traceback (status 1) when killing the
    DataLoader workers raises, as torch's SIGCHLD handler does when it sees a worker die."""
    import subprocess
    import sys

    script = tmp_path / "second_signal.py"
    script.write_text(_SECOND_SIGNAL_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "not reached" not in proc.stdout, proc.stderr
    assert "Second SIGTERM" in proc.stderr and "without a checkpoint" in proc.stderr
    child = int(proc.stdout.split()[0])

    def gone() -> bool:  # exited, or a zombie waiting for init to reap it
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    wait_until(gone, what="the worker to be gone")
