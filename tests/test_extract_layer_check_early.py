"""dflash-extract checks the layer rule against the target's config.json before any weight
loads: ids the rule refuses are refused in a second, not after a large target has loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import random_records, write_jsonl
from dflash.cache_tools.layers import LayerIdsError
from dflash.demo.pipeline import SHIPPED_TARGET as DEMO_TARGET
from extract_utils import run_cli


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "completions.jsonl", random_records(2, seed=0, max_len=10))


@pytest.fixture
def no_loading(monkeypatch):
    """Any attempt to load the target's weights fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target's weights were loaded before the layer ids were checked")

    monkeypatch.setattr("dflash.extract.pipeline.load_target", refuse)


def _target_without_usable_weights(tmp_path: Path, weights: bytes | None) -> Path:
    """The demo's 4-layer target's config.json, beside a damaged weight file (or none)."""
    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(DEMO_TARGET / "config.json", target / "config.json")
    if weights is not None:
        (target / "model.safetensors").write_bytes(weights)
    return target


def test_the_readme_command_on_the_demo_target_is_refused_before_its_weights_load(tmp_path, data, no_loading):
    assert json.loads((DEMO_TARGET / "config.json").read_text())["num_hidden_layers"] == 4
    res = run_cli(["--target-model", DEMO_TARGET, "--data", data, "--output", tmp_path / "cache", "--codec", "bf16"])
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output
    assert "4-layer target" in res.output and "--target-layer-ids" in res.output
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("weights", [None, b"\x00 not a safetensors file"], ids=["absent", "corrupt"])
def test_ids_above_the_configs_layers_are_refused_before_the_weights_are_read(tmp_path, data, weights):
    """Before, an absent or corrupt weight file was named first (and a good one loaded in full)."""
    target = _target_without_usable_weights(tmp_path, weights)
    res = run_cli(["--target-model", target, "--data", data, "--output", tmp_path / "cache",
                   "--target-layer-ids", "1,3"])
    assert res.exit_code == 2, res.output
    assert "[1, 3]" in res.output and "[3]" in res.output and "4-layer target" in res.output
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("weights", [None, b"\x00 not a safetensors file"], ids=["absent", "corrupt"])
def test_the_default_rule_on_a_shallow_config_is_refused_before_the_weights_are_read(tmp_path, data, weights):
    target = _target_without_usable_weights(tmp_path, weights)
    res = run_cli(["--target-model", target, "--data", data, "--output", tmp_path / "cache"])
    assert res.exit_code == 2, res.output
    assert "cannot pick 5" in res.output and "4-layer target" in res.output


def test_ids_the_config_allows_go_on_to_load_the_target(tmp_path, data):
    """The early check refuses nothing the rule allows: with valid ids the weights are read next."""
    target = _target_without_usable_weights(tmp_path, b"\x00 not a safetensors file")
    res = run_cli(["--target-model", target, "--data", data, "--output", tmp_path / "cache",
                   "--target-layer-ids", "1,2"])
    assert res.exit_code == 2 and "model.safetensors" in res.output and "4-layer" not in res.output


def test_the_check_reads_the_text_config_of_a_multimodal_wrapper(tmp_path):
    from dflash.extract.config import ExtractConfig
    from dflash.extract.pipeline import check_layer_ids_before_loading

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "text_config": {"num_hidden_layers": 6}}))
    settings = dict(target_model=str(tmp_path), data="d.jsonl", output="out")
    check_layer_ids_before_loading(ExtractConfig(**settings, target_layer_ids=[1, 4]))
    with pytest.raises(LayerIdsError) as e:
        check_layer_ids_before_loading(ExtractConfig(**settings, target_layer_ids=[1, 5]))
    assert e.value.code == "cache.layer-ids-unusable" and (e.value.fields["layers"], e.value.fields["above"]) == (6, [5])
