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


# -- run.py: the settings the peers are given --------------------------------------------------

def _peers_run():
    """bench/peers/run.py under its own name (bench/quality has a run.py too)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "peers" / "run.py"
    spec = importlib.util.spec_from_file_location("peers_run", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_run"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _work_dir(root, *, stage_mask=None, settings=None):
    """A prepared quality-benchmark work directory in miniature: settings, a cache, a target config."""
    from transformers import Qwen3Config

    make_cache(root / "cache", parts=1, length=40)
    Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, pad_token_id=0).save_pretrained(root / "target")
    (root / "settings.json").write_text(json.dumps({"train_args": ["--block-size", "8"], "seed": 0, **(settings or {})}))
    if stage_mask is not None:
        (root / "stages").mkdir()
        (root / "stages" / "target.json").write_text(json.dumps({"vocab": "bpe", "mask_token_id": stage_mask}))
    return root


def test_the_peers_mask_token_is_the_benchmarks_recorded_one_not_the_byte_vocabularys(tmp_path, monkeypatch):
    monkeypatch.delenv("MASK_TOKEN_ID", raising=False)
    peers = _peers_run()
    work = peers.Work(_work_dir(tmp_path, stage_mask=3), device="cpu")
    ours = peers.our_settings(work, None)
    assert ours.mask_token_id == 3 and ours.block_size == 8  # the byte vocabulary's is 259
    config, draft, _ = peers.specforge_config(work, ours, own=False)
    assert config["model"]["mask_token_id"] == draft["dflash_config"]["mask_token_id"] == 3
    recipe, _ = peers.modelopt_config(work, ours, own=True)
    assert recipe["dflash"]["dflash_mask_token_id"] == 3
    arch = recipe["dflash"]["dflash_architecture_config"]  # the target's sizes, not Qwen3Config's defaults
    assert (arch["intermediate_size"], arch["num_attention_heads"], arch["num_key_value_heads"], arch["head_dim"]) \
        == (64, 2, 1, 16)


def test_without_a_stage_record_the_mask_token_comes_from_the_targets_tokenizer_then_the_byte_vocabulary(
        tmp_path, monkeypatch):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    monkeypatch.delenv("MASK_TOKEN_ID", raising=False)
    peers = _peers_run()
    root = _work_dir(tmp_path)
    assert peers.benchmark_mask_token_id(root) == 259  # a byte-level work directory: corpus.MASK_ID
    tok = Tokenizer(WordLevel({"<pad>": 0, "a": 1, "b": 2}, unk_token="a"))
    tok.add_special_tokens(["<bos>", "<mask>"])
    tok.save(str(root / "target" / "tokenizer.json"))
    (root / "target" / "tokenizer_config.json").write_text(json.dumps({"mask_token": "<mask>", "pad_token": "<pad>"}))
    assert peers.benchmark_mask_token_id(root) == 4
    monkeypatch.setenv("MASK_TOKEN_ID", "7")
    assert peers.benchmark_mask_token_id(root) == 7


def test_specforge_trains_bf16_weights_under_ddp_and_dflash_eval_takes_the_benchmarks_eval_batch(tmp_path):
    peers = _peers_run()
    root = _work_dir(tmp_path, stage_mask=3, settings={"eval_batch": 4})
    for device, attention in (("cpu", "sdpa"), ("cuda", "flex_attention")):
        work = peers.Work(root, device=device)
        config, _, differs = peers.specforge_config(work, peers.our_settings(work, 2), own=False)
        # the .ckpt hidden states are bf16: fp32 weights without FSDP's casts fail in the first matmul
        assert config["model"]["torch_dtype"] == "bfloat16"
        assert config["training"]["fsdp_sharding"] == "NO_SHARD" and config["training"]["num_epochs"] == 2
        assert config["training"]["attention_backend"] == attention
        assert any("NO_SHARD" in d for d in differs)
    ours = peers.our_settings(work, None)
    own, _, _ = peers.specforge_config(work, ours, own=True)  # its 4 sequences of 3072 tokens a step
    assert own["training"]["batch_size"] == 4 * 3072 // ours.max_seq_len and own["training"]["num_epochs"] == 6
    assert peers.eval_batch_size(peers.Work(root)) == 4
    assert peers.eval_batch_size(peers.Work(root, eval_batch=2)) == 2
    (root / "settings.json").write_text(json.dumps({"train_args": []}))
    assert peers.eval_batch_size(peers.Work(root)) == 1


def test_specforge_log_lines_give_the_steps_and_losses():
    peers = _peers_run()
    log = ("Loading ['model.embed_tokens.weight'] ...\n"
           "step 20: {'acc': 0.45, 'loss': 4.297890663146973, 'grad_norm': 5.65, 'lr': 0.0024}\n"
           "step 40: {'acc': 0.71, 'loss': 4.057, 'grad_norm': 0.6, 'lr': 0.0}\n")
    assert peers.specforge_steps(log) == {"logged_steps": 2, "last_step": 40, "first_loss": 4.297890663146973,
                                          "last_loss": 4.057}
    assert peers.specforge_steps("Traceback ...")["logged_steps"] == 0


def test_the_same_recipe_follows_our_defaults_epochs_and_soft_labels(tmp_path, monkeypatch):
    import dataclasses

    from dflash.train.config import OptimizationConfig

    monkeypatch.delenv("MASK_TOKEN_ID", raising=False)
    peers = _peers_run()
    work = peers.Work(_work_dir(tmp_path, stage_mask=3), device="cpu")
    ours = peers.our_settings(work, None)
    assert ours.epochs == OptimizationConfig.epochs and not ours.soft_labels  # this cache has no top-k
    recipe, _ = peers.modelopt_config(work, ours, own=False)
    assert recipe["dflash"]["dflash_self_logit_distillation"] is False
    soft = dataclasses.replace(ours, soft_labels=True)  # ours on a cache of top-k log-probs
    recipe, _ = peers.modelopt_config(work, soft, own=False)
    assert recipe["dflash"]["dflash_self_logit_distillation"] is True
    _, _, differs = peers.specforge_config(work, soft, own=False)
    assert any(d.startswith("no soft labels") for d in differs)
