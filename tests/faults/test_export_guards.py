"""`dflash-train export` stops on SIGINT with 130 and leaves the previous export or the complete
new one, never a part of one; it writes its OUT_DIR alone and never over the checkpoint it reads
(issue #33, weak spots: the export swallowed SIGINT, exit 0)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from dflash.runtime import fsio
from dflash.runtime.locks import output_lock
from dflash.train.cli import main as train_main
from dflash.train.exports import export as export_module


def latest_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step-*"))[-1]


def export(checkpoint: Path, out: Path):
    return CliRunner().invoke(train_main, ["export", str(checkpoint), str(out)])


def flat(text: str) -> str:
    return " ".join(text.split())


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(fsio.TEMP_PREFIX))


def test_sigint_while_the_weights_are_written_exits_130_and_keeps_the_previous_export(world, tmp_path, monkeypatch):
    out = tmp_path / "export"
    assert export(latest_checkpoint(world["run"]), out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "config.json").write_text(json.dumps({**json.loads(before["config.json"]), "marker": 1}))
    before["config.json"] = (out / "config.json").read_bytes()
    real = export_module.save_file

    def save_file(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: mid-export
        time.sleep(0.5)

    monkeypatch.setattr(export_module, "save_file", save_file)
    res = export(latest_checkpoint(world["run"]), out)
    assert res.exit_code == 130, res.output
    assert (f"dflash-train export stopped by SIGINT: nothing was written to {out} (an export there before "
            "is kept as it was)") in flat(res.output)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous export, untouched
    assert leftovers(tmp_path) == []


def test_sigint_between_the_renames_of_the_swap_leaves_the_complete_new_export(world, tmp_path, monkeypatch):
    out = tmp_path / "export"
    assert export(latest_checkpoint(world["run"]), out).exit_code == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "previous": True}))  # told apart from the new one
    real, calls = os.replace, {"n": 0}

    def replace(src, dst):
        real(src, dst)
        calls["n"] += 1
        if calls["n"] == 1:  # the old export is aside, the new one not yet in place
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(fsio.os, "replace", replace)
    res = export(latest_checkpoint(world["run"]), out)
    monkeypatch.setattr(fsio.os, "replace", real)
    assert res.exit_code == 130, res.output
    assert f"the export to {out} was complete before it stopped" in flat(res.output)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and "previous" not in config  # the default drafter type
    assert (out / "model.safetensors").stat().st_size > 0
    assert leftovers(tmp_path) == []  # the old export was deleted, not left aside


@pytest.mark.parametrize("where", ["checkpoint", "run"])
def test_an_out_dir_that_is_or_holds_the_checkpoint_is_refused(world, tmp_path, where):
    run_dir = Path(shutil.copytree(world["run"], tmp_path / "run"))
    checkpoint = latest_checkpoint(run_dir)
    res = export(checkpoint, checkpoint if where == "checkpoint" else run_dir)
    assert res.exit_code == 2, res.output
    assert "the export would replace it. Choose another OUT_DIR." in flat(res.output)
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "meta.json").is_file()


def test_a_second_export_to_one_out_dir_is_refused_with_the_holders_pid(world, tmp_path):
    out = tmp_path / "export"
    with output_lock(out, purpose="export"):
        res = export(latest_checkpoint(world["run"]), out)
    assert res.exit_code == 2, res.output
    assert f"is being written by another process (pid {os.getpid()} on " in flat(res.output)
    assert not out.exists()
    assert export(latest_checkpoint(world["run"]), out).exit_code == 0
