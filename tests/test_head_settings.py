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


if __name__ == "__main__":
    RECORD.write_text(json.dumps(current(), indent=1) + "\n")
    sys.exit(0)
