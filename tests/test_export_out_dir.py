"""An export replaces its OUT_DIR whole, so it replaces only what an export wrote: an empty
directory or an earlier export. `dflash-train export` onto a directory of anything else (a
user's notes, a target model, an earlier export someone added a file to), onto `.` or onto a
file is refused in one paragraph naming the directory and what to do, and deletes nothing;
a run whose RUN_DIR/final holds such files is refused before it trains."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import dflash.train.exports.export as export_module
import pytest
from click.testing import CliRunner
from conftest import tiny_train_config
from dflash.runtime.errors import InputError
from dflash.runtime.findings import Finding, render
from dflash.runtime.fsio import TEMP_PREFIX
from dflash.train.cli import main as train_main
from dflash.train.exports.export import OUT_DIR_PURPOSES, export_drafter, export_out_dir
from dflash.train.exports.messages import OUT_DIR_WORDS
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.run.loop import train
from safetensors.torch import save_file
from test_drafter_support import save_tiny_target


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint as dflash-train writes it, as far as `export` reads one: meta.json with the
    drafter's config, and its weights."""
    root = tmp_path_factory.mktemp("export-out-dir")
    drafter = DFlashDrafter.from_target(save_tiny_target(root / "target"), drafter_type="dflash",
                                        num_hidden_layers=1, block_size=4)
    path = root / "run" / "checkpoints" / "step-000001"
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(path / "model.safetensors"))
    (path / "meta.json").write_text(json.dumps({"step": 1, "drafter_config": dataclasses.asdict(drafter.config)}))
    return path


def export(checkpoint: Path, out: Path | str):
    return CliRunner().invoke(train_main, ["export", str(checkpoint), str(out)])


def flat(text: str) -> str:
    return " ".join(text.split())


def contents(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def user_notes(out: Path) -> None:
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "todo.txt").write_text("keep me")


def target_model(out: Path) -> None:
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    (out / "model.safetensors").write_bytes(b"the target's weights")


def export_with_a_readme(out: Path) -> None:
    export_drafter(DFlashDrafter.from_target(save_tiny_target(out.parent / "t"), drafter_type="dflash",
                                             num_hidden_layers=1, block_size=4), out)
    (out / "README.md").write_text("how I serve it")


@pytest.mark.parametrize("holding", [user_notes, target_model, export_with_a_readme])
def test_an_out_dir_holding_what_no_export_wrote_is_refused_and_keeps_every_file(checkpoint, tmp_path, holding):
    out = tmp_path / "out"
    holding(out)
    before = contents(out)
    res = export(checkpoint, out)
    assert res.exit_code == 2, res.output
    said = flat(res.output)
    assert f"OUT_DIR {out} already holds files that are not a drafter export" in said
    assert "Choose a new or empty directory, or remove that one yourself" in said and "Traceback" not in said
    assert contents(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)] == []


@pytest.mark.parametrize("given", [".", "./", "../here", "..", "empty/.."])
def test_an_out_dir_that_is_the_current_directory_or_holds_it_is_refused_without_a_traceback(
        checkpoint, tmp_path, monkeypatch, given):
    here = tmp_path / "here"
    (here / "empty").mkdir(parents=True)
    (here / "notes.txt").write_text("keep me")
    monkeypatch.chdir(here)
    res = export(checkpoint, given)
    assert res.exit_code == 2, res.output
    said = flat(res.output)
    assert "is the current directory or holds it" in said and "Name a new directory for it instead" in said
    assert "Traceback" not in said and "empty name" not in said
    assert (here / "notes.txt").read_text() == "keep me" and (here / "empty").is_dir()


def test_an_out_dir_that_is_a_file_is_refused_and_kept(checkpoint, tmp_path):
    (tmp_path / "out").write_text("a file")
    res = CliRunner().invoke(train_main, ["export", str(checkpoint), str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert (tmp_path / "out").read_text() == "a file"


@pytest.mark.parametrize("before", ["empty", "an earlier export"])
def test_an_empty_directory_or_an_earlier_export_is_replaced_by_the_export(checkpoint, tmp_path, before):
    out = tmp_path / "out"
    out.mkdir()
    if before == "an earlier export":
        assert export(checkpoint, out).exit_code == 0
        (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()), "old": 1}))
    res = export(checkpoint, out)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert "old" not in json.loads((out / "config.json").read_text())


def test_files_put_into_the_out_dir_while_it_exports_are_kept_and_the_export_refused(checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    real = export_module.save_file

    def save_and_meanwhile_a_note_appears(*args, **kwargs):
        real(*args, **kwargs)
        (out / "notes.txt").write_text("written meanwhile")

    monkeypatch.setattr(export_module, "save_file", save_and_meanwhile_a_note_appears)
    res = export(checkpoint, out)
    assert res.exit_code == 2, res.output
    assert "already holds files that are not a drafter export (notes.txt)" in flat(res.output)
    assert contents(out) == {"notes.txt": b"written meanwhile"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)] == []  # the staged export went


def test_a_run_whose_final_directory_holds_other_files_is_refused_before_it_trains(tiny_world, tmp_path):
    run = tmp_path / "run"
    user_notes(run / "final")
    with pytest.raises(InputError) as refused:
        train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=1))
    assert refused.value.code == "train.export-out-holds-files"
    assert refused.value.fields["path"] == str(run / "final") and refused.value.fields["files"] == ["notes/"]
    assert refused.value.fields["purpose"] == "run-final"  # rendered with the flag that chooses another: --output-dir
    assert (run / "final" / "notes" / "todo.txt").read_text() == "keep me"
    assert not (run / "checkpoints").exists()  # refused before the first step


def test_each_out_dir_purpose_names_the_directory_its_way_and_says_what_to_do(tmp_path):
    assert set(OUT_DIR_WORDS) == set(OUT_DIR_PURPOSES)
    for purpose in OUT_DIR_PURPOSES:
        text = render(Finding("train.export-out-holds-files", purpose=purpose, path="out", absolute=None,
                              files=["a.txt"], more=0))
        assert "out already holds files that are not a drafter export (a.txt)" in text
    assert text.startswith("The run's export directory out") and "--output-dir" in text  # (run-final: last)
    with pytest.raises(ValueError):  # a purpose with no words is a bug
        export_out_dir(tmp_path / "out", purpose="The export directory")
