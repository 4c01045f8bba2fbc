"""The one settings path (dflash.runtime.settings): every config-file value is converted and
checked exactly like its flag, in every command, and flags given override the file."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner
from dflash.eval.cli import main as eval_main
from dflash.extract.cli import main as extract_main
from dflash.runtime.cli import Command
from dflash.runtime.settings import flat_values, section, setting, settings_of, settings_options
from dflash.train.cli import main as train_main


def _data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2, 3], "prompt_len": 1}) + "\n")
    return path


@pytest.fixture
def captured(monkeypatch):
    """Each command with its work replaced: the settings object it would have run with."""
    from dflash.eval import run as eval_run
    from dflash.extract import pipeline
    from dflash.train.run import loop

    seen: list = []
    summary = SimpleNamespace(skips=[], interrupted_by=None, format=lambda: "done")
    monkeypatch.setattr(pipeline, "run_extraction", lambda config: seen.append(config) or summary)
    monkeypatch.setattr(loop, "train", lambda config: seen.append(config) or SimpleNamespace(exit_status=0))

    def fake_eval(config):
        seen.append(config)
        return {"settings": {}, "prompt_sets": []}

    monkeypatch.setattr(eval_run, "run_eval", fake_eval)
    return seen


COMMANDS = {
    "extract": (extract_main, lambda t: {"target_model": str(t), "data": str(_data(t)), "output": str(t / "c")}),
    "train": (train_main, lambda t: {"cache": [str(t / "c")], "target_model": str(t), "output_dir": str(t / "r")}),
    "eval": (eval_main, lambda t: {"target_model": str(t), "drafter": str(t), "prompts": [str(_data(t))],
                                   "json": True}),
}


def run(tmp_path, command: str, settings: dict, *flags: object):
    main, base = COMMANDS[command]
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({**base(tmp_path), **settings}))
    return CliRunner().invoke(main, ["--config", str(path), *map(str, flags)])


def assert_refused(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    err = result.stderr.strip()
    assert err.startswith("Error: ") and "\n" not in err, err
    for fragment in fragments:
        assert fragment in err, err


# (command, setting, value, what the message names): each value is one the flag would refuse.
REFUSED = [
    ("extract", "token_budget", "big", "'big' is not a valid integer"),
    ("extract", "part_tokens", 1000.7, "truncated"),
    ("extract", "force", "maybe", "not a valid boolean"),
    ("extract", "skip_bad", 1, "expected true or false"),
    ("extract", "store_last_hidden", "", "expected true or false"),
    ("extract", "store_topk", True, "not a boolean"),
    ("extract", "codec", "zip", "'zip' is not one of"),
    ("extract", "target_layer_ids", [1, 2.5], "comma-separated list of integers"),
    ("extract", "max_seq_len", [8192], "not a list"),
    ("train", "token_budget", "big", "'big' is not a valid integer"),
    ("train", "max_steps", 10.5, "truncated"),
    ("train", "resume", "maybe", "not a valid boolean"),
    ("train", "compile", 0, "expected true or false"),
    ("train", "parallel", "zero", "'zero' is not one of"),
    ("train", "adam_betas", [0.9], "expected 2 values"),
    ("train", "lr", {"peak": 1}, "not a mapping"),
    ("eval", "max_new_tokens", "many", "'many' is not a valid integer"),
    ("eval", "batch_size", 2.5, "truncated"),
    ("eval", "baseline", "maybe", "not a valid boolean"),
    ("eval", "strict", 1, "expected true or false"),
    ("eval", "stop_token_ids", [True], "not a boolean"),
    ("eval", "dtype", "int8", "'int8' is not one of"),
    ("eval", "prompts", ["no-such.jsonl"], "does not exist"),
    ("eval", "temperature", "nan", "is not a finite number"),  # a float setting is finite (a range lets nan by)
    ("eval", "temperature", "inf", "is not a finite number"),
    ("extract", "top1_share", "nan", "is not a finite number"),
]


@pytest.mark.parametrize("command,name,value,fragment", REFUSED, ids=[f"{c}-{n}-{v!r}" for c, n, v, _ in REFUSED])
def test_a_config_value_the_flag_would_refuse_is_refused_naming_file_setting_and_flag(
        tmp_path, captured, command, name, value, fragment):
    flag = settings_of(_settings_class(command))[name].flag
    result = run(tmp_path, command, {name: value})
    assert_refused(result, "settings.json", f"setting {name} = ", flag, fragment)
    assert captured == []  # nothing ran


def _settings_class(command: str) -> type:
    from dflash.eval.cli import EvalCommandConfig
    from dflash.extract.config import ExtractConfig
    from dflash.train.config import TrainConfig

    return {"extract": ExtractConfig, "train": TrainConfig, "eval": EvalCommandConfig}[command]


# (command, setting, value in the file, the value the command runs with)
ACCEPTED = [
    ("extract", "force", "false", False),
    ("extract", "force", "true", True),
    ("extract", "skip_bad", "false", False),
    ("extract", "store_last_hidden", "false", False),
    ("extract", "store_last_hidden", "yes", True),
    ("extract", "part_tokens", 1000.0, 1000),
    ("extract", "token_budget", "4096", 4096),
    ("extract", "target_layer_ids", "1,3", [1, 3]),
    ("extract", "dtype", "float32", "fp32"),
    ("train", "resume", "false", False),
    ("train", "verify_checksums", "off", False),
    ("train", "adam_betas", "0.9,0.95", (0.9, 0.95)),
    ("train", "cache", "one-cache", ["one-cache"]),
    ("train", "max_steps", 5.0, 5),
    ("eval", "baseline", "false", False),
    ("eval", "ignore_eos", "true", True),
    ("eval", "stop_token_id", 2, [2]),
    ("eval", "dtype", "bfloat16", "bf16"),
]


@pytest.mark.parametrize("command,name,value,expected", ACCEPTED, ids=[f"{c}-{n}-{v!r}" for c, n, v, _ in ACCEPTED])
def test_a_config_value_means_what_the_flag_would_mean(tmp_path, captured, command, name, value, expected):
    result = run(tmp_path, command, {name: value})
    assert result.exit_code == 0, result.output
    attribute = {"stop_token_id": "stop_token_ids"}.get(name, name)
    got = _value(captured[0], attribute)
    assert got == expected and type(got) is type(expected), got


@pytest.mark.parametrize("command,name,file_value,flag,flag_value,expected", [
    ("extract", "force", True, "--force", None, True),
    ("extract", "store_last_hidden", True, "--no-store-last-hidden", None, False),
    ("extract", "token_budget", 1024, "--token-budget", 2048, 2048),
    ("train", "lr", 1e-3, "--lr", "3e-4", 3e-4),
    ("eval", "max_new_tokens", 7, "--max-new-tokens", 9, 9),
])
def test_flags_given_override_the_file(tmp_path, captured, command, name, file_value, flag, flag_value, expected):
    flags = [flag] if flag_value is None else [flag, flag_value]
    result = run(tmp_path, command, {name: file_value}, *flags)
    assert result.exit_code == 0, result.output
    assert _value(captured[0], name) == expected


def _value(settings, name: str):
    """A setting of what a command ran with (sections flattened, as in a config file)."""
    return flat_values(settings)[name] if dataclasses.is_dataclass(settings) else getattr(settings, name)


def test_a_file_value_is_kept_where_no_flag_is_given(tmp_path, captured):
    result = run(tmp_path, "extract", {"part_tokens": 4096, "force": True}, "--token-budget", 1024)
    assert result.exit_code == 0, result.output
    assert (captured[0].part_tokens, captured[0].force, captured[0].token_budget) == (4096, True, 1024)



# -- a value of another type for a setting of text ---------------------------------------------


def run_yaml(tmp_path, command: str, line: str, *flags: object):
    """The command with a YAML config file: its base settings, then `line` as written."""
    yaml = pytest.importorskip("yaml")
    main, base = COMMANDS[command]
    key = line.split(":", 1)[0]
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in base(tmp_path).items() if k != key}) + line + "\n")
    return CliRunner().invoke(main, ["--config", str(path), *map(str, flags)])


# (command, the line as written, what YAML reads, the fix the message gives)
TYPED_BY_YAML = [
    ("extract", "output: 0755", "setting output = 493 ", 'Quote it: output: "0755"'),
    ("extract", "device: no", "setting device = False ", 'Quote it: device: "no"'),
    ("extract", "codec: 1.5e+3", "setting codec = 1500.0 ", 'Quote it: codec: "1.5e+3"'),
    ("train", "output_dir: 2024-01-01", "setting output_dir = 2024-01-01 ", 'Quote it: output_dir: "2024-01-01"'),
    ("train", "cache: [c1, 0755]", "setting cache = 493 (item 2 of its list)", 'Quote it: "0755"'),
    ("eval", "attn_implementation: on", "setting attn_implementation = True ", 'Quote it: attn_implementation: "on"'),
]


@pytest.mark.parametrize("command,line,read_as,fix", TYPED_BY_YAML, ids=[f"{c}-{w}" for c, w, _, _ in TYPED_BY_YAML])
def test_a_yaml_number_or_boolean_for_a_text_setting_is_refused_showing_it_as_written_and_quoted(
        tmp_path, captured, command, line, read_as, fix):
    result = run_yaml(tmp_path, command, line)
    written = line.split(": ", 1)[1].strip("[]").split(", ")[-1]
    assert_refused(result, "settings.yaml, line ", read_as, f"YAML reads the unquoted {written} as ", fix)
    assert captured == []  # nothing ran: 0755 never became the path "493"


def test_a_json_number_for_a_text_setting_is_refused_with_the_key_quoted(tmp_path, captured):
    assert_refused(run(tmp_path, "extract", {"output": 493}), "settings.json: setting output = 493 ",
                   "the file gives the integer 493", 'Quote it: "output": "493"')
    assert_refused(run(tmp_path, "train", {"init_drafter": True}), "setting init_drafter = True ",
                   "the boolean true", "in quotes")
    assert captured == []


@pytest.mark.parametrize("command,line,name,expected", [
    ("extract", 'output: "0755"', "output", "0755"),  # quoted: the path as written
    ("extract", "token_budget: 4096", "token_budget", 4096),  # a number for a number
    ("extract", "force: yes", "force", True),  # a YAML boolean for a switch
    ("extract", "disk_budget: 500000000000", "disk_budget", "500000000000"),  # a size in bytes
    ("train", "lr: 3.0e-4", "lr", 3e-4),
])
def test_a_yaml_value_of_the_settings_own_type_is_still_taken(tmp_path, captured, command, line, name, expected):
    result = run_yaml(tmp_path, command, line)
    assert result.exit_code == 0, result.output
    assert _value(captured[0], name) == expected


def test_every_text_setting_of_every_command_refuses_a_yaml_number(tmp_path):
    """The rule lives in the settings layer: every command's --config reads through it."""
    pytest.importorskip("yaml")
    from dflash.cache_tools import cli as cache_cli
    from dflash.demo.cli import DemoCommandConfig
    from dflash.eval.cli import EvalCommandConfig
    from dflash.extract.config import ExtractConfig
    from dflash.prepare.cli import PrepareConfig
    from dflash.prepare.generate_cli import GenerateConfig
    from dflash.runtime.errors import SettingError
    from dflash.runtime.settings import read_settings_file
    from dflash.train.cli import ExportConfig
    from dflash.train.config import TrainConfig

    classes = [ExtractConfig, TrainConfig, ExportConfig, EvalCommandConfig, PrepareConfig, GenerateConfig,
               DemoCommandConfig, *(getattr(cache_cli, n) for n in dir(cache_cli) if n.endswith("Settings"))]
    path = tmp_path / "settings.yaml"
    checked = set()
    for cls in classes:
        for name, s in settings_of(cls).items():
            if not s.text:
                continue
            path.write_text(f"{name}: 0755\n")
            with pytest.raises(SettingError) as refused:
                read_settings_file(settings_of(cls), path)
            assert refused.value.code == "runtime.setting-not-text"
            assert {k: refused.value.fields[k] for k in ("file", "line", "key", "value", "written")} == dict(
                file=str(path), line=1, key=name, value=493, written="0755")
            checked.add(name)
    assert {"output", "output_dir", "cache", "target_model", "init_drafter", "workdir", "data"} <= checked
    assert "disk_budget" not in checked  # a size: a number of bytes means what it says

# -- the mechanism on its own -----------------------------------------------------------------


@section
@dataclass(kw_only=True)
class _Inner:
    depth: int = 2
    """How deep."""


@dataclass(kw_only=True)
class _Settings:
    name: str
    """A name."""
    mode: str = setting("a", choices=("a", "b"))
    """One of two."""
    inner: _Inner = setting(default_factory=_Inner)


def test_sections_are_flat_flags_and_keys_and_come_back_nested(tmp_path):
    got = []

    @click.command(cls=Command)
    @settings_options(_Settings)
    def main(settings: _Settings) -> None:
        got.append(settings)

    path = tmp_path / "s.json"
    path.write_text(json.dumps({"name": "x", "depth": "5"}))
    result = CliRunner().invoke(main, ["--config", str(path), "--mode", "b"])
    assert result.exit_code == 0, result.output
    assert got == [_Settings(name="x", mode="b", inner=_Inner(depth=5))]
    help_text = CliRunner().invoke(main, ["--help"]).output
    assert "--depth INTEGER" in help_text and "How deep.  [default: 2]" in help_text and "[a|b]" in help_text
    missing = CliRunner().invoke(main, [])
    assert missing.exit_code == 2 and "Missing --name" in missing.stderr


@dataclass(kw_only=True)
class _Spelled:
    name: str
    """A name."""
    prompt_files: list[str] = setting(default_factory=list, flag="--prompts")
    """Files."""


def test_the_settings_layers_refusals_and_notice_are_findings_naming_file_key_and_flag(tmp_path):
    from dflash.runtime.errors import SettingError
    from dflash.runtime.findings import collected
    from dflash.runtime.settings import build_settings, read_settings_file

    with pytest.raises(SettingError) as missing:
        build_settings(_Settings, {})
    assert (missing.value.code, missing.value.fields) == ("runtime.setting-missing", {"flags": ["--name"]})
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"prompts": ["a"], "prompt_files": ["b"]}))
    with pytest.raises(SettingError) as twice:
        read_settings_file(settings_of(_Spelled), path)
    assert twice.value.code == "runtime.config-key-twice"
    assert twice.value.fields == {"file": str(path), "key": "prompt_files", "spelling": "prompts"}

    @click.command()
    @settings_options(_Settings, deprecated={"title": "name"})
    def main(settings: _Settings) -> None:
        pass

    both = CliRunner().invoke(main, ["--title", "x", "--name", "y"])
    assert isinstance(both.exception, SettingError) and both.exception.code == "runtime.flag-deprecated-and-new"
    assert both.exception.fields == {"flag": "--title", "now": "--name"}
    with collected(echo=False) as found:
        assert CliRunner().invoke(main, ["--title", "x"]).exit_code == 0
    assert [(f.code, f.fields) for f in found] == [("runtime.flag-deprecated", {"flag": "--title", "now": "--name"})]
