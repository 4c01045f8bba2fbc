"""HF export: exact config keys and weight names, reload with identical logits (default, llama3 and yarn
RoPE; sliding layers and causality), a partial-rotary target's full-rotary drafter, atomic writes."""

from __future__ import annotations

import json

import dflash.train.exports.export as export_module
import pytest
import torch
from anchor_utils import loss_of
from dflash.train.exports.export import export_drafter, load_drafter
from dflash.train.loss.objective import ObjectiveConfig
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.model.drafter_config import DrafterConfig
from reference_decoding import ContextCache
from safetensors import safe_open
from test_drafter_support import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    TARGET_LAYERS,
    VOCAB,
    random_target_weights,
    save_tiny_target,
)
from transformers import Qwen3Config

DRAFT_LAYERS = 3

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# Keys of a partial-rotary / M-RoPE target that must never reach an export.
PARTIAL_ROPE_KEYS = {"partial_rotary_factor", "mrope_section", "mrope_interleaved"}


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
        loss_of(drafter, batch, ObjectiveConfig(max_anchors=64), generator=torch.Generator().manual_seed(0))
    handle.remove()
    return drafter.logits(out["states"])


def perturb(drafter: DFlashDrafter) -> DFlashDrafter:
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return drafter


@pytest.mark.parametrize("family,rope", [("qwen3", None), ("llama", LLAMA3_ROPE), ("qwen3", YARN_ROPE)])
def test_export_writes_every_key_and_reloads_with_identical_logits(tmp_path, family, rope):
    extra = {"rope_theta": 500000.0, "rope_scaling": dict(rope)} if rope else {"rope_theta": 1e6}
    target = save_tiny_target(tmp_path / "target", family, **extra)
    torch.manual_seed(0)
    drafter = perturb(DFlashDrafter.from_target(
        target, drafter_type="dflash", num_hidden_layers=DRAFT_LAYERS, target_layer_ids=[1, 3, 5], block_size=4, mask_token_id=7,
        attention_backend="sdpa",
    ))
    # with the record of the target it trained against, a key of its own that loaders carry unread
    trained = {"target": {"architecture": "Qwen3ForCausalLM", "weights_hash": "ab" * 32}, "target_path": "/t"}
    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32, training_target=trained)

    config = json.loads((out / "config.json").read_text())
    assert config["dflash_training"] == trained
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
    # Stated for every engine: block size both ways, causality, all layers full attention.
    assert config["dflash_config"]["block_size"] == 4 and config["sliding_window"] is None
    assert config["is_causal"] is False and config["dflash_config"]["causal"] is False
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
    drafter = perturb(DFlashDrafter.from_target(target, drafter_type="dflash", num_hidden_layers=DRAFT_LAYERS, block_size=4,
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
    drafter = DFlashDrafter.from_target(target, drafter_type="dflash", num_hidden_layers=2, block_size=4)
    out = export_drafter(drafter, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reloaded = load_drafter(out, target, dtype=None)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), reloaded.state_dict().items()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name


def test_tied_and_sharded_targets_export_and_reload(tmp_path):
    target = save_tiny_target(tmp_path / "target", "llama", tie=True, max_shard_size="40KB")
    drafter = perturb(DFlashDrafter.from_target(target, drafter_type="dflash", num_hidden_layers=2, block_size=4,
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
    drafter = DFlashDrafter.from_target(target, drafter_type="dflash", num_hidden_layers=2, block_size=4)
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
    out = export_drafter(DFlashDrafter.from_target(target, drafter_type="dflash", num_hidden_layers=2, block_size=4), tmp_path / "export")
    with pytest.raises(ValueError) as e:  # (ValueError and FileNotFoundError: what the loaders' callers catch)
        load_drafter(out, other)
    assert e.value.code == "train.drafter-target-size" and e.value.fields["target"] == str(other)
    assert e.value.fields["drafter_sizes"][1] != e.value.fields["target_sizes"][1]
    with pytest.raises(ValueError) as e:
        load_drafter(tmp_path / "target", target)
    assert e.value.code == "train.export-not-dflash" and e.value.fields["file"] == str(tmp_path / "target" / "config.json")
    with pytest.raises(FileNotFoundError) as e:
        load_drafter(tmp_path / "nowhere", target)
    assert e.value.code == "train.export-missing" and e.value.fields["dir"] == str(tmp_path / "nowhere")


@pytest.mark.parametrize("layers,causal_key", [
    ({"layer_types": "sliding,full,sliding", "sliding_window": 6}, None),  # the convention, per layer
    ({"layer_types": "sliding", "sliding_window": 5}, True),
    ({"layer_types": "sliding", "sliding_window": 5, "causal": False}, False),  # non-causal SWA
    ({"causal": True}, True),
])
def test_sliding_window_layers_and_causality_round_trip(tmp_path, layers, causal_key):
    target = save_tiny_target(tmp_path / "target")
    torch.manual_seed(0)
    drafter = perturb(DFlashDrafter.from_target(target, drafter_type="dflash", num_hidden_layers=DRAFT_LAYERS, target_layer_ids=[1, 3, 5],
                                                block_size=4, attention_backend="sdpa", **layers))
    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == drafter.config.layer_types
    assert config["sliding_window"] == drafter.config.sliding_window
    assert config["use_sliding_window"] == ("sliding_attention" in drafter.config.layer_types)
    assert config.get("is_causal") == causal_key and config["dflash_config"].get("causal") == causal_key
    hf = Qwen3Config(**config)
    assert hf.layer_types == drafter.config.layer_types and hf.sliding_window == drafter.config.sliding_window

    reloaded = load_drafter(out, target, attention_backend="sdpa")
    assert reloaded.config == drafter.config
    kinds = [reloaded.config.layer_attention(i) for i in range(DRAFT_LAYERS)]
    assert kinds == [drafter.config.layer_attention(i) for i in range(DRAFT_LAYERS)]
    batch = sample_batch(2)
    torch.testing.assert_close(block_logits(reloaded, batch), block_logits(drafter, batch), rtol=0, atol=0)


def qwen35_target_config(rope: dict):
    """A tiny Qwen3.5 text config (hybrid linear attention, partial_rotary_factor 0.25, M-RoPE keys)."""
    dims = dict(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=TARGET_LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB,
                max_position_embeddings=256, rms_norm_eps=1e-6)
    params = {"rope_theta": 10000.0, **rope, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
              "mrope_interleaved": True}
    try:
        from transformers import Qwen3_5TextConfig
    except ImportError:  # transformers 4.57 predates Qwen3.5: its config.json keys, 4.57-style RoPE
        from types import SimpleNamespace

        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        return SimpleNamespace(**dims, rope_theta=params["rope_theta"], partial_rotary_factor=0.25,
                               rope_scaling=scaling if rope["rope_type"] != "default" else None)
    return Qwen3_5TextConfig(**dims, rope_parameters=params)


def full_rotary_qwen3_block(drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int, rope: dict) -> torch.Tensor:
    """Block logits computed independently: transformers' own full-rotary Qwen3 RoPE, attention by hand."""
    import inspect

    from transformers.models.qwen3 import modeling_qwen3

    c = drafter.config
    rope_kwargs = ({"rope_parameters": {"rope_theta": 10000.0, **rope}}
                   if "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters
                   else {"rope_theta": 10000.0, "rope_scaling": dict(rope) if rope["rope_type"] != "default" else None})
    reference_config = Qwen3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                   head_dim=HEAD_DIM, max_position_embeddings=256, **rope_kwargs)
    rotary = modeling_qwen3.Qwen3RotaryEmbedding(reference_config)
    w = {k: v.float() for k, v in drafter.state_dict().items()}

    def norm(x, weight, eps=c.rms_norm_eps):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def heads(x, n):
        return x.view(1, x.shape[1], n, HEAD_DIM).transpose(1, 2)

    T, B = hidden.shape[1], c.block_size
    context = norm(hidden @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = drafter.embed_weight[torch.tensor([[anchor] + [c.mask_token_id] * (B - 1)])].float()
    positions = torch.arange(T + B)[None]
    cos, sin = rotary(x, positions)
    for i in range(c.num_hidden_layers):
        pre = f"layers.{i}."
        h = norm(x, w[pre + "input_layernorm.weight"])
        kv_in = torch.cat([context, h], dim=1)
        q = norm(heads(h @ w[pre + "self_attn.q_proj.weight"].T, HEADS), w[pre + "self_attn.q_norm.weight"])
        k = norm(heads(kv_in @ w[pre + "self_attn.k_proj.weight"].T, KV_HEADS), w[pre + "self_attn.k_norm.weight"])
        v = heads(kv_in @ w[pre + "self_attn.v_proj.weight"].T, KV_HEADS)
        q, _ = modeling_qwen3.apply_rotary_pos_emb(q, q, cos[:, T:], sin[:, T:])
        k, _ = modeling_qwen3.apply_rotary_pos_emb(k, k, cos, sin)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / HEAD_DIM**0.5, dim=-1) @ v  # the block sees everything
        x = x + attn.transpose(1, 2).reshape(1, B, -1) @ w[pre + "self_attn.o_proj.weight"].T
        h = norm(x, w[pre + "post_attention_layernorm.weight"])
        gate, up = h @ w[pre + "mlp.gate_proj.weight"].T, h @ w[pre + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[pre + "mlp.down_proj.weight"].T
    return norm(x, w["norm.weight"])[:, 1:] @ drafter.lm_head_weight.float().T


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, YARN_ROPE])
def test_partial_rotary_target_exports_a_full_rotary_drafter(tmp_path, rope):
    config = DrafterConfig.from_target_config(qwen35_target_config(rope), drafter_type="dflash", num_hidden_layers=2,
                                              target_layer_ids=[1, 5], block_size=4, attention_backend="sdpa")
    torch.manual_seed(0)
    drafter = perturb(DFlashDrafter(config, random_target_weights()))
    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    exported = json.loads((out / "config.json").read_text())
    for where in (exported, exported["rope_parameters"], exported["rope_scaling"] or {}):
        assert not PARTIAL_ROPE_KEYS & set(where) and where.get("rope_dim", HEAD_DIM) == HEAD_DIM
    assert exported["rope_parameters"] == {"rope_theta": 10000.0, **rope}

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 40, 2 * HIDDEN, generator=g)
    cache = ContextCache(drafter)
    cache.append_context(hidden)
    got = cache.draft_block(torch.tensor([3]))
    expected = full_rotary_qwen3_block(drafter, hidden, 3, rope)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # The comparison has teeth: the same block under the other RoPE settings differs.
    other = YARN_ROPE if rope["rope_type"] == "default" else {"rope_type": "default"}
    assert (full_rotary_qwen3_block(drafter, hidden, 3, other) - got).abs().max() > 1e-3


def save_tokenizer(path, words: int, special: list[str], mask_token: str | None = None) -> None:
    """A word-level tokenizer of `words` tokens plus `special` ones, saved beside a target."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    if mask_token:
        tokenizer.add_special_tokens({"mask_token": mask_token})
    tokenizer.save_pretrained(str(path))


@pytest.mark.parametrize("words,special,mask,expected", [
    (VOCAB - 8, ["<|reserved_special_token_0|>", "<|MASK|>"], None, (VOCAB - 7, "<|MASK|>")),  # a mask-like token
    (VOCAB - 8, ["<s>"], "[MASK]", (VOCAB - 7, "[MASK]")),  # the tokenizer's mask_token
    (VOCAB - 8, ["<s>"], None, (VOCAB - 7, None)),  # the first row the tokenizer never produces
    (VOCAB - 2, ["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"], None,
     (VOCAB - 2, "<|reserved_special_token_0|>")),  # a full vocabulary: a reserved token
])
def test_mask_token_comes_from_the_tokenizer_and_reaches_the_export(tmp_path, words, special, mask, expected):
    target = save_tiny_target(tmp_path / "target")
    save_tokenizer(target, words, special, mask)
    notes = []
    drafter = DFlashDrafter.from_target(target, drafter_type="dflash", num_hidden_layers=2, block_size=4, announce=notes.append)
    assert (drafter.config.mask_token_id, drafter.config.mask_token) == expected
    assert len(notes) == 1 and f"id {expected[0]}" in notes[0]
    config = json.loads((export_drafter(drafter, tmp_path / "export") / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == expected[0]
    assert config["dflash_config"].get("mask_token") == expected[1]
    assert load_drafter(tmp_path / "export", target).config.mask_token_id == expected[0]
    # An explicit id wins and nothing is chosen.
    notes.clear()
    assert DFlashDrafter.from_target(target, drafter_type="dflash", num_hidden_layers=2, mask_token_id=5, announce=notes.append).config.mask_token_id == 5
    assert not notes
