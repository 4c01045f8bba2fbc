"""XPress (--drafter-type xpress): what vLLM 0.34.0 reads of an XPress drafter, as facts, checked
against an export both ways; the refiner's arithmetic against vLLM's serving form; the Jacobi
decode against the sequential one; and a run that trains, resumes bit-exact, exports, reloads and
decodes losslessly, greedy and sampled."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from conftest import assert_same_weights, final_weights, tiny_train_config
from dflash.train.heads import get_head, head_for_architecture
from safetensors.torch import load_file, save_file
from test_eval_support import tiny_drafter, tiny_target

# -- the facts (vLLM 0.34.0, model_executor/models/qwen3_xpress.py and registry.py) -----------------

# registry.py: both names load Qwen3XPressForCausalLM (the DFlash-prefixed one is what vLLM asks
# for when serving under method "dflash"); SGLang 0.5.23's srt/models declare no XPress model.
VLLM_ARCHITECTURES = {"Qwen3XPressModel": ("qwen3_xpress", "Qwen3XPressForCausalLM"),
                      "DFlashQwen3XPressModel": ("qwen3_xpress", "Qwen3XPressForCausalLM")}
# Qwen3XPressModel.__init__ reads these with getattr on the draft's config (the top level), with
# these defaults (xpress_block_size: else num_speculative_steps + 1).
VLLM_TOP_LEVEL_DEFAULTS = {"xpress_rank": 256, "xpress_mlp_hidden": 512, "xpress_topc": 512}
# XPressRefinerHead.HYBRID_KEY_MAP: a checkpoint's `xpress_head.<key>` -> the head's attribute;
# load_weights keeps the raw "mix.L" aside and folds it (L * tril + I) into mix_L after loading.
VLLM_HYBRID_KEY_MAP = {"w1.weight": "w1.weight", "down_h.weight": "down_h.weight", "down_g.weight": "down_g.weight",
                       "in_proj.weight": "in_proj.weight", "mix.L": "__raw_mix_L__",
                       "mlp.gate_proj.weight": "mlp_gate.weight", "mlp.up_proj.weight": "mlp_up.weight",
                       "mlp.down_proj.weight": "mlp_down.weight", "w2.weight": "w2.weight"}


def vllm_head_parameters(vocab: int, hidden: int, block: int, rank: int, mlp: int) -> dict[str, tuple[int, ...]]:
    """XPressRefinerHead's parameters and their shapes (its __init__)."""
    return {"w1.weight": (vocab, rank), "down_h.weight": (rank, hidden), "down_g.weight": (rank, hidden),
            "in_proj.weight": (rank, 3 * rank), "mix_L": (rank, block, block), "mlp_gate.weight": (mlp, rank),
            "mlp_up.weight": (mlp, rank), "mlp_down.weight": (rank, mlp), "w2.weight": (vocab, rank)}


def vllm_refine_bias(head: dict[str, torch.Tensor], prev_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """vLLM's XPressRefinerHead.refine_bias over [n, T] previous ids and [n, T, D] states, from its
    serving-form tensors (mix_L folded)."""
    g = h.mean(dim=1, keepdim=True).expand_as(h)
    hcache = torch.cat([h @ head["down_h.weight"].T, g @ head["down_g.weight"].T], dim=-1)
    x = torch.cat([hcache, head["w1.weight"][prev_ids]], dim=-1) @ head["in_proj.weight"].T
    x = torch.bmm(head["mix_L"], x.permute(2, 1, 0)).permute(2, 1, 0)
    mlp = (torch.nn.functional.silu(x @ head["mlp_gate.weight"].T) * (x @ head["mlp_up.weight"].T)) @ head["mlp_down.weight"].T
    return (x + mlp) @ head["w2.weight"].T


def vllm_load(tensors: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """What Qwen3XPressForCausalLM.load_weights makes of a checkpoint's xpress_head tensors."""
    head, raw = {}, None
    for name, tensor in tensors.items():
        if not name.startswith("xpress_head."):
            continue
        sub = name[len("xpress_head."):]
        if sub == "mix.L":
            raw = tensor
            continue
        head[VLLM_HYBRID_KEY_MAP.get(sub, sub)] = tensor
    tril = torch.tril(torch.ones(block, block))
    head["mix_L"] = raw * tril + torch.eye(block)  # fold_from_raw_
    return head


XPRESS = dict(drafter_type="xpress", xpress_rank=8, xpress_mlp_hidden=16, xpress_topc=16)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def randomized(drafter):
    """The drafter with every refiner tensor random (the mix's too: a fresh one starts at 0)."""
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in drafter.xpress_head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return drafter


# -- the export, both ways ---------------------------------------------------------------------


def test_an_export_has_exactly_the_tensors_and_top_level_keys_vllm_reads(target, tmp_path):
    from dflash.train.exports.export import export_drafter

    drafter = tiny_drafter(target, **XPRESS)
    c = drafter.config
    out = export_drafter(drafter, tmp_path / "x", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3XPressModel"] and "Qwen3XPressModel" in VLLM_ARCHITECTURES
    assert head_for_architecture(config["architectures"]) is get_head("xpress")
    assert {k: config[k] for k in ("xpress_block_size", "xpress_rank", "xpress_mlp_hidden", "xpress_topc")} == {
        "xpress_block_size": c.block_size, "xpress_rank": 8, "xpress_mlp_hidden": 16, "xpress_topc": 16}
    assert config.get("draft_vocab_size", config["vocab_size"]) == config["vocab_size"]  # vLLM: a full-vocabulary draft

    tensors = load_file(str(out / "model.safetensors"))
    backbone = {n for n in tensors if not n.startswith("xpress_head.")}
    assert backbone == set(tiny_drafter(target).state_dict())  # the DFlash backbone's names, as DFlash exports them
    loaded = vllm_load(tensors, c.block_size)  # every head tensor is one vLLM maps, none is missing
    want = vllm_head_parameters(c.vocab_size, c.hidden_size, c.block_size, 8, 16)
    assert {k: tuple(v.shape) for k, v in loaded.items()} == want
    assert all(k.split(".")[0] not in ("embed_tokens", "lm_head") for k in tensors)  # the target's, not shipped


def test_the_refiner_computes_what_vllm_serves_from_the_export(target, tmp_path):
    from dflash.train.exports.export import export_drafter
    from dflash.train.heads.xpress import previous_tokens

    drafter = randomized(tiny_drafter(target, **XPRESS))
    block = drafter.config.block_size
    out = export_drafter(drafter, tmp_path / "x", dtype=torch.float32)
    head = vllm_load(load_file(str(out / "model.safetensors")), block)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, block, drafter.config.hidden_size, generator=g)
    prev = previous_tokens(torch.tensor([1, 2, 3]), torch.randint(0, drafter.config.vocab_size, (3, block), generator=g))
    with torch.no_grad():
        ours = drafter.xpress_head.w2(drafter.xpress_head.latent(prev, drafter.xpress_head.hidden_cache(h)))
    torch.testing.assert_close(ours, vllm_refine_bias(head, prev, h), rtol=1e-4, atol=1e-5)


def test_a_checkpoint_in_vllms_layout_imports(target, tmp_path):
    """vLLM's own attribute names (mlp_gate, ...), the folded mix_L instead of mix.L, a rank other
    than the default and the XPress keys only at the top level: the drafter reads them all."""
    from dflash.train.exports.export import export_drafter, load_drafter

    settings = {**XPRESS, "xpress_rank": 12, "xpress_mlp_hidden": 24}
    drafter = randomized(tiny_drafter(target, **settings))
    block = drafter.config.block_size
    out = export_drafter(drafter, tmp_path / "x", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    for key in ("xpress_block_size", "xpress_rank", "xpress_mlp_hidden", "xpress_topc", "num_jacobi_passes"):
        config["dflash_config"].pop(key, None)
    config["num_jacobi_passes"] = 4
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(out / "model.safetensors"))
    serving = vllm_load(tensors, block)
    for ours in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "mix.L"):
        tensors.pop("xpress_head." + ours)
    tensors.update({"xpress_head." + k: serving[k] for k in ("mlp_gate.weight", "mlp_up.weight", "mlp_down.weight", "mix_L")})
    save_file(tensors, str(out / "model.safetensors"))

    (tmp_path / "t").mkdir()
    target.save_pretrained(str(tmp_path / "t"))
    back = load_drafter(out, tmp_path / "t")
    c = back.config
    assert (c.drafter_type, c.xpress_rank, c.xpress_mlp_hidden, c.xpress_passes, c.block_size) == ("xpress", 12, 24, 4, block)
    tril = torch.tril(torch.ones(block, block))
    want, got = drafter.xpress_head.state_dict(), back.xpress_head.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        mask = tril if name == "mix.L" else 1.0  # above the diagonal the mix never reaches
        torch.testing.assert_close(got[name] * mask, want[name] * mask)


# -- the decode --------------------------------------------------------------------------------


@pytest.mark.parametrize("topc", [0, 6])
def test_block_minus_one_jacobi_passes_give_the_sequential_decode(target, topc):
    from dflash.train.heads.xpress import JacobiWalk, previous_tokens

    drafter = randomized(tiny_drafter(target, **{**XPRESS, "block_size": 6, "xpress_topc": topc, "xpress_passes": 5}))
    g = torch.Generator().manual_seed(2)
    states = torch.randn(4, 6, drafter.config.hidden_size, generator=g)
    anchors, before = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11, 12])
    with torch.no_grad():
        jacobi = JacobiWalk(drafter, 0.0, 0)(states, anchors, before)
        refiner, base = drafter.xpress_head, drafter.logits(states[:, 1:])
        allowed = torch.zeros_like(base, dtype=torch.bool)
        allowed.scatter_(-1, base.topk(topc or base.shape[-1], dim=-1).indices, True)
        block = torch.cat([anchors[:, None], torch.zeros(4, 5, dtype=torch.long)], dim=1)
        for k in range(1, 6):  # slot by slot, each from the tokens settled before it
            bias = refiner.w2(refiner.latent(previous_tokens(before, block), refiner.hidden_cache(states)))[:, k]
            block[:, k] = (base[:, k - 1] + bias).masked_fill(~allowed[:, k - 1], float("-inf")).argmax(-1)
    assert torch.equal(jacobi, block[:, 1:])


def test_sampled_xpress_decoding_follows_the_target_distribution(target):
    """At T = 1 the passes sample (Gumbel noise fixed per block); the second output token, the
    first one a draft decides, must still follow the target's own distribution."""
    from dflash.eval.speculative import DecodeConfig, speculative_generate

    drafter = tiny_drafter(target, steps=60, **XPRESS)
    prompt, n = [7, 21, 5, 30, 9, 12, 4, 18, 25], 400
    with torch.no_grad():
        first = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        rows = torch.tensor([prompt + [t] for t in range(first.shape[0])])
        second = (first[:, None] * torch.softmax(target(input_ids=rows).logits[:, -1], -1)).sum(0)
    gens = speculative_generate(target, drafter, [prompt] * n, DecodeConfig(max_new_tokens=3, temperature=1.0, seed=5))
    drawn = torch.bincount(torch.tensor([g.tokens[1] for g in gens]), minlength=second.shape[0]).double() / n
    tolerance = 4 * (second * (1 - second) / n).sqrt() + 0.005
    assert ((drawn - second.double()).abs() <= tolerance.double()).all()


# -- a run -------------------------------------------------------------------------------------


STEPS = 6
SETTINGS = dict(max_steps=STEPS, epochs=2, grad_accum=1, seed=3, save_interval=2, num_workers=0, eval_fraction=0.0,
                compile=False, drafter_type="xpress", xpress_rank=8, xpress_mlp_hidden=16, xpress_topc=8)


def test_xpress_trains_resumes_bit_exact_exports_and_decodes_losslessly(tiny_world, tmp_path, monkeypatch):
    from dflash.eval.speculative import (
        DecodeConfig,
        DrafterProposer,
        speculative_generate,
        target_generate,
    )
    from dflash.train.exports.export import load_drafter
    from dflash.train.run.loop import train
    from transformers import AutoModelForCausalLM

    world = tiny_world
    whole = train(tiny_train_config(world["cache"], world["target"], tmp_path / "whole", **SETTINGS))
    assert whole.exit_status == 0 and whole.step == STEPS
    weights = final_weights(tmp_path / "whole")
    assert weights["xpress_head.mix.L"].abs().sum() > 0  # the refiner trained (its mix starts at 0)

    head, objective, calls = get_head("xpress"), get_head("xpress").objective, []

    def stopping(inputs, config):  # SIGINT during step 3: the run checkpoints it and stops
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return objective(inputs, config)

    monkeypatch.setattr(head, "objective", stopping)
    stopped = train(tiny_train_config(world["cache"], world["target"], tmp_path / "resumed", **SETTINGS))
    assert stopped.exit_status != 0 and stopped.step == 3
    monkeypatch.undo()
    resumed = train(tiny_train_config(world["cache"], world["target"], tmp_path / "resumed", **SETTINGS))
    assert resumed.exit_status == 0 and resumed.step == STEPS
    assert_same_weights(final_weights(tmp_path / "resumed"), weights)

    config = json.loads((whole.final_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3XPressModel"] and config["xpress_rank"] == 8
    assert "SGLang 0.5.23 does not serve XPress" in (whole.final_dir / "README.md").read_text()
    drafter = load_drafter(whole.final_dir, world["target"])
    assert drafter.config.drafter_type == "xpress" and DrafterProposer(drafter, 4).whole_block
    torch.testing.assert_close(drafter.xpress_head.mix.L, weights["xpress_head.mix.L"].bfloat16().float())

    model = AutoModelForCausalLM.from_pretrained(str(world["target"]), dtype=torch.float32).eval()
    prompts = [[5, 9, 13, 2, 7], [11, 3, 3, 8, 20, 4, 1], [6]]
    decode = DecodeConfig(max_new_tokens=12)
    want = [g.tokens for g in target_generate(model, prompts, decode)]
    assert [g.tokens for g in speculative_generate(model, drafter, prompts, decode)] == want
    assert [g.tokens for g in speculative_generate(model, drafter, prompts, DecodeConfig(max_new_tokens=12, block_size=3))] == want


def test_settings_xpress_cannot_train_are_refused_naming_the_flag(tiny_world, target, tmp_path):
    from dflash.train.config import TrainConfigError

    with pytest.raises(TrainConfigError) as refused:
        tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "run", drafter_type="xpress",
                          xpress_base_anchor_weight=0.0)
    assert refused.value.code == "train.setting-range"
    assert refused.value.fields["flag"] == "--xpress-base-anchor-weight" and refused.value.fields["value"] == 0.0
    with pytest.raises(ValueError) as refused:  # (a drafter's config too: an export's reader takes it so)
        tiny_drafter(target, **{**XPRESS, "xpress_rank": 0})
    assert refused.value.code == "train.setting-range"
    assert (refused.value.fields["flag"], refused.value.fields["value"], refused.value.fields["default"]) == (
        "--xpress-rank", 0, 256)
