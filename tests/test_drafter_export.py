"""HF export: exact config keys and weight names, reload with identical logits, atomic writes."""

from __future__ import annotations

import json

import dflash.train.export as export_module
import pytest
import torch
from dflash.train.export import export_drafter, load_drafter
from dflash.train.model import DFlashDrafter
from dflash.train.objective import ObjectiveConfig, compute_loss
from safetensors import safe_open
from test_drafter_support import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    TARGET_LAYERS,
    VOCAB,
    save_tiny_target,
)
from transformers import Qwen3Config

DRAFT_LAYERS = 3

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def expected_weight_names(num_layers: int) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{n}_norm.weight" for n in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        names |= {f"layers.{i}.{n}_layernorm.weight" for n in ("input", "post_attention")}
    return names


def sample_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(2, 16, 3 * HIDDEN, generator=g),
        "input_ids": torch.randint(0, VOCAB, (2, 16), generator=g),
        "loss_mask": torch.ones(2, 16, dtype=torch.long),
        "lengths": torch.tensor([16, 11]),
    }


def block_logits(drafter: DFlashDrafter, batch: dict) -> torch.Tensor:
    """Logits of every block slot (all anchors of `batch`, drawn with a fixed seed)."""
    out = {}

    def grab(module, args, output):
        out["states"] = output

    handle = drafter.norm.register_forward_hook(grab)
    with torch.no_grad():
        compute_loss(drafter, batch, ObjectiveConfig(max_anchors=64), generator=torch.Generator().manual_seed(0))
    handle.remove()
    return drafter.logits(out["states"])


def perturb(drafter: DFlashDrafter) -> DFlashDrafter:
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return drafter


@pytest.mark.parametrize("family,rope", [("qwen3", None), ("llama", LLAMA3_ROPE)])
def test_export_writes_every_key_and_reloads_with_identical_logits(tmp_path, family, rope):
    extra = {"rope_theta": 500000.0, "rope_scaling": dict(rope)} if rope else {"rope_theta": 1e6}
    target = save_tiny_target(tmp_path / "target", family, **extra)
    torch.manual_seed(0)
    drafter = perturb(DFlashDrafter.from_target(
        target, num_hidden_layers=DRAFT_LAYERS, target_layer_ids=[1, 3, 5], block_size=4, mask_token_id=7,
        attention_backend="sdpa",
    ))
    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)

    config = json.loads((out / "config.json").read_text())
    expected = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 4,
        "num_target_layers": TARGET_LAYERS, "num_hidden_layers": DRAFT_LAYERS,
        "hidden_size": HIDDEN, "intermediate_size": 96, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256, "vocab_size": VOCAB, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32", "dtype": "float32",
        "layer_types": ["full_attention"] * DRAFT_LAYERS,
        "rope_theta": extra["rope_theta"],
    }
    for key, value in expected.items():
        assert config[key] == value, key
    assert config["dflash_config"]["mask_token_id"] == 7
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert config["rope_parameters"]["rope_theta"] == extra["rope_theta"]
    if rope:
        assert config["rope_scaling"] == rope
        assert {k: config["rope_parameters"][k] for k in rope} == rope
    else:
        assert config["rope_scaling"] is None and config["rope_parameters"]["rope_type"] == "default"
    hf = Qwen3Config(**config)  # transformers accepts the file as a Qwen3 config
    assert hf.num_hidden_layers == DRAFT_LAYERS and len(hf.layer_types) == DRAFT_LAYERS

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == expected_weight_names(DRAFT_LAYERS)

    reloaded = load_drafter(out, target, attention_backend="sdpa")
    assert reloaded.config == drafter.config
    batch = sample_batch()
    torch.testing.assert_close(block_logits(reloaded, batch), block_logits(drafter, batch), rtol=0, atol=0)


def test_reload_accepts_457_and_5x_style_rope_keys(tmp_path):
    target = save_tiny_target(tmp_path / "target", "llama", rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))
    torch.manual_seed(0)
    drafter = perturb(DFlashDrafter.from_target(target, num_hidden_layers=DRAFT_LAYERS, block_size=4,
                                                attention_backend="sdpa"))
    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    reference = block_logits(drafter, sample_batch(1))
    config = json.loads((out / "config.json").read_text())
    styles = {
        "4.57": {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype")},
        "5.x": {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")},
    }
    for name, style in styles.items():
        (out / "config.json").write_text(json.dumps(style))
        reloaded = load_drafter(out, target, attention_backend="sdpa")
        assert reloaded.config.rope_parameters == drafter.config.rope_parameters, name
        torch.testing.assert_close(block_logits(reloaded, sample_batch(1)), reference, rtol=0, atol=0)


def test_bf16_export_holds_the_rounded_weights(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    drafter = DFlashDrafter.from_target(target, num_hidden_layers=2, block_size=4)
    out = export_drafter(drafter, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reloaded = load_drafter(out, target, dtype=None)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), reloaded.state_dict().items()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name


def test_tied_and_sharded_targets_export_and_reload(tmp_path):
    target = save_tiny_target(tmp_path / "target", "llama", tie=True, max_shard_size="40KB")
    drafter = perturb(DFlashDrafter.from_target(target, num_hidden_layers=2, block_size=4,
                                                target_layer_ids=[2, 4, 6], attention_backend="sdpa"))
    assert torch.equal(drafter.lm_head_weight, drafter.embed_weight)
    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == expected_weight_names(2)  # the tied head is not written either
    reloaded = load_drafter(out, target, attention_backend="sdpa")
    torch.testing.assert_close(block_logits(reloaded, sample_batch()), block_logits(drafter, sample_batch()),
                               rtol=0, atol=0)


def test_export_replaces_atomically_and_cleans_up_on_failure(tmp_path, monkeypatch):
    target = save_tiny_target(tmp_path / "target")
    drafter = DFlashDrafter.from_target(target, num_hidden_layers=2, block_size=4)
    out = export_drafter(drafter, tmp_path / "export")
    first = (out / "model.safetensors").read_bytes()

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "save_file", broken_save)
    with torch.no_grad():
        drafter.fc.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        export_drafter(drafter, out)
    assert (out / "model.safetensors").read_bytes() == first  # the old export is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "target"]  # no staging left

    monkeypatch.undo()
    export_drafter(drafter, out)
    assert (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "target"]


def test_load_refuses_a_target_of_another_size(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    other = save_tiny_target(tmp_path / "other", vocab_size=VOCAB * 2)
    out = export_drafter(DFlashDrafter.from_target(target, num_hidden_layers=2, block_size=4), tmp_path / "export")
    with pytest.raises(ValueError, match="load it with the target it was trained for"):
        load_drafter(out, other)
    with pytest.raises(ValueError, match="not a DFlash drafter config"):
        load_drafter(tmp_path / "target", target)
    with pytest.raises(FileNotFoundError, match="not a drafter export"):
        load_drafter(tmp_path / "nowhere", target)
