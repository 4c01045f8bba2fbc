"""The TrainState a checkpoint holds (train/run/checkpoint.py): the loader's position is stored once, the
trainer state is versioned, a checkpoint of the earlier layout (no version, the position in
meta.json too) still resumes to the uninterrupted run's weights, and a later version is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import assert_same_weights, final_weights, tiny_train_config
from dflash.train.config import ResumeMismatchError
from dflash.train.run.checkpoint import TRAIN_STATE_VERSION
from dflash.train.run.loop import train

SETTINGS = dict(max_steps=4, epochs=2, save_interval=2, keep_checkpoints=5, noise_type="uniform", noise_start=0.05)


@pytest.fixture(scope="module")
def reference(tiny_world, tmp_path_factory):
    out = tmp_path_factory.mktemp("state") / "run"
    assert train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, **SETTINGS)).step == 4
    return out


def _resume_from_step_2(reference, tmp_path, rewrite):
    """A copy of the reference run cut back to its step-2 checkpoint, rewritten by `rewrite`."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "checkpoints" / "step-000004")
    shutil.rmtree(out / "final")
    rewrite(out / "checkpoints" / "step-000002")
    return out


def test_a_checkpoint_stores_the_loader_position_once_in_a_versioned_trainer_state(reference):
    step = reference / "checkpoints" / "step-000002"
    trainer = torch.load(step / "trainer.pt", weights_only=True)
    meta = json.loads((step / "meta.json").read_text())
    assert trainer["version"] == TRAIN_STATE_VERSION
    assert set(trainer) == {"version", "scheduler", "loader", "rng", "heldout"}
    assert trainer["loader"]["batches_consumed"] > 0 and "loader" not in meta
    assert meta["step"] == 2 and meta["identity"]["caches"]


def test_a_checkpoint_of_the_earlier_layout_resumes_to_the_uninterrupted_weights(tiny_world, reference, tmp_path):
    def earlier_layout(step):  # as dflash-train wrote it before TrainState: no version, the position twice
        trainer = torch.load(step / "trainer.pt", weights_only=True)
        del trainer["version"]
        torch.save(trainer, step / "trainer.pt")
        meta = json.loads((step / "meta.json").read_text())
        meta["loader"] = trainer["loader"]
        (step / "meta.json").write_text(json.dumps(meta))

    out = _resume_from_step_2(reference, tmp_path, earlier_layout)
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, **SETTINGS))
    assert result.step == 4 and result.exit_status == 0
    assert_same_weights(final_weights(out), final_weights(reference))


def test_a_trainer_state_of_a_later_version_is_refused(tiny_world, reference, tmp_path):
    def later_version(step):
        trainer = torch.load(step / "trainer.pt", weights_only=True)
        torch.save({**trainer, "version": TRAIN_STATE_VERSION + 1}, step / "trainer.pt")

    out = _resume_from_step_2(reference, tmp_path, later_version)
    with pytest.raises(ResumeMismatchError) as e:
        train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, **SETTINGS))
    assert e.value.code == "train.trainer-state-version"
    assert e.value.fields == {"version": TRAIN_STATE_VERSION + 1, "current": TRAIN_STATE_VERSION}
