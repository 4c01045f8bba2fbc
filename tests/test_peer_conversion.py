"""bench/peers' own conversions (no peer package): our cache as SpecForge's .ckpt files, and a peer
export held to our loader's DFlash export contract."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from cache_utils import make_cache
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "peers"))

from convert import PeerBenchError, cache_to_ckpt_dir, export_changes, normalize_export  # noqa: E402


def test_every_cache_sample_becomes_one_ckpt_file_in_order_with_identical_tensors(tmp_path):
    samples = make_cache(tmp_path / "cache", parts=2, length=40)
    info = cache_to_ckpt_dir(tmp_path / "cache", tmp_path / "ckpt")
    files = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    kept = [s for s in samples if int((s[1][1:] * s[1][:-1]).sum()) > 0]  # two supervised tokens in a row
    assert info["samples"] == len(files) == len(kept) and info["skipped"] == len(samples) - len(kept)
    assert info["target_layer_ids"] == [1, 3] and not (tmp_path / "ckpt.partial").exists()
    for path, (ids, mask, hidden) in zip(files, kept):
        record = torch.load(path)
        assert set(record) == {"input_ids", "loss_mask", "hidden_states"}
        assert record["input_ids"].dtype == record["loss_mask"].dtype == torch.int64
        assert torch.equal(record["input_ids"], ids.long()) and torch.equal(record["loss_mask"], mask.long())
        assert record["hidden_states"].dtype == torch.bfloat16 and record["hidden_states"].shape == (40, 64)
        assert torch.equal(record["hidden_states"].view(torch.int16), hidden.view(torch.int16))  # bit for bit


SETTINGS = {"block_size": 16, "mask_token_id": 7, "target_layer_ids": [1, 3], "num_target_layers": 6}


def test_a_contract_export_needs_no_change():
    config = {"architectures": ["DFlashDraftModel"], "block_size": 16, "num_target_layers": 6, "num_hidden_layers": 2,
              "layer_types": ["full_attention"] * 2, "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 3]}}
    new, renames, notes = export_changes(config, ["fc.weight", "layers.0.mlp.up_proj.weight"], **SETTINGS)
    assert new == config and renames == {} and notes == []


def test_missing_keys_come_from_the_trained_settings_and_wrapper_prefixes_and_target_tensors_go():
    config = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 1, "dflash_config": {"mask_token_id": 7}}
    names = ["dflash_module.fc.weight", "dflash_module.layers.0.self_attn.q_proj.weight", "embed_tokens.weight",
             "dflash_module.rotary_emb.inv_freq", "norm.weight"]
    new, renames, notes = export_changes(config, names, **SETTINGS)
    assert new["dflash_config"]["target_layer_ids"] == [1, 3] and new["block_size"] == 16
    assert new["num_target_layers"] == 6 and new["architectures"] == ["DFlashDraftModel"]
    assert new["layer_types"] == ["full_attention"]
    assert renames == {"dflash_module.fc.weight": "fc.weight",
                       "dflash_module.layers.0.self_attn.q_proj.weight": "layers.0.self_attn.q_proj.weight",
                       "embed_tokens.weight": "", "dflash_module.rotary_emb.inv_freq": ""}
    assert len(notes) == 6  # four config keys, the dropped tensors, the stripped prefix


def test_an_export_that_says_other_settings_than_it_was_trained_with_is_refused():
    config = {"architectures": ["DFlashDraftModel"], "block_size": 8, "num_hidden_layers": 1, "dflash_config": {}}
    with pytest.raises(PeerBenchError, match="block_size = 8"):
        export_changes(config, ["fc.weight"], **SETTINGS)


def test_normalized_export_holds_the_renamed_tensors_and_the_new_config(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    fc = torch.randn(4, 8)
    save_file({"dflash_module.fc.weight": fc, "lm_head.weight": torch.zeros(3, 4)}, str(src / "model-00001.safetensors"))
    (src / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "num_hidden_layers": 1,
                                                 "dflash_config": {}}))
    notes = normalize_export(src, tmp_path / "dst", **SETTINGS)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "dst" / "model.safetensors"), framework="pt") as f:
        assert list(f.keys()) == ["fc.weight"] and torch.equal(f.get_tensor("fc.weight"), fc)
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 7
    assert any("model-00001.safetensors -> one model.safetensors" in n for n in notes)
