"""A resumed run takes its checkpoint's weights: an --init-drafter given to the resuming command is
not loaded, and the startup says so instead of announcing a warm start (issue #52, weak spot: it
printed "warm start: the drafter's N weight tensors from X", then loaded the checkpoint over them)."""

from __future__ import annotations

from conftest import tiny_train_config
from dflash.runtime.findings import collected


def test_resuming_with_a_new_init_drafter_ignores_it_and_says_the_checkpoint_wins(tiny_world, tmp_path, capsys,
                                                                                     monkeypatch):
    from dflash.train.exports import warm_start
    from dflash.train.run.loop import train

    first = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "other", max_steps=2,
                                    eval_fraction=0))
    assert first.exit_status == 0
    export = tmp_path / "other" / "final"
    run = tmp_path / "run"
    stopped = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=2, eval_fraction=0))
    assert stopped.checkpoint is not None
    capsys.readouterr()

    def not_read(path, *_):
        raise AssertionError(f"the --init-drafter export {path} was read for a run that resumes")

    monkeypatch.setattr(warm_start, "read_drafter", not_read)  # what reads a drafter, in any layout
    with collected() as found:
        resumed = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=3,
                                          eval_fraction=0, init_drafter=str(export)))
    assert resumed.exit_status == 0 and resumed.step == 3
    said = [f.fields for f in found if f.code == "train.init-drafter-on-resume"]
    assert said == [{"init": str(export), "checkpoint": str(stopped.checkpoint)}], found  # the checkpoint is named
    assert str(stopped.checkpoint) in capsys.readouterr().out  # in the run's log
