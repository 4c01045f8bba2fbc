"""The positions a target takes, read from its config (runtime/positions.py)."""

from __future__ import annotations

import pytest
import transformers
from dflash.runtime.positions import target_positions


def limit(config):
    found = target_positions(config)
    return None if found is None else found.limit


def test_the_count_is_max_position_embeddings_of_the_config_or_its_text_config():
    assert limit(transformers.Qwen3Config(max_position_embeddings=2048)) == 2048
    assert limit({"max_position_embeddings": 4096, "rope_theta": 1e6}) == 4096
    gemma = transformers.Gemma3Config(text_config={"max_position_embeddings": 8192})
    assert limit(gemma) == 8192
    assert limit({"text_config": {"max_position_embeddings": 1024}}) == 1024


def test_families_that_name_it_otherwise_are_read_and_a_config_without_one_gives_none():
    assert limit(transformers.GPT2Config(n_positions=1024)) == 1024
    assert limit({"seq_length": 32768, "max_position_embeddings": 8192}) == 8192  # the fewest given
    assert target_positions({"hidden_size": 64}) is None
    assert target_positions({"max_position_embeddings": None}) is None


@pytest.mark.parametrize("scaling, expected", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),  # the 4.x key
    ({"rope_type": "linear", "factor": 2.0}, 65536),
    ({"rope_type": "dynamic", "factor": 2.0}, 65536),
    ({"rope_type": "default"}, 32768),
    ({"rope_type": "yarn", "factor": 1.0}, 32768),
    ({"full_attention": {"rope_type": "linear", "factor": 2.0}, "sliding_attention": {"rope_type": "default"}},
     65536),  # per layer type: the global layers'
])
def test_a_rope_scaling_factor_extends_the_count(scaling, expected):
    for key in ("rope_scaling", "rope_parameters"):
        assert limit({"max_position_embeddings": 32768, key: scaling}) == expected


def test_a_config_that_gives_the_extended_count_already_keeps_it():
    llama31 = {"max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
    assert limit(llama31) == 131072
    phi3 = {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}
    assert limit(phi3) == 131072


def test_the_description_names_the_count_and_its_source():
    yarn = transformers.LlamaConfig(max_position_embeddings=16, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4})
    assert target_positions(yarn).describe() == (
        "the target's 64 positions (max_position_embeddings 16, rope_scaling yarn x4 of 16 of its config)")
    assert target_positions({"max_position_embeddings": 2048}).describe() == (
        "the target's 2,048 positions (max_position_embeddings 2048 of its config)")
