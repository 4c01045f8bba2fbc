"""DSpark (--drafter-type dspark): the DFlash backbone plus a Markov head and a confidence head.

What vLLM 0.34.0 and SGLang 0.5.23 read from a DSpark drafter is written down here as facts
(ENGINE_FACTS) and an export of a tiny drafter is checked against them both ways: our export has
exactly the tensors and keys the loaders take, and our reader takes a checkpoint in the engines'
layout. The head trains from the same caches, resumes bit-exact after a stop, exports, decodes
losslessly greedy and sampled, and dflash-eval's confidence stop drafts fewer tokens a cycle and
stays lossless.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from conftest import assert_same_weights, final_weights, tiny_train_config
from dflash.eval.speculative import (
    DecodeConfig,
    NoConfidenceError,
    speculative_generate,
    target_generate,
)
from dflash.train import heads
from dflash.train.exports.export import export_drafter, load_drafter
from dflash.train.heads.base import HeadInputs
from dflash.train.heads.dspark.modules import dspark_objective
from dflash.train.run.loop import train
from safetensors import safe_open
from safetensors.torch import save_file
from test_drafter_export import expected_weight_names
from test_drafter_support import HIDDEN, VOCAB, save_tiny_target, tiny_config
from test_drafter_support import tiny_drafter as random_drafter
from test_eval_support import PERIOD, periodic_ids, tiny_drafter, tiny_target

RANK = 8

# -- the engines' contract, as read from their code ------------------------------------------------

ENGINE_FACTS = {
    # vLLM model_executor/models/registry.py: "Qwen3DSparkModel" -> qwen3_dspark.Qwen3DSparkForCausalLM;
    # SGLang srt/models/dspark.py: EntryClass holds Qwen3DSparkModel
    "architecture": "Qwen3DSparkModel",
    # read with getattr(config, name) at the config's top level by vLLM Qwen3DSparkModel.__init__ and
    # SGLang build_markov_head / build_confidence_head (vLLM: dflash_config first for the Omni check)
    "top_level_keys": {"markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                       "sample_from_anchor"},
    # vLLM load_weights prefixes "model." to every name but lm_head/d2t/t2d; SGLang load_weights
    # routes names starting "markov_head." and "confidence_head." to the heads, the rest to DFlash's
    "tensors": lambda v, d, r, conf_in: {
        "markov_head.markov_w1.weight": (v, r),  # nn.Embedding(vocab_size, markov_rank)
        "markov_head.markov_w2.weight": (v, r),  # ParallelLMHead(draft_vocab_size, r) / nn.Linear(r, V)
        **({"confidence_head.proj.weight": (1, conf_in),  # Linear(hidden (+ r), 1, bias=True), float32
            "confidence_head.proj.bias": (1,)} if conf_in else {}),
    },
    # the mask ids a DSpark loader takes, in vLLM's order (config/speculative.py)
    "mask_id_keys": ("dflash_config.mask_token_id", "mask_token_id", "dspark_noise_token_id"),
    # SGLang 0.5.23 builds a confidence head whatever enable_confidence_head says (unless ragged verify
    # is static) and refuses a checkpoint missing its weights; vLLM defaults both flags to False
    "sglang_needs_confidence_weights": True,
}


def dspark_export(tmp_path, *, confidence=True, with_markov=True):
    target = save_tiny_target(tmp_path / "target")
    torch.manual_seed(0)
    from dflash.train.model.drafter import DFlashDrafter

    drafter = DFlashDrafter.from_target(
        target, drafter_type="dspark", num_hidden_layers=2, target_layer_ids=[1, 5], block_size=4,
        mask_token_id=7, attention_backend="sdpa", markov_rank=RANK, enable_confidence_head=confidence,
        confidence_head_with_markov=with_markov)
    with torch.no_grad():  # a head away from its zero start, so the round trip shows
        for name, p in drafter.named_parameters():
            if name.startswith(("markov_head.", "confidence_head.")):
                p.add_(torch.randn_like(p))
    return target, drafter, export_drafter(drafter, tmp_path / "export", dtype=torch.float32)


@pytest.mark.parametrize("confidence,with_markov", [(True, True), (True, False), (False, False)])
def test_an_export_holds_exactly_what_the_engines_load(tmp_path, confidence, with_markov):
    target, drafter, out = dspark_export(tmp_path, confidence=confidence, with_markov=with_markov)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ENGINE_FACTS["architecture"]]
    for key in ENGINE_FACTS["top_level_keys"]:
        assert key in config and config[key] == config["dflash_config"][key], key
    assert config["markov_rank"] == RANK and config["markov_head_type"] == "vanilla"
    assert config["enable_confidence_head"] is confidence and config["confidence_head_with_markov"] is with_markov
    assert config["sample_from_anchor"] is False  # slot k drafts the token at anchor + k, as DFlash
    assert config["dflash_config"]["mask_token_id"] == 7 == config["dspark_noise_token_id"]
    conf_in = (HIDDEN + (RANK if with_markov else 0)) if confidence else 0
    want = ENGINE_FACTS["tensors"](VOCAB, HIDDEN, RANK, conf_in)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == expected_weight_names(2) | set(want)
        assert {k: tuple(f.get_slice(k).get_shape()) for k in want} == want
    reloaded = load_drafter(out, target, attention_backend="sdpa")
    assert reloaded.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_a_checkpoint_in_the_engines_layout_loads(tmp_path):
    """Keys at the config's top level only, the mask id as dspark_noise_token_id."""
    target, drafter, out = dspark_export(tmp_path)
    config = json.loads((out / "config.json").read_text())
    for key in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                "sample_from_anchor", "dspark_noise_token_id", "mask_token_id"):
        config["dflash_config"].pop(key)
    config.pop("mask_token_id", None)
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "config.json").write_text(json.dumps(config))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(engines / "model.safetensors"))  # noqa: SIM118
    reloaded = load_drafter(engines, target)
    assert reloaded.config.mask_token_id == 7 and reloaded.config.markov_rank == RANK
    assert torch.equal(reloaded.markov_head.markov_w2.weight, drafter.markov_head.markov_w2.weight)
    assert torch.equal(reloaded.confidence_head.proj.weight, drafter.confidence_head.proj.weight)


@pytest.mark.parametrize("edit,code", [
    ({"sample_from_anchor": True}, "train.sample-from-anchor"),
    ({"markov_head_type": "gated"}, "train.markov-head-type"),
    ({"draft_vocab_size": VOCAB // 2}, "train.draft-vocab-size"),
])
def test_a_layout_this_trainer_cannot_decode_is_refused_by_its_key(tmp_path, edit, code):
    target, _, out = dspark_export(tmp_path)
    config = json.loads((out / "config.json").read_text())
    config.update(edit)
    config["dflash_config"].update(edit)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        load_drafter(out, target)
    assert refused.value.code == code and refused.value.fields["value"] == next(iter(edit.values()))


@pytest.mark.parametrize("bad,code", [({"draft_vocab_size": VOCAB // 2}, "train.draft-vocab-size"),
                                      ({"markov_rank": 0}, "train.markov-rank")])
def test_a_drafter_dspark_cannot_build_is_refused_by_its_flag(bad, code):
    with pytest.raises(ValueError) as refused:
        tiny_config(drafter_type="dspark", **bad)
    assert refused.value.code == code and refused.value.fields["value"] == next(iter(bad.values()))


def test_a_negative_loss_weight_is_refused_by_its_flag(tiny_world, tmp_path):
    from dflash.train.config import TrainConfigError

    with pytest.raises(TrainConfigError) as refused:
        tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "run", drafter_type="dspark",
                          confidence_loss_weight=-1.0)
    assert refused.value.code == "train.setting-range"
    assert (refused.value.fields["flag"], refused.value.fields["value"]) == ("--confidence-loss-weight", -1.0)


# -- the loss ------------------------------------------------------------------------------------


def test_the_loss_trains_the_biased_logits_toward_the_cache_soft_labels(tmp_path):
    """(1 - w) CE + w KL of the Markov-biased logits to the target's top-k, and the confidence head's
    cross-entropy toward the acceptance sum_v min(q_v, p_v), computed here by hand."""
    torch.manual_seed(0)
    drafter = random_drafter(drafter_type="dspark", markov_rank=RANK)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_()
        drafter.confidence_head.proj.weight.normal_(std=0.1)
    n, k, w = 6, 4, 0.5
    g = torch.Generator().manual_seed(1)
    states = torch.randn(n, HIDDEN, generator=g)
    input_ids = torch.randint(0, VOCAB, (1, n + 1), generator=g)
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    soft_ids = torch.randint(0, VOCAB, (n, k), generator=g)
    soft_lp = torch.log_softmax(torch.randn(n, k, generator=g), -1)
    rows = (torch.zeros(n, dtype=torch.long), torch.arange(n))
    weights = torch.ones(n)
    inputs = HeadInputs(drafter=drafter, states=states, labels=labels, weights=weights, input_ids=input_ids, rows=rows,
                        top_ids=None, gather_logits=None,
                        soft_labels={"soft_ids": soft_ids, "soft_logprobs": soft_lp})
    loss, logged, choice = dspark_objective(inputs, markov_weight=1.0, tv_weight=0.0, confidence_weight=1.0,
                                            soft_weight=w)
    prev = input_ids[0, :n]
    emb = drafter.markov_head.markov_w1.weight[prev]
    z = states @ drafter.lm_head_weight.T + emb @ drafter.markov_head.markov_w2.weight.T
    lp = torch.log_softmax(z, -1)
    ce = -lp.gather(1, labels[:, None]).squeeze(1)
    kl = (soft_lp.exp() * (soft_lp - lp.gather(1, soft_ids))).sum(-1)
    markov = ((1 - w) * ce + w * kl).mean()
    accept = torch.minimum(soft_lp.exp(), lp.gather(1, soft_ids).exp()).sum(-1)
    conf = drafter.confidence_head.proj(torch.cat([states, emb], -1)).squeeze(-1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, accept)
    torch.testing.assert_close(logged, markov.detach())
    torch.testing.assert_close(loss, markov + bce)
    assert torch.equal(choice, z.argmax(-1))
    without = HeadInputs(**{**inputs.__dict__, "soft_labels": {}})
    assert not torch.allclose(dspark_objective(without, markov_weight=1.0, tv_weight=0.0, confidence_weight=0.0,
                                               soft_weight=0.0)[1], markov.detach())


# -- trained, resumed, exported, decoded -------------------------------------------------------------

STEPS = 6
SETTINGS = dict(max_steps=STEPS, epochs=2, grad_accum=1, seed=3, save_interval=2, num_workers=0, eval_fraction=0.0,
                compile=False, drafter_type="dspark", markov_rank=RANK)


def test_dspark_trains_resumes_bit_exact_exports_and_decodes_losslessly(tiny_world, tmp_path, monkeypatch):
    from dflash.eval.config import EvalConfig
    from dflash.eval.run import run_eval
    from transformers import AutoModelForCausalLM

    world = tiny_world
    whole = train(tiny_train_config(world["cache"], world["target"], tmp_path / "whole", **SETTINGS))
    assert whole.exit_status == 0 and whole.step == STEPS
    weights = final_weights(tmp_path / "whole")
    assert weights["markov_head.markov_w2.weight"].abs().sum() > 0  # the bias trained from its zero start
    assert weights["confidence_head.proj.weight"].abs().sum() > 0

    head, calls = heads.get_head("dspark"), []
    objective = head.objective

    def stop_in_step_3(inputs, config):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the run finishes this step, checkpoints and stops
        return objective(inputs, config)

    monkeypatch.setattr(head, "objective", stop_in_step_3)
    stopped = train(tiny_train_config(world["cache"], world["target"], tmp_path / "resumed", **SETTINGS))
    assert stopped.exit_status != 0 and stopped.step == 3
    monkeypatch.undo()
    resumed = train(tiny_train_config(world["cache"], world["target"], tmp_path / "resumed", **SETTINGS))
    assert resumed.exit_status == 0 and resumed.step == STEPS
    assert_same_weights(final_weights(tmp_path / "resumed"), weights)

    drafter = load_drafter(whole.final_dir, world["target"])
    assert drafter.head is head and drafter.config.markov_rank == RANK
    target = AutoModelForCausalLM.from_pretrained(str(world["target"]), dtype=torch.float32).eval()
    prompts = [[5, 9, 13, 2, 7], [11, 3, 3, 8, 20, 4, 1]]
    decode = DecodeConfig(max_new_tokens=12)
    assert ([g.tokens for g in speculative_generate(target, drafter, prompts, decode)]
            == [g.tokens for g in target_generate(target, prompts, decode)])

    # dflash-eval's confidence stop: reported beside the whole block, lossless
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    report = run_eval(EvalConfig(target_model=str(world["target"]), drafter=str(whole.final_dir),
                                 prompts=[str(prompt_file)], max_new_tokens=8, baseline=False, ignore_eos=True,
                                 confidence_threshold=0.3))
    result = report["prompt_sets"][0]
    stop = result["confidence_stop"]
    assert stop["threshold"] == 0.3 and stop["lossless"]["identical"] and result["lossless"]["identical"]
    assert 1 <= stop["drafted_per_cycle"] <= result["drafted_per_cycle"] == 3
    assert {"tau", "tau_vs_whole_block", "cycles"} <= set(stop)


# -- decoding a trained drafter on a trained target ----------------------------------------------------

NEW_TOKENS = 20
DSPARK = dict(drafter_type="dspark", markov_rank=16)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target, steps=150, **DSPARK)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    ids = periodic_ids(g, 3, 3 * PERIOD)
    return [ids[0, :7].tolist(), ids[1, :12].tolist(), ids[2, :PERIOD].tolist(),
            torch.randint(4, 32, (9,), generator=g).tolist()]


@pytest.mark.parametrize("threshold", [None, 0.0, 0.6, 1.0])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_dspark_decoding_is_the_target_output_with_or_without_a_confidence_stop(
        target, drafter, prompts, threshold, batch_size):
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    reference = [target_generate(target, [p], config)[0].tokens for p in prompts]
    stopped = DecodeConfig(max_new_tokens=NEW_TOKENS, confidence_threshold=threshold)
    gens = []
    for i in range(0, len(prompts), batch_size):
        gens += speculative_generate(target, drafter, prompts[i : i + batch_size], stopped)
    assert [g.tokens for g in gens] == reference
    drafted = [n for g in gens for n in g.drafted]
    assert all(1 <= n <= 3 for n in drafted)
    if threshold in (None, 0.0):
        assert set(drafted) == {3}  # the whole block
    if threshold == 1.0:
        assert set(drafted) == {1}  # never sure enough: one draft a cycle
    if threshold is None:
        assert sum(sum(g.acceptance_lengths) for g in gens) / len(drafted) > 2.0  # the trained pair accepts a lot


def test_a_confidence_threshold_for_a_drafter_without_confidence_is_refused(target, prompts):
    dflash = tiny_drafter(target, steps=0)
    with pytest.raises(NoConfidenceError) as refused:
        speculative_generate(target, dflash, prompts[:1], DecodeConfig(max_new_tokens=4, confidence_threshold=0.5))
    assert refused.value.code == "eval.drafter-without-confidence"
    assert refused.value.fields["flag"] == "--confidence-threshold"


def test_sampled_dspark_decoding_follows_the_target_distribution(target, drafter, prompts):
    """At T = 1 the Markov walk samples its drafts; the second output token (the first one a draft
    can decide) must still follow the target's own distribution, computed exactly here."""
    prompt, n = prompts[3], 600
    with torch.no_grad():
        first = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        rows = torch.tensor([prompt + [t] for t in range(first.shape[0])])
        second = (first[:, None] * torch.softmax(target(input_ids=rows).logits[:, -1], -1)).sum(0)
    config = DecodeConfig(max_new_tokens=3, temperature=1.0, seed=5)
    gens = speculative_generate(target, drafter, [prompt] * n, config)
    drawn = torch.bincount(torch.tensor([g.tokens[1] for g in gens]), minlength=second.shape[0]).double() / n
    tolerance = 4 * (second * (1 - second) / n).sqrt() + 0.005  # ~4 standard errors per token
    assert ((drawn - second.double()).abs() <= tolerance.double()).all()
    assert max(n for g in gens for n in g.acceptance_lengths) > 1  # the sampled drafts were accepted at times
