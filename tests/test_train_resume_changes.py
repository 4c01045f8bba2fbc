"""What a resume does with what changed since its checkpoint: a new --lr, --weight-decay,
--adam-betas or --adam-eps takes effect from the resumed step (the optimizer's and the
scheduler's saved state would keep the old ones), and metrics.jsonl holds each step once."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from conftest import read_metrics, tiny_train_config
from dflash.runtime.findings import collected
from dflash.train.run.loop import lr_multiplier, train

FIRST, THEN = 3, 6
SETTINGS = dict(epochs=5, save_interval=3, keep_checkpoints=3, warmup_ratio=0.34)  # warmup: 2, then 3 steps


def checkpoint_groups(run, step: int) -> list[dict]:
    state = torch.load(run / "checkpoints" / f"step-{step:06d}" / "optimizer.pt", weights_only=True)
    return state["param_groups"]


def logged_lr(run) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(run) if r["kind"] == "train"}


@pytest.fixture
def resumed_with_new_settings(tiny_world, tmp_path):
    run = tmp_path / "run"
    first = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=FIRST, lr=1e-3,
                                    **SETTINGS))
    assert first.step == FIRST
    new = dict(lr=1e-2, weight_decay=0.1, adam_betas=(0.8, 0.99), adam_eps=1e-6)
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=THEN, **new,
                                     **SETTINGS))
    assert result.step == THEN and result.exit_status == 0
    return run, new


def test_a_resume_with_a_new_lr_trains_and_logs_the_new_lr_from_the_resumed_step(resumed_with_new_settings):
    run, new = resumed_with_new_settings
    schedule = functools.partial(lr_multiplier, warmup_ratio=SETTINGS["warmup_ratio"], min_lr_ratio=0.0, schedule="wsd", decay_ratio=0.2)
    lrs = logged_lr(run)
    for step in range(1, FIRST + 1):  # (the scheduler has stepped `step` times when it is logged)
        assert lrs[step] == pytest.approx(1e-3 * schedule(step, total_steps=FIRST))
    for step in range(FIRST + 1, THEN + 1):
        assert lrs[step] == pytest.approx(new["lr"] * schedule(step, total_steps=THEN)), step
    assert any(lrs[step] > 1e-3 for step in range(FIRST + 1, THEN + 1))
    (group,) = checkpoint_groups(run, THEN)
    assert group["initial_lr"] == new["lr"]
    assert group["lr"] == pytest.approx(new["lr"] * schedule(THEN, total_steps=THEN))


def test_a_resume_with_new_weight_decay_betas_and_eps_gives_them_to_the_optimizer(resumed_with_new_settings):
    run, new = resumed_with_new_settings
    (before,) = checkpoint_groups(run, FIRST)
    assert (before["weight_decay"], tuple(before["betas"]), before["eps"]) == (0.0, (0.9, 0.999), 1e-8)
    (after,) = checkpoint_groups(run, THEN)
    assert after["weight_decay"] == new["weight_decay"]
    assert tuple(after["betas"]) == new["adam_betas"]
    assert after["eps"] == new["adam_eps"]


def train_steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if json.loads(line)["kind"] == "train"]


def test_a_resume_drops_the_steps_logged_past_its_checkpoint_so_each_step_is_logged_once(tiny_world, tmp_path, capsys):
    run = tmp_path / "run"
    config = tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=THEN, **SETTINGS)
    train(config)
    # What kill -9 after step 5 leaves: steps 4 and 5 logged, their checkpoint never written
    # (and a line torn by the kill).
    shutil.rmtree(run / "checkpoints" / f"step-{THEN:06d}")
    before = read_metrics(run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "kind": "tr')
    with collected() as found:
        result = train(config)
    assert result.step == THEN
    [dropped] = [f.fields for f in found if f.code == "train.metrics-dropped"]
    assert dropped == dict(file=str(run / "metrics.jsonl"), records=THEN - FIRST + 1, step=FIRST)
    assert train_steps(run / "metrics.jsonl") == list(range(1, THEN + 1))
    after = read_metrics(run)
    assert after[:len(before) - (THEN - FIRST)] == before[:len(before) - (THEN - FIRST)]  # steps to 3 kept as logged


def test_a_fresh_start_in_a_directory_whose_checkpoints_were_deleted_moves_the_old_metrics_aside(
        tiny_world, tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=FIRST, **SETTINGS))
    shutil.rmtree(run / "checkpoints")
    with collected() as found:
        train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=2, **SETTINGS))
    [aside] = [f.fields for f in found if f.code == "train.metrics-set-aside"]
    assert aside == dict(file=str(run / "metrics.jsonl"), aside="metrics.jsonl.1")
    assert train_steps(run / "metrics.jsonl") == [1, 2]
    assert train_steps(run / "metrics.jsonl.1") == list(range(1, FIRST + 1))
    shutil.rmtree(run / "checkpoints")
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=1, **SETTINGS))
    assert train_steps(run / "metrics.jsonl.2") == [1, 2] and train_steps(run / "metrics.jsonl") == [1]
