"""Two processes (torchrun, gloo on CPU) train what one process trains with the same global
batch, and their checkpoint resumes on one process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, tiny_train_config
from dflash.train.loop import train
from safetensors.torch import load_file

SETTINGS = dict(max_steps=6, save_interval=3, keep_checkpoints=5, epochs=3)


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-5, msg=f"{k} differs")


def start_torchrun(world: dict[str, Path], tmp_path: Path, out: Path, **overrides) -> subprocess.Popen:
    values = tiny_train_config(world["cache"], world["target"], out, **{**SETTINGS, **overrides}).to_dict()
    config = tmp_path / f"{out.name}.json"
    config.write_text(json.dumps(values))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "dflash.train.cli", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )


def resume_on_one_process(world: dict[str, Path], checkpoint: Path, out: Path) -> None:
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint, out / "checkpoints" / checkpoint.name)
    result = train(tiny_train_config(world["cache"], world["target"], out, grad_accum=2, resume=True, **SETTINGS))
    assert result.step == SETTINGS["max_steps"]


@pytest.mark.slow
def test_two_ranks_match_one_rank_with_the_same_global_batch_and_resume_on_one(tiny_world, tmp_path):
    # DDP and FSDP launches overlap with each other and with the one-process reference run.
    runs = {mode: tmp_path / mode for mode in ("ddp", "fsdp")}
    procs = {mode: start_torchrun(tiny_world, tmp_path, out, grad_accum=1, parallel=mode) for mode, out in runs.items()}
    # One process, two micro-batches per step: the same 2 global batches per step.
    one = tmp_path / "one-rank"
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], one, grad_accum=2, **SETTINGS))
    for mode, proc in procs.items():
        output, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{mode}: {output[-4000:]}"

    one_log = [r for r in read_metrics(one) if r["kind"] == "train"]
    for mode, two in runs.items():
        for step in (3, 6):
            assert_close_weights(weights(two, step), weights(one, step))
        # Metrics are reduced over both ranks: each logged step counts both ranks' blocks.
        two_log = [r for r in read_metrics(two) if r["kind"] == "train"]
        assert [round(r["blocks"]) for r in two_log] == [round(r["blocks"]) for r in one_log]
        # The 2-rank checkpoint of step 3 (full state, also under FSDP) continues on one process.
        resumed = tmp_path / f"{mode}-resumed-on-one"
        resume_on_one_process(tiny_world, two / "checkpoints" / "step-000003", resumed)
        assert_close_weights(weights(resumed, 6), weights(two, 6))
