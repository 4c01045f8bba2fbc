"""Inputs that worked but misled (issue #33, weak spots, the rest): a drafter given as the
target, files the data scan skips without a word, a training run with nothing to learn (it
exited 0 with loss 0), and a drafter evaluated with a target of other weights than it was
trained against (passed silently)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner
from dflash.eval.cli import main as eval_main
from dflash.extract.cli import main as extract_main
from dflash.runtime.findings import codes, collected
from dflash.train.cli import main as train_main
from safetensors.torch import load_file, save_file

from .helpers import extract_argv, train_config_file, write_jsonl


def flat(text: str) -> str:
    return " ".join(text.split())


def prompts(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "prompts.jsonl", [{"input_ids": [3, 4, 5, 6, 7]}])


def evaluate(target: Path, drafter: Path, tmp_path: Path):
    return CliRunner().invoke(eval_main, ["--target-model", str(target), "--drafter", str(drafter),
                                          "--prompts", str(prompts(tmp_path)), "--max-new-tokens", "8"])


def test_a_drafter_given_as_the_target_is_called_a_drafter(world, tmp_path):
    drafter = world["run"] / "final"
    said = f"{drafter} is a DFlash drafter export (config.json architectures ['DFlash2DraftModel']), not a target model"  # the default type
    results = {
        "extract": CliRunner().invoke(extract_main, extract_argv(drafter, world["data"], tmp_path / "cache")),
        "train": CliRunner().invoke(train_main, ["--config", str(train_config_file(
            tmp_path / "train.json", world["cache"], drafter)), "--output-dir", str(tmp_path / "run")]),
        "eval": evaluate(drafter, drafter, tmp_path),
    }
    for command, res in results.items():
        assert res.exit_code == 2, (command, res.output)
        assert said in flat(res.output) and "Traceback" not in res.output, (command, res.output)
    assert not (tmp_path / "cache").exists()


def test_files_the_data_scan_skips_are_named_in_one_note(world, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(world["data"], data / "a.jsonl")
    (data / "b.jsonl.bz2").write_bytes(b"BZh9")
    shutil.copy(world["data"], data / "C.JSONL")
    (data / ".hidden").write_text("")
    with collected() as said:
        res = CliRunner().invoke(extract_main, extract_argv(world["target"], data, tmp_path / "cache"))
    assert res.exit_code == 0, res.output
    [skipped] = [f for f in said if f.code.startswith("extract.data-")]  # one note (its renderer: rename C.JSONL)
    assert skipped.code == "extract.data-files-skipped" and skipped.fields["dir"] == str(data)
    assert skipped.fields["files"] == ["C.JSONL", "b.jsonl.bz2"]  # not .hidden


def test_training_with_nothing_to_learn_is_refused(world, tmp_path):
    data = write_jsonl(tmp_path / "short.jsonl", [{"input_ids": [i + 3], "loss_mask": [1]} for i in range(12)])
    cache = tmp_path / "cache"
    res = CliRunner().invoke(extract_main, extract_argv(world["target"], data, cache))
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(train_main, ["--config", str(train_config_file(tmp_path / "train.json", cache,
                                                                            world["target"])),
                                          "--output-dir", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    text = flat(res.output)
    assert "Nothing to learn: every one of the" in text and "training samples is 1 token long" in text, text
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))


def test_eval_warns_when_the_drafter_was_trained_against_other_weights(world, tmp_path):
    drafter = world["run"] / "final"
    recorded = json.loads((drafter / "config.json").read_text())["dflash_training"]
    assert recorded["target"]["weights_hash"] and recorded["target_path"] == str(world["target"].resolve())
    with collected() as said:
        res = evaluate(world["target"], drafter, tmp_path)
    assert res.exit_code == 0, res.output
    assert "train.drafter-other-target" not in codes(said)

    other = Path(shutil.copytree(world["target"], tmp_path / "other-weights"))
    weights = load_file(str(other / "model.safetensors"))
    name = next(k for k in weights if "layers.0.mlp" in k)
    weights[name] = weights[name] + 0.01  # the same config.json, other weights
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    with collected() as said:
        res = evaluate(other, drafter, tmp_path)
    assert res.exit_code == 0, res.output
    [warned] = [f for f in said if f.code == "train.drafter-other-target"]
    assert warned.fields["drafter"] == str(drafter) and warned.fields["trained"] == str(world["target"].resolve())
    assert warned.fields["here"] == str(other.resolve())
    assert [key for key, _, _ in warned.fields["differences"]] == ["weights_hash"]  # the same config.json
    assert f"warning: the drafter {drafter}" in flat(res.output)  # said on stderr, naming the drafter
