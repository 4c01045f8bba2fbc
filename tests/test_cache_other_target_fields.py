"""A cache of another target: the refusal's differences are data ([key, the cache's, the
target's]) and layer ids the target lacks a field of their own; the renderer words both."""

from __future__ import annotations

import pytest
from conftest import write_tiny_cache
from dflash.cache_tools.errors import ConfigMismatchError
from dflash.cache_tools.manifest import read_manifest
from dflash.train.data.caches import check_cache_target
from transformers import AutoConfig


def test_a_cache_of_an_eight_layer_target_names_the_key_its_values_and_the_missing_layer(tiny_world, tmp_path):
    cache = write_tiny_cache(tmp_path / "other", samples=4, parts=1, target_layers=8, layers=(1, 6))
    target = tiny_world["target"]
    with pytest.raises(ConfigMismatchError) as e:
        check_cache_target(read_manifest(cache), AutoConfig.from_pretrained(target), str(target))
    assert e.value.code == "train.cache-other-target"
    assert ["num_hidden_layers", "8", "4"] in e.value.fields["differences"]
    assert (e.value.fields["missing_layers"], e.value.fields["num_layers"]) == ([6], 4)
    text = " ".join(str(e.value).split())
    assert "num_hidden_layers: cache has 8, target has 4" in text and "[6] do not exist in a 4-layer" in text
