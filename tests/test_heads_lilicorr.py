"""LiLiCorr (`--drafter-type lilicorr`): what vLLM 0.34.0's and SGLang 0.5.23's loaders read, the
export holding exactly that and a checkpoint in that layout read back, the lattice's arithmetic,
the path loss against the walk it trains, and a run that trains, resumes bit-exact, exports and
decodes losslessly (greedy and sampled)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from conftest import assert_same_weights, final_weights, tiny_train_config
from dflash.train.exports.export import export_drafter, load_drafter
from dflash.train.heads import get_head, head_for_architecture
from dflash.train.heads.dflash2.modules import walk_greedy, walk_sampled
from dflash.train.heads.lilicorr.lattice import LiLiCorrHead, path_loss
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.run.loop import train
from safetensors import safe_open
from safetensors.torch import save_file
from test_drafter_export import expected_weight_names
from test_drafter_support import HIDDEN, save_tiny_target

# -- the engines' contract, as facts ------------------------------------------------------------

ARCHITECTURE = "LiLiCorrDraftModel"
"""vLLM 0.34.0 model_executor/models/registry.py ("LiLiCorrDraftModel": ("lilicorr", "LiLiCorrForCausalLM"));
SGLang 0.5.23 srt/models/lilicorr.py EntryClass = [LiLiCorrDraftModel]."""
ENGINE_CONFIG_KEYS = {
    # SGLang srt/speculative/lilicorr_utils.py _parse_lilicorr_config: every lilicorr_* key required (no
    # defaults); lilicorr_enabled false builds no head. vLLM lilicorr.py LiLiCorr / LiLiCorrHead read the
    # same keys from dflash_config, and block_size (dflash_config first) for the slots.
    "lilicorr_enabled", "lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers",
    "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps",
    "lilicorr_logit_scale", "block_size",
}


def engine_lilicorr_tensors(*, model_hidden: int, hidden: int, block_size: int, topk: int, layers: int,
                            heads: int, mlp_ratio: float, factor: int) -> dict[str, tuple[int, ...]]:
    """The head's tensors and shapes as vLLM's and SGLang's `LiLiCorrHead.__init__` build them
    (every Linear with a bias: vLLM ReplicatedLinear / NemotronHMLP(bias=True), SGLang ReplicatedLinear /
    nn.Linear; `token_proj` only where the head is narrower than the drafter; SGLang's
    check_head_weight_coverage refuses a missing or an extra one, vLLM 0.34 an extra one)."""
    h, slots, mid = hidden, block_size - 1, int(hidden * mlp_ratio)
    t: dict[str, tuple[int, ...]] = {}

    def linear(name: str, n_in: int, n_out: int) -> None:
        t[f"lilicorr.{name}.weight"], t[f"lilicorr.{name}.bias"] = (n_out, n_in), (n_out,)

    if h != model_hidden:
        linear("token_proj", model_hidden, h)
    linear("pass_hidden_proj", model_hidden, h)
    t["lilicorr.feature_norm.weight"] = t["lilicorr.feature_norm.bias"] = (5,)
    linear("feature_mlp.up_proj", 5, h)
    linear("feature_mlp.down_proj", h, h)
    t["lilicorr.slot_embedding"] = (1, 1, slots, 1, h)
    t["lilicorr.rank_embedding"] = (1, 1, 1, topk, h)
    t["lilicorr.relative_slot_bias"] = (heads, 2 * block_size - 1)
    t["lilicorr.same_slot_bias"] = (heads,)
    linear("context_proj", model_hidden, h)
    for i in range(layers):
        p = f"layers.{i}"
        t[f"lilicorr.{p}.attn_norm.weight"] = t[f"lilicorr.{p}.mlp_norm.weight"] = (h,)
        t[f"lilicorr.{p}.attn.in_proj_weight"], t[f"lilicorr.{p}.attn.in_proj_bias"] = (3 * h, h), (3 * h,)
        linear(f"{p}.attn.out_proj", h, h)
        linear(f"{p}.mlp.up_proj", h, mid)
        linear(f"{p}.mlp.down_proj", mid, h)
    t["lilicorr.output_norm.weight"] = t["lilicorr.anchor_norm.weight"] = (h,)
    linear("factor_input_proj", 3 * h, h)
    linear("out_head", h, factor)
    linear("in_head", h, factor)
    linear("anchor_out_head", h, factor)
    return t


SMALL = dict(drafter_type="lilicorr", lilicorr_candidate_topk=4, lilicorr_num_layers=2, lilicorr_num_heads=4,
             lilicorr_mlp_ratio=1.5, lilicorr_factor_dim=8)


def tiny_lilicorr(tmp_path, **overrides) -> tuple[DFlashDrafter, object]:
    target = save_tiny_target(tmp_path / "target")
    drafter = DFlashDrafter.from_target(target, num_hidden_layers=2, target_layer_ids=[1, 3, 5], block_size=5,
                                        attention_backend="sdpa", **{**SMALL, **overrides})
    with torch.no_grad():  # move every head tensor off its init, so a lost one shows
        for p in drafter.lilicorr.parameters():
            p.normal_(std=0.05)
    return drafter, target


def shapes_of(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize("width", [0, 32])  # as wide as the drafter (no token_proj), and narrower
def test_the_lilicorr_export_holds_exactly_what_the_engines_load_and_reloads_identically(tmp_path, width):
    drafter, target = tiny_lilicorr(tmp_path, lilicorr_hidden_size=width)
    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert ENGINE_CONFIG_KEYS <= set(config["dflash_config"])
    d = config["dflash_config"]
    assert d["lilicorr_enabled"] is True and (d["lilicorr_candidate_topk"], d["block_size"]) == (4, 5)
    assert not d.get("conv_kernel_size")  # the engines build convolutions only where it is set
    expected = engine_lilicorr_tensors(model_hidden=HIDDEN, hidden=width or HIDDEN, block_size=5, topk=4, layers=2,
                                       heads=4, mlp_ratio=1.5, factor=8)
    shapes = shapes_of(out / "model.safetensors")
    names = expected_weight_names(2) | set(expected)
    assert not names - set(shapes), f"missing: {sorted(names - set(shapes))}"
    assert not set(shapes) - names, f"unexpected: {sorted(set(shapes) - names)}"
    assert {n: shapes[n] for n in expected} == expected
    reloaded = load_drafter(out, target, attention_backend="sdpa")
    assert reloaded.head is get_head("lilicorr") and reloaded.config.lilicorr_hidden_size == width
    assert_same_weights(reloaded.state_dict(), drafter.state_dict())


def test_a_checkpoint_in_the_engines_layout_is_read_back(tmp_path):
    """A directory written as the engines' loaders read it (names and shapes from the facts above,
    the keys SGLang requires) loads into a LiLiCorr drafter with those exact values."""
    drafter, target = tiny_lilicorr(tmp_path)
    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    expected = engine_lilicorr_tensors(model_hidden=HIDDEN, hidden=HIDDEN, block_size=5, topk=4, layers=2, heads=4,
                                       mlp_ratio=1.5, factor=8)
    gen = torch.Generator().manual_seed(7)
    written = {name: torch.randn(shape, generator=gen) for name, shape in expected.items()}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        backbone = {name: f.get_tensor(name) for name in f.keys() if not name.startswith("lilicorr.")}  # noqa: SIM118
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    save_file({**backbone, **written}, str(engine_dir / "model.safetensors"))
    (engine_dir / "config.json").write_text(json.dumps(config))
    loaded = load_drafter(engine_dir, target, attention_backend="sdpa")
    state = loaded.state_dict()
    for name, value in written.items():
        assert torch.equal(state[name], value), name
    # ... and a config without a key SGLang requires is refused by name
    bad = dict(config, dflash_config={k: v for k, v in config["dflash_config"].items() if k != "lilicorr_factor_dim"})
    (engine_dir / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError) as refused:
        load_drafter(engine_dir, target, attention_backend="sdpa")
    assert refused.value.code == "train.export-lacks-keys" and refused.value.fields["keys"] == ["lilicorr_factor_dim"]


def test_the_registry_finds_lilicorr_by_its_architecture_and_refuses_a_topk_the_engines_refuse(tmp_path):
    assert head_for_architecture([ARCHITECTURE]) is get_head("lilicorr")
    with pytest.raises(ValueError) as refused:
        tiny_lilicorr(tmp_path, lilicorr_candidate_topk=6)
    assert refused.value.code == "train.lilicorr-topk" and refused.value.fields["value"] == 6
    with pytest.raises(ValueError) as refused:
        tiny_lilicorr(tmp_path, lilicorr_num_heads=5)
    assert refused.value.code == "train.lilicorr-num-heads" and refused.value.fields["value"] == 5


# -- the lattice's arithmetic ----------------------------------------------------------------------


def small_head(**kw) -> LiLiCorrHead:
    torch.manual_seed(0)
    args = dict(model_hidden_size=16, block_size=5, rms_norm_eps=1e-6, candidate_topk=4, hidden_size=0,
                num_layers=1, num_heads=2, mlp_ratio=2.0, factor_dim=8, vector_eps=1e-6, logit_scale=10.0)
    head = LiLiCorrHead(**{**args, **kw})
    with torch.no_grad():
        head.relative_slot_bias.normal_()
        head.same_slot_bias.normal_()
    return head


def lattice_inputs(m: int = 3, slots: int = 4, k: int = 4, d: int = 16):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(m, slots, 50, generator=gen)
    values, ids = torch.topk(logits, k, dim=-1)
    lp = values - torch.logsumexp(logits, -1, keepdim=True)
    return (ids, torch.randn(m, slots, k, d, generator=gen), lp, torch.randn(m, slots, d, generator=gen),
            torch.randn(m, d, generator=gen), torch.tensor([True, False, True])[:m])


def test_the_attention_bias_depends_on_the_slots_distance_and_masks_unscored_slots():
    head = small_head()
    bias = head.attention_bias(4)[0]  # [heads, 16, 16]; candidates 0-3 slot 0, 4-7 slot 1, ...
    assert torch.equal(bias[:, 0, 4], head.relative_slot_bias[:, -1 + 4])  # slot 0 -> slot 1: offset -1
    assert torch.equal(bias[:, 5, 1], head.relative_slot_bias[:, 1 + 4])
    assert torch.equal(bias[:, 2, 3], head.relative_slot_bias[:, 4] + head.same_slot_bias)  # one slot
    masked = head.attention_bias(4, torch.tensor([[True, True, False, True]]))[0]
    assert torch.isinf(masked[:, :, 8:12]).all() and torch.isfinite(masked[:, :, :8]).all()


def test_a_shorter_lattice_is_the_prefix_the_engines_score_and_an_invalid_anchor_reads_no_context():
    head = small_head().eval()
    ids, tokens, lp, states, anchor, valid = lattice_inputs()
    with torch.no_grad():
        full = head(tokens, lp, states, anchor, valid)
        # a request without an anchor scores as one whose anchor state is anything
        other = head(tokens, lp, states, torch.randn_like(anchor), valid)
        short = head(tokens[:, :2], lp[:, :2], states[:, :2], anchor, valid)
    assert full.shape == (3, 4, 4, 4) and short.shape == (3, 2, 4, 4)
    assert torch.equal(full[1], other[1]) and not torch.allclose(full[0], other[0])
    assert (full[:, 0] == full[:, 0, :1]).all()  # slot 0's rows: the anchor's scores, repeated
    assert full.abs().max() <= head.logit_scale + 1e-4  # scaled cosines


def test_the_path_loss_is_the_walks_negative_log_probability_of_the_true_prefix():
    head = small_head()
    ids, tokens, lp, states, anchor, valid = lattice_inputs(m=1)
    scores = head(tokens, lp, states, anchor, valid)
    labels = torch.stack([ids[0, 0, 2], ids[0, 1, 0], ids[0, 2, 3], torch.tensor(49)])[None]  # slot 3 misses
    labels[0, 3] = 10_000  # no candidate
    scored = torch.ones(1, 4, dtype=torch.bool)
    weights = torch.ones(1, 4)
    loss, choice = path_loss(scores, ids, labels, scored, weights)
    logp = torch.log_softmax(scores[0, 0, 0], -1)[2] + torch.log_softmax(scores[0, 1, 2], -1)[0] \
        + torch.log_softmax(scores[0, 2, 0], -1)[3]
    torch.testing.assert_close(loss, -logp / 3)
    # the choice where the earlier slots were right is the greedy walk's along the true path
    greedy = walk_greedy(ids, scores.detach())
    assert choice[0, 0] == greedy[0, 0]
    rows = [scores[0, 1, 2], scores[0, 2, 0]]
    assert [int(ids[0, s + 1, r.argmax()]) for s, r in enumerate(rows)] == choice[0, 1:3].tolist()
    loss.backward()
    assert head.in_head.weight.grad.abs().sum() > 0


def test_the_sampled_walk_draws_from_the_rows_softmax():
    ids = torch.arange(8).view(1, 2, 4)
    scores = torch.zeros(1, 2, 4, 4)
    scores[0, 0, :, 1] = 50.0  # slot 0: candidate 1 for sure; then row 1 of slot 1: candidate 3
    scores[0, 1, 1, 3] = 50.0
    drafts, q = walk_sampled(ids, scores, 1.0, torch.Generator().manual_seed(0))
    assert drafts.tolist() == [[1, 7]] and torch.allclose(q[0, 0, 1], torch.tensor(1.0))
    assert walk_greedy(ids, scores).tolist() == [[1, 7]]


# -- a run: trains, resumes bit-exact, exports, decodes losslessly ------------------------------------

STEPS = 6
SETTINGS = dict(max_steps=STEPS, epochs=2, grad_accum=1, seed=3, save_interval=2, num_workers=0, eval_fraction=0.0,
                compile=False, drafter_type="lilicorr", lilicorr_candidate_topk=4, lilicorr_num_layers=1,
                lilicorr_num_heads=4, lilicorr_factor_dim=8)


def test_a_lilicorr_run_trains_resumes_bit_exact_exports_and_decodes_losslessly(tiny_world, tmp_path, monkeypatch):
    from dflash.eval.speculative import (
        DecodeConfig,
        DrafterProposer,
        speculative_generate,
        target_generate,
    )
    from dflash.train.heads.lilicorr import training
    from transformers import AutoModelForCausalLM

    world = tiny_world
    whole = train(tiny_train_config(world["cache"], world["target"], tmp_path / "whole", **SETTINGS))
    assert whole.exit_status == 0 and whole.step == STEPS
    weights = final_weights(tmp_path / "whole")
    fresh = DFlashDrafter.from_target(world["target"], num_hidden_layers=1, block_size=4, target_layer_ids=[1, 2],
                                      **{k: v for k, v in SETTINGS.items() if k.startswith(("lilicorr", "drafter"))})
    assert any(not torch.equal(weights[n], p.detach().float()) for n, p in fresh.lilicorr.named_parameters(
        prefix="lilicorr") if n in weights and "bias" not in n), "the correlator did not train"

    # stopped (SIGINT) during step 3, then resumed: the same weights, bit for bit
    calls = {"n": 0}
    original = training.lattice_objective

    def stopping(inputs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the run finishes this step, checkpoints and stops
        return original(inputs)

    monkeypatch.setattr(training, "lattice_objective", stopping)
    stopped = train(tiny_train_config(world["cache"], world["target"], tmp_path / "resumed", **SETTINGS))
    assert stopped.exit_status != 0 and stopped.step == 3
    monkeypatch.setattr(training, "lattice_objective", original)
    resumed = train(tiny_train_config(world["cache"], world["target"], tmp_path / "resumed", **SETTINGS))
    assert resumed.exit_status == 0 and resumed.step == STEPS
    assert_same_weights(final_weights(tmp_path / "resumed"), weights)

    # the export is LiLiCorr's and decodes, greedy and sampled, to the target's own output
    config = json.loads((whole.final_dir / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    drafter = load_drafter(whole.final_dir, world["target"])
    proposer = DrafterProposer(drafter, 4)
    assert proposer.walk is not None and proposer.walk.context is proposer.context  # the anchor's context is read
    target = AutoModelForCausalLM.from_pretrained(str(world["target"]), dtype=torch.float32).eval()
    prompts = [[5, 9, 13, 2, 7], [11, 3, 3, 8, 20, 4, 1]]
    for decode in (DecodeConfig(max_new_tokens=12), DecodeConfig(max_new_tokens=12, block_size=3)):  # greedy
        drafted = speculative_generate(target, drafter, prompts, decode)
        assert [g.tokens for g in drafted] == [g.tokens for g in target_generate(target, prompts, decode)]
    # sampled (T = 1, the walk sampled): the second output token, the first a draft can decide, follows
    # the target's own distribution, computed exactly here
    prompt, n = prompts[0], 500
    with torch.no_grad():
        first = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        rows = torch.tensor([prompt + [t] for t in range(first.shape[0])])
        second = (first[:, None] * torch.softmax(target(input_ids=rows).logits[:, -1], -1)).sum(0)
    gens = speculative_generate(target, drafter, [prompt] * n, DecodeConfig(max_new_tokens=3, temperature=1.0, seed=5))
    drawn = torch.bincount(torch.tensor([g.tokens[1] for g in gens]), minlength=second.shape[0]).double() / n
    tolerance = 4 * (second * (1 - second) / n).sqrt() + 0.005  # ~4 standard errors per token
    assert ((drawn - second.double()).abs() <= tolerance.double()).all()
