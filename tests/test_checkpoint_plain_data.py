"""A checkpoint's optimizer.pt and trainer.pt are plain data, read with `weights_only=True`: what
the trainer writes loads that way, and a file holding any other pickled object is refused with
one clear paragraph before anything in it runs."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from dflash.train.run.checkpoint import (
    TRAINER_FILE,
    CheckpointCorruptError,
    Checkpointer,
    capture_rng,
    restore_rng,
)


def _save(tmp_path, trainer_state):
    checkpoints = Checkpointer(tmp_path / "run")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    path = checkpoints.save(4, model.state_dict(), optimizer.state_dict(), trainer_state, {"identity": {}})
    return checkpoints, path


def test_the_rng_and_trainer_state_written_loads_with_weights_only_and_restores_every_stream(tmp_path):
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    np.random.standard_normal()  # a cached Gaussian in numpy's state
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]),
                                                  lambda s: 0.5)
    state = {"rng": capture_rng(), "scheduler": scheduler.state_dict(),
             "loader": {"version": 1, "epoch": np.int64(1), "batches_consumed": 12}}
    expected = (random.random(), np.random.standard_normal(), torch.rand(3))

    checkpoints, path = _save(tmp_path, state)
    # The file itself is readable with weights_only=True (no global beyond plain data).
    torch.load(path / TRAINER_FILE, weights_only=True)
    loaded = checkpoints.load(path).trainer
    assert loaded["loader"]["epoch"] == 1 and type(loaded["loader"]["epoch"]) is int  # numpy scalars made plain
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    restore_rng(loaded["rng"])
    got = (random.random(), np.random.standard_normal(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


class _RunsCode:
    """A pickled object that, when unpickled, calls a function: here one that writes a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("payload", ["object", "numpy array"])
def test_a_trainer_file_holding_a_pickled_object_is_refused_without_running_it(tmp_path, payload):
    checkpoints, path = _save(tmp_path, {"rng": capture_rng()})
    marker = tmp_path / "code-ran"
    bad = _RunsCode(marker) if payload == "object" else np.arange(3)
    torch.save({"rng": capture_rng(), "extra": bad}, path / TRAINER_FILE)

    with pytest.raises(CheckpointCorruptError) as e:
        checkpoints.load(path)
    message = str(e.value)
    assert not marker.exists(), "unpickling ran the object's code"
    assert e.value.code == "train.checkpoint-pickled"  # what is wrong, naming the file and what was pickled
    assert e.value.fields["file"] == str(path / TRAINER_FILE) and e.value.fields["checkpoint"] == str(path)
    pickled = e.value.fields["pickled"]
    assert pickled == "io.open" if payload == "object" else pickled.startswith("numpy")
    assert "\n" not in message and "weights_only" not in message  # one paragraph, no torch internals
