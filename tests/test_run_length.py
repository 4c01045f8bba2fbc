"""How long a run is: --epochs sizes it and --max-steps may end it sooner; a run that --max-steps
ends before its epochs says so at startup (where it ends, and that the learning-rate schedule
spans its steps) and in its last line."""

from __future__ import annotations

import pytest
from conftest import read_metrics, tiny_train_config
from dflash.runtime.findings import codes, collected


def _steps_per_epoch(cfg) -> list[int]:
    from dflash.train.data.caches import open_training_data

    data = open_training_data(cfg, rank=0, world_size=1, pin_memory=False)
    try:
        return list(data.loader.steps_per_epoch)
    finally:
        data.loader.close()


def _lines(out: str, start: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(start)]


def test_a_run_that_max_steps_ends_partway_through_its_epochs_says_where_and_its_schedule_ends_there(
        tiny_world, tmp_path, capsys):
    from dflash.train.run.loop import train

    cfg = tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "run", epochs=3, max_steps=20,
                            eval_fraction=0.3, eval_interval=None, lr_schedule="cosine", min_lr_ratio=0.1)
    first, second, third = _steps_per_epoch(cfg)
    assert first < 20 < first + second  # the 20th step lies inside the second epoch
    capsys.readouterr()
    with collected() as found:
        result = train(cfg)
    assert result.exit_status == 0 and result.step == 20
    out = capsys.readouterr().out
    [note] = [f for f in found if f.code == "train.max-steps-cut"]
    assert note.fields == dict(max_steps=20, step=20, epoch=2, epochs=3, epoch_step=20 - first, epoch_steps=second,
                               all_steps=first + second + third, first_epoch_share=None)
    [schedule] = _lines(out, "schedule over those 20 steps:")
    assert "to 0.1 x --lr at step 20" in schedule and "held-out evaluations every 2 step(s)" in schedule
    # what it says is what the run does: the schedule reaches its floor at step 20, evaluated every 2 steps
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if r["kind"] == "eval"] == list(range(2, 21, 2))
    train_records = [r for r in records if r["kind"] == "train"]
    assert train_records[-1]["step"] == 20 and train_records[-1]["epoch"] == 1  # (counted from 0)
    assert train_records[-1]["lr"] == pytest.approx(0.1 * cfg.optimization.lr)
    [done] = _lines(out, "done: ")
    assert done.startswith(f"done: 20 steps, ended by --max-steps 20 partway through epoch 2 of 3 (step "
                           f"{20 - first} of its {second}; all 3 epoch(s) are {first + second + third} steps); ")


def test_a_run_whose_epochs_end_first_says_nothing_of_max_steps(tiny_world, tmp_path, capsys):
    from dflash.train.run.loop import train

    cfg = tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "run", epochs=1, max_steps=1000,
                            eval_fraction=0.3)
    capsys.readouterr()
    with collected() as found:
        result = train(cfg)
    out = capsys.readouterr().out
    assert result.step == sum(_steps_per_epoch(cfg)) < 1000
    assert "train.max-steps-cut" not in codes(found) and "ended by --max-steps" not in out
    assert _lines(out, f"done: {result.step} steps; ")


def test_where_a_cut_run_ends_is_named_by_epoch():
    from dflash.train.run.run_length import RunLength

    assert RunLength.of([10, 10, 10], 0).cut is False and RunLength.of([10, 10, 10], 30).cut is False
    assert RunLength.of([10, 10, 10], 10).where_it_ends() == "at the end of epoch 1 of 3"
    assert RunLength.of([10, 10, 10], 25).where_it_ends() == "partway through epoch 3 of 3 (step 5 of its 10)"
    assert RunLength.of([10, 10, 10], 25).total_steps == 25 and RunLength.of([10, 10], 99).total_steps == 20


def test_a_run_cut_inside_its_first_epoch_says_what_share_of_it_trains():
    from dflash.train.run.run_length import RunLength

    found = RunLength.of([10, 10, 10], 4).cut_short()
    assert found.code == "train.max-steps-cut" and found.fields["first_epoch_share"] == pytest.approx(0.4)
    assert (found.fields["epoch"], found.fields["epoch_step"], found.fields["epoch_steps"]) == (1, 4, 10)
    assert RunLength.of([10, 10, 10], 30).cut_short() is None
