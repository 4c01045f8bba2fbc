"""Each head declares its settings beside its code (train/heads/*), and the run's settings classes
are composed from them: the flags and config keys of `dflash-train run`, their defaults, types,
help texts and identity marks, DrafterConfig's fields and every built-in head's export keys stay as
recorded in tests/fixtures/head_settings.json (written from the code before the heads declared
their settings: `python3 tests/test_head_settings.py` writes it again, for a deliberate change)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click
import pytest
from dflash.runtime.settings import config_keys, settings_of

RECORD = Path(__file__).with_name("fixtures") / "head_settings.json"
# a drafter of tiny dimensions every built-in head builds with its defaults (but the vocabulary)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            vocab_size=128, num_target_layers=8, num_hidden_layers=2, target_layer_ids=[1, 5], block_size=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=256,
            attention_backend="sdpa", mask_token_id=3)


def _rows(cls: type) -> list[list]:
    """(flag, key(s), section, default, kind, annotation, click type, identity mark, help) per setting, in order."""
    keys: dict[str, list[str]] = {}
    for key, name in config_keys(settings_of(cls)).items():
        keys.setdefault(name, []).append(key)
    out = []
    for name, s in settings_of(cls).items():
        default = s.default()
        t = s.option.type
        mark = s.spec.identity
        out.append([s.flag, keys[name], s.section, "<required>" if default is dataclasses.MISSING else repr(default),
                    s.kind, str(s.field.type), list(t.choices) if isinstance(t, click.Choice) else t.name,
                    None if mark is None else [mark.group, mark.key, mark.source, mark.omit_default], s.option.help])
    return out


def _exports() -> dict[str, dict]:
    """{head: (its export's config.json of a tiny drafter, its run identity)} of every built-in head."""
    from dflash.train.exports.export import drafter_hf_config
    from dflash.train.heads import _BUILTIN, get_head
    from dflash.train.model.drafter_config import DrafterConfig

    out = {}
    for name in _BUILTIN:
        config = DrafterConfig(**TINY, drafter_type=name, selector_top_k=8)
        out[name] = {"config": json.loads(json.dumps(drafter_hf_config(config), default=str)),
                     "identity": get_head(name).identity(config)}
    return out


def current() -> dict:
    from dflash.train.config import TrainConfig
    from dflash.train.model.drafter_config import DrafterConfig

    return {"run": _rows(TrainConfig), "drafter_config": _rows(DrafterConfig), "exports": _exports()}


def test_the_run_flags_keys_defaults_help_and_identity_marks_are_as_recorded():
    want, got = json.loads(RECORD.read_text()), json.loads(json.dumps(current()))
    assert [r[0] for r in got["run"]] == [r[0] for r in want["run"]]  # the flags, in --help's order
    for mine, theirs in zip(got["run"], want["run"], strict=True):
        assert mine == theirs, mine[0]


def test_drafter_config_fields_are_as_recorded():
    want, got = json.loads(RECORD.read_text()), json.loads(json.dumps(current()))
    assert [r[1] for r in got["drafter_config"]] == [r[1] for r in want["drafter_config"]]
    for mine, theirs in zip(got["drafter_config"], want["drafter_config"], strict=True):
        assert mine == theirs, mine[0]


@pytest.mark.parametrize("head", ["dflash", "dflash2", "dspark", "xpress", "lilicorr"])
def test_each_built_in_heads_export_keys_and_identity_are_as_recorded(head):
    want, got = json.loads(RECORD.read_text())["exports"][head], json.loads(json.dumps(_exports()[head]))
    assert got["config"] == want["config"]
    assert got["identity"] == want["identity"]  # (checkpoints compare identities key by key)


# -- the heads declare, the run composes ----------------------------------------------------------


def test_the_run_settings_are_composed_from_each_heads_declarations():
    from dflash.train.config import DrafterSettings, ObjectiveConfig
    from dflash.train.heads import get_head, head_names
    from dflash.train.model.drafter_config import DrafterConfig

    drafter, objective = settings_of(DrafterSettings), settings_of(ObjectiveConfig)
    for name in head_names():
        head = get_head(name)
        for part, composed in ((head.settings, DrafterSettings), (head.objective_settings, ObjectiveConfig)):
            if part is None:
                continue
            assert issubclass(composed, part) and issubclass(DrafterConfig, DrafterSettings)
            declared = [f.name for f in dataclasses.fields(part)]
            assert declared and set(declared) <= set(drafter if composed is DrafterSettings else objective)
            assert declared == [n for n in part.__dataclass_fields__]  # (in the head's order)
        assert head.setting_names == tuple(f.name for f in dataclasses.fields(head.settings or object)) \
            if head.settings else head.setting_names == ()
    # the help text is the docstring beside the head's field
    assert drafter["markov_rank"].option.help.startswith("dspark: rank r of the Markov head")


def test_a_heads_setting_out_of_range_is_refused_by_the_head_wherever_the_settings_are_built():
    from dflash.train.config import ModelConfig, ObjectiveConfig, TrainConfigError
    from dflash.train.heads.base import HeadSettingError
    from dflash.train.model.drafter_config import DrafterConfig

    with pytest.raises(TrainConfigError) as refused:  # the run's settings: a usage error of the run
        ModelConfig(target_model="t", drafter_type="dspark", markov_rank=0)
    assert refused.value.code == "train.markov-rank" and refused.value.fields == {"value": 0}
    with pytest.raises(HeadSettingError) as refused:  # a drafter's config (an export's): a ValueError too
        DrafterConfig(**TINY, drafter_type="dflash2", selector_top_k=8, conv_kernel_size=0)
    assert isinstance(refused.value, ValueError) and refused.value.fields["flag"] == "--conv-kernel-size"
    with pytest.raises(TrainConfigError) as refused:
        ObjectiveConfig(lilicorr_loss_weight=float("nan"))
    assert refused.value.code == "train.setting-not-finite" and refused.value.fields["flag"] == "--lilicorr-loss-weight"
    ObjectiveConfig(lilicorr_loss_weight=0.0)  # (in range)


def test_a_head_registered_later_is_a_choice_of_the_cli_flag_and_the_config_key():
    from dflash.runtime.settings import convert_file_value
    from dflash.train import heads
    from dflash.train.cli import run
    from dflash.train.config import TrainConfig, TrainConfigError
    from toy_head import HEAD

    drafter_type = settings_of(TrainConfig)["drafter_type"]
    args = ["--cache", "c", "--target-model", "t", "--output-dir", "o", "--drafter-type", "toy"]
    with pytest.raises(click.BadParameter):
        run.make_context("run", list(args))
    heads.register_head(HEAD)
    try:
        assert run.make_context("run", list(args)).params["drafter_type"] == "toy"
        assert convert_file_value(drafter_type, "toy", "run.yaml", TrainConfigError) == "toy"
        assert "toy" in drafter_type.option.type.choices
    finally:
        heads.unregister_head(HEAD.name)
    with pytest.raises(TrainConfigError):
        convert_file_value(drafter_type, "toy", "run.yaml", TrainConfigError)


def test_a_heads_setting_is_a_flag_from_its_declaration_alone(tmp_path):
    """A head registered before the run's settings are composed adds its settings (flag, key, help,
    default, limits) by declaring them; one registered after that may declare none."""
    import subprocess
    import textwrap

    program = textwrap.dedent('''
        from dataclasses import dataclass
        from dflash.runtime.findings import Finding
        from dflash.train import heads
        from dflash.train.heads.base import DraftHead

        @dataclass(kw_only=True)
        class WideSettings:
            wide_width: int = 3
            """wide: the width of the wide head."""

            def refusal(self):
                return Finding("train.setting-range", flag="--wide-width", value=self.wide_width,
                               allowed="at least 1") if self.wide_width < 1 else None

        class WideHead(DraftHead):
            name, title, architecture, settings = "wide", "Wide", "WideDraftModel", WideSettings

        heads.register_head(WideHead())
        from dflash.runtime.settings import settings_of
        from dflash.train.config import ModelConfig, TrainConfig, TrainConfigError
        s = settings_of(TrainConfig)["wide_width"]
        assert (s.flag, s.default(), s.section) == ("--wide-width", 3, "model"), s
        assert s.option.help.startswith("wide: the width"), s.option.help
        try:
            ModelConfig(target_model="t", wide_width=0)
        except TrainConfigError as e:
            assert e.fields["flag"] == "--wide-width"
        else:
            raise SystemExit("not refused")

        class LateHead(DraftHead):
            name, title, architecture, settings = "late", "Late", "LateDraftModel", WideSettings
        try:
            heads.register_head(LateHead())
        except ValueError:
            print("composed")
    ''')
    (tmp_path / "wide.py").write_text(program)  # (a file: the help texts are read from the source)
    done = subprocess.run([sys.executable, str(tmp_path / "wide.py")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "composed", done.stderr


if __name__ == "__main__":
    RECORD.write_text(json.dumps(current(), indent=1) + "\n")
    sys.exit(0)
