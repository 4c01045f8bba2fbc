"""Tiny targets for the drafter tests, and tests of what the drafter reads from a target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target
from dflash.cache_tools.layers import LayerIdsError
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.model.drafter_config import DrafterConfig
from dflash.train.model.target_weights import (
    TargetWeights,
    default_target_layer_ids,
    load_target_weights,
)
from transformers import AutoModelForCausalLM

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, TARGET_LAYERS = 64, 4, 2, 16, 128, 8


def save_tiny_target(
    path: Path, family: str = "qwen3", *, tie: bool = False, max_shard_size: str | None = None, **extra
) -> Path:
    """The drafter tests' target (conftest's builder at these dimensions); `extra` sets config fields."""
    return make_tiny_target(path, family=family, hidden=HIDDEN, layers=TARGET_LAYERS, vocab=VOCAB, heads=HEADS,
                            kv_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate=96, max_positions=256, tie=tie,
                            max_shard_size=max_shard_size, rms_norm_eps=1e-5, **extra)


def random_target_weights(seed: int = 0, vocab: int = VOCAB, hidden: int = HIDDEN) -> TargetWeights:
    g = torch.Generator().manual_seed(seed)
    return TargetWeights(
        embed_tokens=torch.randn(vocab, hidden, generator=g),
        lm_head=torch.randn(vocab, hidden, generator=g) / hidden**0.5,
        final_norm=1 + 0.1 * torch.randn(hidden, generator=g),
    )


def tiny_config(**overrides) -> DrafterConfig:
    values = dict(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=128, vocab_size=VOCAB, num_target_layers=TARGET_LAYERS, num_hidden_layers=2,
        target_layer_ids=[1, 5], block_size=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=256, attention_backend="sdpa", drafter_type="dflash",
    )
    values.update(overrides)
    return DrafterConfig(**values)


def tiny_drafter(seed: int = 0, **overrides) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(tiny_config(**overrides), random_target_weights(seed), target_norm_eps=1e-5)
    # Non-trivial norm weights so that the tests also cover them.
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return drafter.eval()


# -- the default target-layer rule ------------------------------------------------------------


def test_default_target_layer_ids_follow_the_reference_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # Llama-3.1-8B
    assert default_target_layer_ids(28, 3) == [1, 13, 25]
    assert default_target_layer_ids(36, 1) == [18]
    # Half-way values round half to even, as Python's round in the reference code does.
    assert default_target_layer_ids(30, 5) == [round(1 + i * 26 / 4) for i in range(5)] == [1, 8, 14, 20, 27]


def test_default_target_layer_ids_refuse_too_small_targets():
    assert default_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    with pytest.raises(LayerIdsError) as refused:  # a SettingError, still a ValueError
        default_target_layer_ids(6, 5)
    assert refused.value.code == "cache.layer-rule-too-shallow" and refused.value.fields == {"count": 5, "layers": 6}
    with pytest.raises(LayerIdsError) as refused:
        default_target_layer_ids(36, 0)
    assert refused.value.code == "cache.layer-count-invalid" and refused.value.fields == {"count": 0, "layers": 36}


# -- reading the target -----------------------------------------------------------------------


def test_target_weights_are_read_without_loading_the_model(tmp_path):
    target = save_tiny_target(tmp_path / "t")
    weights = load_target_weights(target, with_final_norm=True)
    model = AutoModelForCausalLM.from_pretrained(str(target))
    assert torch.equal(weights.embed_tokens, model.model.embed_tokens.weight)
    assert torch.equal(weights.lm_head, model.lm_head.weight)
    assert torch.equal(weights.final_norm, model.model.norm.weight)
    assert not torch.equal(weights.embed_tokens, weights.lm_head)


def test_tied_embeddings_target_uses_the_embedding_as_lm_head(tmp_path):
    target = save_tiny_target(tmp_path / "t", "llama", tie=True)
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 - the case under test
    weights = load_target_weights(target)
    model = AutoModelForCausalLM.from_pretrained(str(target))
    assert torch.equal(weights.lm_head, model.get_output_embeddings().weight)
    assert torch.equal(weights.lm_head, weights.embed_tokens)


def test_sharded_checkpoint_is_read_through_its_index(tmp_path):
    target = save_tiny_target(tmp_path / "t", max_shard_size="40KB")
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    weights = load_target_weights(target, with_final_norm=True)
    model = AutoModelForCausalLM.from_pretrained(str(target))
    assert torch.equal(weights.embed_tokens, model.model.embed_tokens.weight)
    assert torch.equal(weights.lm_head, model.lm_head.weight)
    assert torch.equal(weights.final_norm, model.model.norm.weight)


def test_missing_weights_error_names_the_directory(tmp_path):
    target = save_tiny_target(tmp_path / "t", max_shard_size="40KB")
    index = json.loads((target / "model.safetensors.index.json").read_text())
    (target / index["weight_map"]["lm_head.weight"]).unlink()
    with pytest.raises(FileNotFoundError) as e:
        load_target_weights(target)
    assert e.value.code == "train.target-shard-missing" and e.value.fields["index"].startswith(str(target))
    assert e.value.fields["shard"] == index["weight_map"]["lm_head.weight"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as e:
        load_target_weights(empty, tie_word_embeddings=False)
    assert (e.value.code, e.value.fields) == ("train.target-no-safetensors", {"dir": str(empty), "pickled": True})
    # pickled: the renderer names the fix (save_pretrained(..., safe_serialization=True))


def test_drafter_config_rejects_a_mask_token_outside_the_embedding():
    with pytest.raises(ValueError) as e:
        tiny_config(mask_token_id=VOCAB)
    assert e.value.code == "train.drafter-mask-token" and e.value.fields["mask_token_id"] == VOCAB
    assert tiny_config().mask_token_id == VOCAB - 1  # documented default
    with pytest.raises(ValueError) as e:
        tiny_config(num_key_value_heads=3)
    assert e.value.code == "train.drafter-kv-heads" and e.value.fields["kv_heads"] == 3
    with pytest.raises(ValueError) as e:
        tiny_config(target_layer_ids=[1, 8])
    assert e.value.code == "train.drafter-target-layers" and e.value.fields["outside"] == [8]


def test_drafter_from_target_takes_its_dimensions_from_the_target(tmp_path):
    target = save_tiny_target(tmp_path / "t", "llama", rope_theta=5e5)
    drafter = DFlashDrafter.from_target(target, num_hidden_layers=3, block_size=8)
    c = drafter.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (HIDDEN, HEADS, KV_HEADS, HEAD_DIM)
    assert (c.intermediate_size, c.vocab_size, c.num_target_layers, c.rms_norm_eps) == (96, VOCAB, TARGET_LAYERS, 1e-5)
    assert c.rope_parameters["rope_theta"] == 5e5
    assert c.target_layer_ids == default_target_layer_ids(TARGET_LAYERS, 3)
    # Frozen target tensors are buffers outside the state dict.
    assert not any("embed" in n or "lm_head" in n for n in drafter.state_dict())
    assert all(p.requires_grad for p in drafter.parameters())
    assert not any(b.requires_grad for b in drafter.buffers())
