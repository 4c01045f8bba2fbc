"""The contract every dflash command keeps (dflash.runtime): the same error class gives the same
exit status and one paragraph without a traceback; --config refuses unknown keys with the list
of valid ones; --help never imports torch."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import asdict

import click
import pytest
from click.testing import CliRunner
from dflash.cache_tools.cli import main as cache_main
from dflash.eval.cli import main as eval_main
from dflash.extract.cli import main as extract_main
from dflash.runtime.cli import EXIT_STATUS, Command
from dflash.runtime.errors import EnvironmentFault, InputError, Interrupted
from dflash.runtime.findings import Finding, collected, render, renders
from dflash.train.cli import main as train_main


def invoke(command: click.Command, *args: object) -> click.testing.Result:
    return CliRunner().invoke(command, [str(a) for a in args])


def assert_one_paragraph_error(result: click.testing.Result, *fragments: str) -> None:
    """Status 2 and one paragraph ("Error: ...", a single line) on stderr, no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    err = result.stderr.strip()
    assert err.startswith("Error: ") and "\n" not in err, err
    for fragment in fragments:
        assert fragment in err, err


# -- a missing input --------------------------------------------------------------------------


def _data_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2, 3], "prompt_len": 1}) + "\n")
    return path


MISSING_INPUT_CASES = {
    "extract --data": lambda t: (extract_main, ["--target-model", t / "model", "--data", t / "none.jsonl",
                                                "--output", t / "cache"], "none.jsonl"),
    "extract --target-model": lambda t: (extract_main, ["--target-model", t / "no-model", "--data", _data_file(t),
                                                        "--output", t / "cache", "--no-progress"], "no-model"),
    "train --cache": lambda t: (train_main, ["--cache", t / "no-cache", "--target-model", t / "model",
                                             "--output-dir", t / "run"], "no-cache"),
    "train export": lambda t: (train_main, ["export", t / "no-checkpoint", t / "out"], "no-checkpoint"),
    "cache info": lambda t: (cache_main, ["info", t / "no-cache"], "no-cache"),
    "cache verify": lambda t: (cache_main, ["verify", t / "no-cache"], "no-cache"),
    "cache stats": lambda t: (cache_main, ["stats", t / "no-cache"], "no-cache"),
    "cache prune": lambda t: (cache_main, ["prune", t / "no-cache"], "no-cache"),
    "cache recompress": lambda t: (cache_main, ["recompress", t / "no-cache", t / "dst", "--codec", "fp8"], "no-cache"),
    "cache merge": lambda t: (cache_main, ["merge", t / "dst", t / "no-cache"], "no-cache"),
    "eval --target-model": lambda t: (eval_main, ["--target-model", t / "no-model", "--drafter", t,
                                                  "--prompts", _data_file(t)], "no-model"),
    "eval --prompts": lambda t: (eval_main, ["--target-model", t, "--drafter", t, "--prompts", t / "none.jsonl"],
                                 "none.jsonl"),
}


@pytest.mark.parametrize("case", MISSING_INPUT_CASES)
def test_a_missing_input_is_status_2_and_one_paragraph_in_every_command(tmp_path, case):
    command, args, where = MISSING_INPUT_CASES[case](tmp_path)
    assert_one_paragraph_error(invoke(command, *args), where)


@pytest.mark.parametrize("command,args,missing", [
    (extract_main, ["--data", "x.jsonl"], "--target-model"),
    (train_main, ["--target-model", "m"], "--cache"),
    (cache_main, ["info"], "CACHE"),
    (eval_main, ["--drafter", "."], "--target-model"),
])
def test_a_missing_required_flag_is_status_2_and_one_paragraph(command, args, missing):
    assert_one_paragraph_error(invoke(command, *args), missing)


# -- --config ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command,args,valid", [
    (extract_main, [], "target_model"),
    (train_main, [], "output_dir"),
    (train_main, ["run"], "max_steps"),
    (eval_main, [], "prompts"),
])
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_files_refuse_unknown_keys_listing_the_valid_ones(tmp_path, command, args, valid, suffix):
    pytest.importorskip("yaml") if suffix == ".yaml" else None
    path = tmp_path / f"settings{suffix}"
    path.write_text('{"no_such_setting": 1}\n' if suffix == ".json" else "no-such-setting: 1\n")
    result = invoke(command, *args, "--config", path)
    assert_one_paragraph_error(result, "unknown setting(s) no_such_setting", "Known settings:", valid)


def _subcommands(group: click.Group) -> list[tuple[str, click.Command]]:
    return [(f"{group.name} {name}", command) for name, command in sorted(group.commands.items())]


@pytest.mark.parametrize("name,command", _subcommands(cache_main) + _subcommands(train_main), ids=lambda x: str(x))
def test_every_subcommand_takes_a_config_file_and_refuses_unknown_keys(tmp_path, name, command):
    assert any("--config" in p.opts for p in command.params), f"{name} takes no --config"
    args = [tmp_path if p.nargs == 1 else tmp_path / "x" for p in command.params if isinstance(p, click.Argument)]
    path = tmp_path / "settings.json"
    path.write_text('{"no_such_setting": 1}\n')
    group = cache_main if name.startswith(cache_main.name) else train_main
    result = invoke(group, command.name, *args, "--config", path)
    assert_one_paragraph_error(result, "unknown setting(s) no_such_setting", "Known settings:")


def test_cache_config_values_are_checked_like_flags_and_can_give_a_required_setting(tmp_path):
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"num_tokens": 0}))
    refused = invoke(cache_main, "stats", tmp_path, "--config", path)
    assert_one_paragraph_error(refused, "setting num_tokens = ", "--num-tokens")
    assert_one_paragraph_error(invoke(cache_main, "recompress", tmp_path / "none", tmp_path / "dst"), "--codec")
    path.write_text(json.dumps({"codec": "fp8", "clevel": "3"}))
    given = invoke(cache_main, "recompress", tmp_path / "none", tmp_path / "dst", "--config", path)
    assert_one_paragraph_error(given, "none")  # past the settings: the missing source cache is named
    assert "--codec" not in given.stderr


@pytest.fixture
def captured_eval(monkeypatch):
    """dflash-eval with the measurement replaced: what the command asked for."""
    from dflash.eval import run as eval_cli

    calls = []

    def fake_run_eval(config):
        calls.append(asdict(config))
        return {"settings": {}, "prompt_sets": []}

    monkeypatch.setattr(eval_cli, "run_eval", fake_run_eval)
    return calls


def test_eval_config_accepts_its_documented_keys_and_flags_override_them(tmp_path, captured_eval):
    prompts = [_data_file(tmp_path), tmp_path / "more.jsonl"]
    prompts[1].write_text(prompts[0].read_text())
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"target_model": str(tmp_path), "drafter": str(tmp_path),
                                "prompts": [str(p) for p in prompts], "max-new-tokens": 7, "dtype": "float32",
                                "baseline": False, "stop_token_id": [2]}))
    result = invoke(eval_main, "--config", path, "--max-new-tokens", 9, "--json")
    assert result.exit_code == 0, result.output
    (call,) = captured_eval
    assert call["prompts"] == [str(p) for p in prompts]
    assert call["max_new_tokens"] == 9  # the flag wins over the file
    assert call["dtype"] == "fp32" and call["baseline"] is False and call["stop_token_ids"] == [2]


def test_eval_config_takes_one_prompt_file_as_a_string(tmp_path, captured_eval):
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"target_model": str(tmp_path), "drafter": str(tmp_path),
                                "prompts": str(_data_file(tmp_path))}))
    assert invoke(eval_main, "--config", path, "--json").exit_code == 0
    assert captured_eval[0]["prompts"] == [str(tmp_path / "data.jsonl")]


def test_eval_config_values_are_checked_like_flags(tmp_path, captured_eval):
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"target_model": str(tmp_path), "drafter": str(tmp_path),
                                "prompts": str(_data_file(tmp_path)), "max_new_tokens": "many"}))
    assert_one_paragraph_error(invoke(eval_main, "--config", path), "--max-new-tokens")
    assert captured_eval == []


# -- renamed and listed flags -----------------------------------------------------------------


class _Summary:
    skips: list = []
    interrupted_by = None

    def format(self) -> str:
        return "done"


@pytest.fixture
def captured_extract(monkeypatch):
    from dflash.extract import pipeline

    configs = []
    monkeypatch.setattr(pipeline, "run_extraction", lambda config: configs.append(config) or _Summary())
    return configs


def test_extract_num_draft_layers_is_a_deprecated_alias_of_num_captured_layers(tmp_path, captured_extract):
    base = ["--target-model", tmp_path, "--data", _data_file(tmp_path), "--output", tmp_path / "c"]
    result = invoke(extract_main, *base, "--num-draft-layers", 3)
    assert result.exit_code == 0, result.output
    assert captured_extract[0].num_captured_layers == 3
    assert "deprecated" in result.stderr and "--num-captured-layers" in result.stderr
    config = tmp_path / "extract.json"
    config.write_text(json.dumps({"num_draft_layers": 4}))
    assert invoke(extract_main, *base, "--config", config).exit_code == 0
    assert captured_extract[1].num_captured_layers == 4
    both = invoke(extract_main, *base, "--num-draft-layers", 3, "--num-captured-layers", 3)
    assert_one_paragraph_error(both, "--num-captured-layers")


def test_every_command_takes_the_same_dtype_names(tmp_path, captured_extract, captured_eval):
    from dflash.train.config import TrainConfig

    base = ["--target-model", tmp_path, "--data", _data_file(tmp_path), "--output", tmp_path / "c"]
    assert invoke(extract_main, *base, "--dtype", "float32").exit_code == 0
    assert captured_extract[0].dtype == "fp32"
    assert TrainConfig.from_dict(dict(cache=["c"], target_model="m", output_dir="o", dtype="bfloat16")).runtime.dtype == "bf16"
    evaluated = invoke(eval_main, "--target-model", tmp_path, "--drafter", tmp_path, "--prompts",
                       _data_file(tmp_path), "--dtype", "bfloat16", "--json")
    assert evaluated.exit_code == 0 and captured_eval[0]["dtype"] == "bf16"
    for command, args in [(extract_main, []), (train_main, ["export"]), (eval_main, [])]:
        assert "fp32]" in invoke(command, *args, "--help").output


def test_generated_train_flags_list_their_choices_in_help():
    text = invoke(train_main, "run", "--help").output
    for choices in ("[auto|bf16|fp32]", "[ddp|fsdp]", "[none|uniform|gaussian]", "[auto|sdpa|flex]"):
        assert choices in text


def test_dflash_train_help_is_the_default_commands_help_with_the_training_options():
    top, run_help = invoke(train_main, "--help"), invoke(train_main, "run", "--help")
    assert top.exit_code == 0 and run_help.exit_code == 0
    assert top.output == run_help.output
    for flag in ("--cache", "--lr", "--epochs", "--drafter-type", "--output-dir"):
        assert flag in top.output
    assert "dflash-train export" in top.output and "dflash-train estimate" in top.output
    assert invoke(train_main, "export", "--help").output != top.output


def test_the_choices_the_clis_spell_out_are_the_ones_the_code_accepts():
    # one tuple each, imported where it is used (a copy could drift: tests/test_settings_identity.py)
    from dflash.cache_tools import cli as cache_cli
    from dflash.cache_tools.codecs import CODEC_NAMES
    from dflash.extract.config import ExtractConfig
    from dflash.runtime.settings import settings_of
    from dflash.train import config, heads
    from dflash.train.model import attention
    from dflash.train.model import drafter as model

    for cls in (cache_cli.RecompressSettings, cache_cli.ImportSettings, ExtractConfig):
        assert settings_of(cls)["codec"].spec.choices is CODEC_NAMES, cls
    assert settings_of(config.TrainConfig)["attention_backend"].spec.choices is attention.ATTENTION_BACKENDS
    assert settings_of(config.TrainConfig)["compile_mode"].spec.choices is model.COMPILE_MODES
    assert config.DRAFTER_TYPES == heads.head_names()


def test_every_console_script_runs_under_the_contract():
    import configparser
    import importlib
    from pathlib import Path

    from dflash.runtime.cli import Group

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parent.parent / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    scripts = dict(tuple(x.strip() for x in line.split("=", 1)) for line in lines)
    assert {"dflash-extract", "dflash-train", "dflash-cache", "dflash-eval", "dflash-demo"} <= set(scripts)
    for name, target in scripts.items():
        module, attr = target.split(":")
        assert isinstance(getattr(importlib.import_module(module), attr), (Command, Group)), name


# -- --help does not import torch -------------------------------------------------------------

HELP_SCRIPT = """
import contextlib, io, json, sys
from dflash.cache_tools.cli import main as cache
from dflash.extract.cli import main as extract
from dflash.train.cli import main as train
from dflash.demo.cli import main as demo
from dflash.eval.cli import main as evaluate
for command, args in [(extract, []), (train, []), (train, ["run"]), (train, ["export"]), (cache, []),
                      (cache, ["verify"]), (cache, ["merge"]), (evaluate, []), (demo, [])]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        command([*args, "--help"])
print(json.dumps(sorted(m for m in ("torch", "transformers", "zarr") if m in sys.modules)))
"""


def test_help_of_every_command_imports_neither_torch_nor_transformers():
    out = subprocess.run([sys.executable, "-c", HELP_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "torch" not in loaded and "transformers" not in loaded, loaded


# -- the exit-status table itself -------------------------------------------------------------


@renders("test.stopped", example=dict(command="dflash-x", signal="SIGINT"))
def _stopped(command, signal):
    return f"{command} stopped by {signal}; nothing was lost."


@renders("test.out-of-memory", example=dict(command="dflash-x", error="CUDA out of memory"))
def _out_of_memory(command, error):
    return f"{command} ran out of device memory ({error}). Lower --token-budget."


def _command_raising(error: BaseException) -> click.Command:
    @click.command(cls=Command, name="dflash-x", stop_note="test.stopped")
    def main() -> None:
        raise error

    return main


def test_the_devices_out_of_memory_error_is_an_environment_fault_with_the_commands_advice():
    # Not a bug: the batch did not fit beside what else was on the device. One paragraph with
    # torch's first sentence (the sizes) and what to lower, the environment's status, no traceback.
    import torch

    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.45 GiB. GPU 0 has a total "
                                   "capacity of 139.80 GiB of which 1.98 GiB is free. Process 12545 has 70.46 GiB")

    @click.command(cls=Command, name="dflash-x", oom_advice="test.out-of-memory")
    def main() -> None:
        raise error

    with collected() as said:
        result = invoke(main)
    assert [(f.code, f.fields) for f in said] == [("test.out-of-memory", {"command": "dflash-x",
                                                                          "error": "CUDA out of memory"})]
    assert result.exit_code == EXIT_STATUS[EnvironmentFault] != 1, result.output
    assert "Traceback" not in result.stderr and "bug" not in result.stderr
    assert "dflash-x ran out of device memory (CUDA out of memory)" in result.stderr
    assert result.stderr.rstrip().endswith("Lower --token-budget.")
    assert result.stderr.count("Error:") == 1 and "\n" not in result.stderr.strip()
    # The trainer's advice names what a rerun may change and what starts a new run.
    from dflash.train.cli import TrainGroup

    advice = render(Finding(TrainGroup.oom_advice, command="dflash-train", error="CUDA out of memory"))
    assert all(f in advice for f in ("--logits-chunk-mib", "--gradient-checkpointing", "--token-budget"))


@pytest.mark.parametrize("error,status,fragment", [
    (InputError("data.jsonl, line 3: not JSON."), 2, "Error: data.jsonl, line 3: not JSON."),
    (FileNotFoundError(2, "No such file or directory", "/x/y"), 2, "Error: No such file or directory (/x/y)."),
    (Interrupted(signal.SIGTERM), 143, "dflash-x stopped by SIGTERM; nothing was lost."),
    (KeyboardInterrupt(), 130, "dflash-x stopped by SIGINT; nothing was lost."),
    (RuntimeError("boom"), 1, "This is a bug"),
])
def test_every_error_class_maps_to_its_exit_status(error, status, fragment):
    result = invoke(_command_raising(error))
    assert result.exit_code == status, result.output
    assert fragment in result.stderr
    assert ("Traceback" in result.stderr) == (status == 1)  # only a bug shows its traceback


# -- each command's own words for the contract's findings --------------------------------------


def test_a_stop_and_an_os_error_are_findings_with_the_command_signal_and_file():
    with collected() as said:
        stopped = invoke(_command_raising(Interrupted(signal.SIGTERM)))
        failed = invoke(_command_raising(PermissionError(13, "Permission denied", "/x/y")))
    assert (stopped.exit_code, failed.exit_code) == (143, EXIT_STATUS[EnvironmentFault])
    assert [(f.code, f.fields) for f in said] == [
        ("test.stopped", {"command": "dflash-x", "signal": "SIGTERM"}),
        ("runtime.os-error", {"error": "Permission denied", "file": "/x/y"})]


def _contract_codes() -> dict[str, click.Command]:
    from dflash.demo.cli import main as demo_main
    from dflash.eval.compare import main as compare_main
    from dflash.prepare.cli import main as prepare_main
    from dflash.prepare.generate_cli import main as generate_main

    return {c.name: c for c in (extract_main, cache_main, train_main, eval_main, compare_main, prepare_main,
                                generate_main, demo_main)}


@pytest.mark.parametrize("name, kept", [
    ("dflash-extract", "committed parts are kept"), ("dflash-cache", "committed parts are kept"),
    ("dflash-train", "complete checkpoints are kept"), ("dflash-compare", "complete checkpoints are kept"),
    ("dflash-prepare", "nothing was written"), ("dflash-generate", "every finished record is kept"),
    ("dflash-demo", "rerun it"), ("dflash-eval", "stopped by SIGINT."),
])
def test_each_commands_stop_says_what_was_kept(name, kept):
    command = _contract_codes()[name]
    text = render(Finding(command.stop_note, command=name, signal="SIGINT"))
    assert text.startswith(f"{name} stopped by SIGINT") and kept in text
    for code, fields in ((command.oom_advice, dict(command=name, error="CUDA out of memory")),
                         (command.os_error_advice, dict(error="No space left on device", file="f"))):
        assert not render(Finding(code, **fields)).startswith(f"{code}:")  # a registered renderer


@renders("test.compile-failed", example=dict(command="dflash-x", error="CompilationError: at 1:0"))
def _compile_failed(command, error):
    return f"{command}: torch.compile failed ({error}). Rerun it with --no-compile."


def test_a_compile_failure_keeps_its_traceback_and_says_how_to_run_without_compiling():
    # torch.compile's failure (dynamo's or inductor's) is reported as what it is: the traceback a
    # report needs, then the command's own finding with the error's first line and the way around it.
    import torch._inductor.exc

    error = torch._inductor.exc.InductorError(RuntimeError("CompilationError: at 12:4:\n    tl.store(...)"), None)

    @click.command(cls=Command, name="dflash-x", compile_advice="test.compile-failed")
    def main() -> None:
        raise error

    with collected() as said:
        result = invoke(main)
    assert [f.code for f in said] == ["test.compile-failed"]
    assert said[0].fields["command"] == "dflash-x" and "CompilationError: at 12:4:" in said[0].fields["error"]
    assert result.exit_code == 1 and "Traceback" in result.stderr
    assert "This is a bug" not in result.stderr and result.stderr.rstrip().endswith("Rerun it with --no-compile.")
    # dflash-train and dflash-compare name their flag
    from dflash.train.cli import TrainGroup

    assert "--no-compile" in render(Finding(TrainGroup.compile_advice, command="dflash-train", error="x"))
    assert _contract_codes()["dflash-compare"].compile_advice == TrainGroup.compile_advice
