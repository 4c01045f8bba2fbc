"""kill -9 of the trainer while a DataLoader worker starts: the worker must end with it. torch's
worker watches its parent pid from the value it reads when its loop begins; a trainer killed
before that read once left a worker polling forever (seen once in the 20-kill training chain,
killed while the final evaluation's worker started)."""

from __future__ import annotations

import signal

from .helpers import train_config_file, wait_until


def test_a_dataloader_worker_starting_when_its_trainer_is_killed_ends_with_it(zygote, world, tmp_path):
    config = train_config_file(tmp_path / "train.json", world["cache"], world["target"], num_workers=1)
    run = zygote.run("train", ["--config", config, "--output-dir", tmp_path / "run"],
                     env={"DFLASH_TEST_SLEEP_IN_WORKER_INIT": "3"})
    wait_until(lambda: run.watch_children() or run.wait(timeout=0) is not None, timeout=60,
               what="the run's DataLoader worker starting")
    assert run.watch_children(), run.output()
    run.signal(signal.SIGKILL)  # the worker is asleep in its init, before torch's watchdog starts
    assert run.wait(timeout=10) == -signal.SIGKILL
    assert run.surviving_children(grace=10) == []
