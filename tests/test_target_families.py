"""Every target family the drafters are trained for, on CPU: extract -> train -> export -> lossless
speculative decoding, and soft labels recomputed through the target's own final norm.

Tiny random-init targets are built here from their transformers configs: dense Qwen3, Qwen3-MoE,
Qwen3.5 (hybrid linear attention, partial rotary), Llama-3 (llama3 RoPE), Mistral and Gemma 3
(sliding-window targets; Gemma's zero-centred norm and logit soft-capping), DeepSeek-V3 (the
architecture of Kimi K2: multi-head latent attention, MoE), gpt-oss (MoE, attention sinks,
sliding layers). Targets with sliding-window layers get a drafter with a
sliding-window layer too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_train_config, write_jsonl
from dflash.cache_tools.reader import CacheReader
from dflash.eval.speculative import (
    DecodeConfig,
    Proposer,
    speculative_generate,
    target_generate,
    verify_generate,
)
from dflash.eval.target import TargetUnbatchableError
from dflash.train.data.loader import sample_tensors
from dflash.train.exports.export import load_drafter
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.run.loop import train
from extract_utils import run_cli
from transformers import AutoModelForCausalLM

VOCAB, LAYERS, WINDOW = 128, 6, 8
DIMS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
SLIDING_DRAFTER = {"draft_layer_types": "sliding,full", "draft_sliding_window": WINDOW}


def _config(name: str, **extra):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return cls(**{**DIMS, **extra})


FAMILIES = {
    "qwen3": (lambda: _config("Qwen3Config"), {}),
    "qwen3-moe": (lambda: _config("Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), {}),
    "qwen3.5": (lambda: _config("Qwen3_5TextConfig", **LINEAR,
                                layer_types=["linear_attention", "linear_attention", "full_attention"] * 2), {}),
    "llama-3": (lambda: _config("LlamaConfig", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), {}),
    "mistral": (lambda: _config("MistralConfig", sliding_window=WINDOW), SLIDING_DRAFTER),
    "gemma-3": (lambda: _config("Gemma3TextConfig", sliding_window=WINDOW, final_logit_softcapping=30.0,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
                SLIDING_DRAFTER),
    "deepseek-v3": (lambda: _config("DeepseekV3Config", **{"num_key_value_heads": 4, "head_dim": 8}, n_routed_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
                                    first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                    qk_rope_head_dim=8, v_head_dim=16), {}),
    "gpt-oss": (lambda: _config("GptOssConfig", **{"intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 3),
                SLIDING_DRAFTER),
}


# Targets whose forward changes the logits after the lm_head (runtime/logits.py), for the soft-label tests only.
HEAD_FAMILIES = {
    "cohere": lambda: _config("CohereConfig", logit_scale=0.25),
    "granite": lambda: _config("GraniteConfig", logits_scaling=4.0),
    # a cap the tiny model's logits reach (at 30 the tanh is all but linear on them)
    "gemma-3-cap1": lambda: _config("Gemma3TextConfig", sliding_window=WINDOW, final_logit_softcapping=1.0,
                                    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
}


def family_config(family: str):
    return FAMILIES[family][0]() if family in FAMILIES else HEAD_FAMILIES[family]()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is as fast and does not stall beside other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_target(path: Path, config) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # a final norm that is not the identity, so the norm's form matters
        model.model.norm.weight.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path, model


def periodic_records(n: int = 12, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        pattern = torch.randint(0, VOCAB, (5,), generator=g)
        ids = pattern.repeat(8)[: 24 + i].tolist()
        out.append({"id": f"r{i}", "input_ids": ids, "loss_mask": [0] * 5 + [1] * (len(ids) - 5)})
    return out


def extract(tmp_path: Path, target: Path, *extra: str) -> Path:
    data = write_jsonl(tmp_path / "data.jsonl", periodic_records())
    cache = tmp_path / "cache"
    result = run_cli(["--target-model", target, "--data", data, "--output", cache, "--dtype", "fp32",
                      "--target-layer-ids", "1,3", "--part-tokens", "200", "--token-budget", "256", *extra])
    assert result.exit_code == 0, result.output
    return cache


def assert_cache_holds_each_sample_run_alone(cache: Path, model: torch.nn.Module, layer_ids: tuple[int, ...]) -> None:
    """The states extracted in padded batches of unequal lengths are those of each sample run
    alone (layer i's output is hidden_states[i + 1]), up to the bf16 codec's rounding; a row of
    another sample or position, or padding leaking into a real token, is off by ~1."""
    reader = CacheReader(cache)
    try:
        assert len({len(reader.read_sample(i)["input_ids"]) for i in range(len(reader))}) > 1
        for i in range(len(reader)):
            sample = sample_tensors(reader.read_sample(i))
            with torch.no_grad():
                states = model(sample["input_ids"].long()[None], output_hidden_states=True).hidden_states
            got = sample["hidden"].float().chunk(len(layer_ids), dim=-1)
            for layer, cached in zip(layer_ids, got):
                ref = states[layer + 1][0].float()
                err = float((cached - ref).norm() / ref.norm())
                assert err < 1e-2, f"sample {i}, layer {layer}: relative error {err:.4f}"
    finally:
        reader.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_extracts_trains_exports_and_decodes_losslessly(tmp_path, family):
    make_config, drafter_settings = FAMILIES[family]
    target, model = save_target(tmp_path / "target", make_config())
    cache = extract(tmp_path, target)
    assert_cache_holds_each_sample_run_alone(cache, model, layer_ids=(1, 3))

    run = tmp_path / "run"
    result = train(tiny_train_config(cache, target, run, num_draft_layers=2, max_steps=4, epochs=1,
                                     **drafter_settings))
    assert result.exit_status == 0 and result.final_dir is not None
    exported = json.loads((result.final_dir / "config.json").read_text())
    assert exported["dflash_config"]["target_layer_ids"] == [1, 3]
    assert exported["layer_types"] == (["sliding_attention", "full_attention"] if drafter_settings
                                       else ["full_attention"] * 2)
    # No partial-rotary or M-RoPE key of the target reaches the export.
    assert "partial_rotary_factor" not in exported["rope_parameters"] and "mrope_section" not in exported["rope_parameters"]

    drafter = load_drafter(result.final_dir, target)  # every tensor present, none unexpected
    config = DecodeConfig(max_new_tokens=3 * WINDOW)  # decoding runs past the target's window
    prompts = [r["input_ids"][:n] for r, n in zip(periodic_records(2, seed=5), (7, 13))]
    for prompt in prompts:
        expected = target_generate(model, [prompt], config)[0].tokens
        got = speculative_generate(model, drafter, [prompt], config)[0]
        assert got.tokens == expected


class OracleProposer(Proposer):
    """Proposes the target's own next 2 tokens, then a wrong one: every cycle rejects a draft
    after accepting some, the case where the target's cache must be rolled back."""

    def __init__(self, reference: list[int], width: int = 3) -> None:
        self.reference, self.width = reference, width

    def propose(self, anchors, anchor_positions, histories):
        done = len(histories[0][1])
        right = (self.reference[done:done + 2] + [0, 0])[:2]
        drafts = torch.tensor([right + [(right[-1] + 1) % VOCAB] * (self.width - 2)])
        return drafts, torch.full((1,), self.width)


@pytest.mark.parametrize("family", ["qwen3.5", "mistral", "gpt-oss"])
def test_partly_accepted_blocks_roll_the_target_state_back_exactly(tmp_path, family):
    _, model = save_target(tmp_path / "target", FAMILIES[family][0]())
    config = DecodeConfig(max_new_tokens=4 * WINDOW)
    prompt = periodic_records(1, seed=7)[0]["input_ids"][:9]
    expected = target_generate(model, [prompt], config)[0].tokens
    got = verify_generate(model, OracleProposer(expected), [prompt], config)[0]
    assert got.tokens == expected
    assert got.acceptance_lengths[:-1] == [3] * (len(got.acceptance_lengths) - 1)  # 2 drafts + the bonus
    with pytest.raises(TargetUnbatchableError) as refused:  # a ValueError too
        verify_generate(model, OracleProposer(expected), [prompt, prompt], config)
    kind = "linear-attention" if family == "qwen3.5" else "sliding-window"
    assert refused.value.code == "eval.target-unbatchable"
    assert refused.value.fields == {"layers": kind, "flag": "--batch-size", "value": 2}


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5", "gemma-3", "cohere", "granite"])
def test_soft_labels_from_last_hidden_equal_the_target_own_logits(tmp_path, family):
    target, model = save_target(tmp_path / "target", family_config(family))
    cache = extract(tmp_path, target, "--store-last-hidden")
    drafter = DFlashDrafter.from_target(target, with_final_norm=True, target_layer_ids=[1, 3], num_hidden_layers=1)
    reader = CacheReader(cache)
    for i in (0, len(reader) - 1):
        sample = sample_tensors(reader.read_sample(i))
        last_hidden = sample["last_hidden"].float()
        got = drafter.target_logits(last_hidden)
        with torch.no_grad():
            own = model.lm_head(model.model.norm(last_hidden))  # the target's own modules
            if family == "gemma-3":
                cap = model.config.final_logit_softcapping
                own = torch.tanh(own / cap) * cap
            elif family == "cohere":
                own = own * model.config.logit_scale
            elif family == "granite":
                own = own / model.config.logits_scaling
            full = model(sample["input_ids"][None].long()).logits[0]  # from the unrounded states
        torch.testing.assert_close(got, own, rtol=1e-5, atol=1e-5)  # fp32 rounding only
        # The cache holds bf16 states: the full forward differs by that rounding, not more.
        assert (got - full).abs().max() < 0.02 * full.abs().max()
    if family in ("qwen3.5", "gemma-3"):  # zero-centred norms: a Qwen3-style re-implementation would be wrong
        w = model.model.norm.weight
        naive = (w * last_hidden * torch.rsqrt(last_hidden.pow(2).mean(-1, keepdim=True) + 1e-6)) @ model.lm_head.weight.T
        assert (naive - got).abs().max() > 0.1 * got.abs().max()


@pytest.mark.parametrize("family", ["qwen3", "gemma-3-cap1", "cohere", "granite"])
def test_stored_topk_logprobs_are_the_target_own_next_token_logprobs(tmp_path, family):
    """--store-topk through the target's norm, head and post-head steps (soft cap, scale): the
    log-probs its own forward gives, not those of the raw head."""
    target, model = save_target(tmp_path / "target", family_config(family))
    reader = CacheReader(extract(tmp_path, target, "--store-topk", "4"))
    for i in (0, len(reader) - 1):
        sample = sample_tensors(reader.read_sample(i))
        with torch.no_grad():
            logits = model(sample["input_ids"][None].long()).logits[0].float()
        logprobs, ids = torch.log_softmax(logits, dim=-1).topk(4, dim=-1)
        assert torch.equal(sample["topk_ids"].long(), ids)
        torch.testing.assert_close(sample["topk_logprobs"].float(), logprobs, rtol=1e-4, atol=1e-4)
