"""DFlash2: the in-block convolution (identity at init, zero across block boundaries), the
candidate selector (its walk and its loss), the objective with both, and the export's contract
with vLLM's and SGLang's DFlash2 loaders."""

from __future__ import annotations

import json

import pytest
import torch
from anchor_utils import loss_of
from dflash.train.exports.export import export_drafter, load_drafter
from dflash.train.heads.dflash2.modules import (
    CandidateSelector,
    GroupedDynamicConv,
    block_lattice,
    selector_objective,
    walk_greedy,
    walk_sampled,
)
from dflash.train.loss.objective import ObjectiveConfig
from dflash.train.model.drafter import DFlashDrafter
from safetensors import safe_open
from test_drafter_export import block_logits, expected_weight_names, sample_batch
from test_drafter_support import HIDDEN, VOCAB, save_tiny_target, tiny_drafter

THREE_LAYERS = dict(target_layer_ids=[1, 3, 5])  # sample_batch's hidden width
DFLASH2 = dict(THREE_LAYERS, drafter_type="dflash2", conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)


def test_a_fresh_dflash2_drafter_gives_exactly_the_dflash_logits_of_the_same_weights():
    dflash, dflash2 = tiny_drafter(seed=3, **THREE_LAYERS), tiny_drafter(seed=3, **DFLASH2)
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and missing and all("conv" in n or "candidate_selector" in n for n in missing)
    batch = sample_batch()
    assert torch.equal(block_logits(dflash, batch), block_logits(dflash2, batch))
    # ... and once the convolutions move, they do not.
    with torch.no_grad():
        dflash2.layers[0].attention_conv.kernel_projection.weight.normal_(std=0.1)
    assert not torch.allclose(block_logits(dflash, batch), block_logits(dflash2, batch))


def test_under_bf16_autocast_a_fresh_dflash2_drafter_still_gives_exactly_the_dflash_logits():
    # The convolutions compute in the activations' autocast dtype; at the identity that rounds
    # nothing the sublayers' own bf16 casts do not round already.
    dflash, dflash2 = tiny_drafter(seed=3, **THREE_LAYERS), tiny_drafter(seed=3, **DFLASH2)
    dflash2.load_state_dict(dflash.state_dict(), strict=False)
    batch = sample_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, convolved = block_logits(dflash, batch), block_logits(dflash2, batch)
    assert plain.dtype == torch.bfloat16 and torch.equal(plain, convolved)


def reference_conv(x, base, delta, block_size, group_size):
    """out[i, c] = sum_t (base[t, c] + delta[i, t, c // group_size]) * x[i - t, c], same block only."""
    out = torch.zeros_like(x)
    for i in range(x.shape[1]):
        for t in range(base.shape[0]):
            if i % block_size >= t:
                w = base[t] + delta[:, i, t].repeat_interleave(group_size, dim=-1)
                out[:, i] += w * x[:, i - t]
    return out


def test_the_convolution_follows_its_formula_and_never_crosses_a_block():
    torch.manual_seed(0)
    conv = GroupedDynamicConv(HIDDEN, taps=3, group_size=16)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.1)
    block, x = 4, torch.randn(2, 12, HIDDEN)
    y, delta = conv.prepare(x, block)
    both = conv.kernel_projection(x).view(2, 12, 2, 3, HIDDEN // 16)
    torch.testing.assert_close(delta, both[:, :, 1])
    torch.testing.assert_close(y, reference_conv(x, conv.base_kernel[0], both[:, :, 0], block, 16))
    z = torch.randn_like(x)
    torch.testing.assert_close(conv.finish(z, delta, block), reference_conv(z, conv.base_kernel[1], delta, block, 16))
    # A change in block 1 (tokens 4..7) moves nothing in blocks 0 and 2 of the output convolution.
    changed = z.clone()
    changed[:, 4:8] += 1.0
    moved = (conv.finish(changed, delta, block) - conv.finish(z, delta, block)).abs().amax(dim=(0, 2))
    assert moved[4:8].min() > 0 and moved[:4].max() == 0 and moved[8:].max() == 0


@pytest.mark.parametrize("length", [14, 2])
def test_the_convolution_has_the_gradients_of_its_formula_across_block_boundaries(length):
    """Its backward (written out, recomputing the shifted inputs) against autograd through the formula:
    three taps, blocks of 4 with a ragged last one (and a sequence shorter than the taps), in float64."""
    torch.manual_seed(1)
    conv = GroupedDynamicConv(HIDDEN, taps=3, group_size=16).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.1)
    block, x, z = 4, torch.randn(2, length, HIDDEN, dtype=torch.float64), torch.randn(2, length, HIDDEN, dtype=torch.float64)
    upstream = torch.randn(2, length, HIDDEN, dtype=torch.float64)

    def grads(forward):
        inputs = (x.clone().requires_grad_(), z.clone().requires_grad_())
        conv.zero_grad()
        (forward(*inputs) * upstream).sum().backward()
        return [t.grad.clone() for t in (*inputs, conv.base_kernel, conv.kernel_projection.weight)]

    def ours(x, z):
        y, delta = conv.prepare(x, block)
        return y * conv.finish(z, delta, block)

    def formula(x, z):
        both = conv.kernel_projection(x).view(2, length, 2, 3, HIDDEN // 16)
        return (reference_conv(x, conv.base_kernel[0], both[:, :, 0], block, 16)
                * reference_conv(z, conv.base_kernel[1], both[:, :, 1], block, 16))

    for got, want in zip(grads(ours), grads(formula)):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want)


def tiny_selector(seed: int = 0, top_k: int = 4) -> CandidateSelector:
    torch.manual_seed(seed)
    selector = CandidateSelector(HIDDEN, VOCAB, rank=8, top_k=top_k)
    with torch.no_grad():
        selector.hidden_projection.weight.normal_()
        selector.predecessor_codebook.normal_()
    return selector


def test_the_greedy_walk_takes_each_slots_best_successor_of_the_previous_choice():
    selector = tiny_selector()
    g = torch.Generator().manual_seed(1)
    states, logits = torch.randn(3, 5, HIDDEN, generator=g), torch.randn(3, 5, VOCAB, generator=g)
    anchors = torch.tensor([1, 2, 3])
    ids, scores = block_lattice(selector, states, logits, anchors, output_multiplier=0.5, softcap=3.0)
    tokens = walk_greedy(ids, scores)
    for b in range(3):  # the definition, one slot at a time: edge(p -> c) = <A[p] * proj(h), B[c]> + unary[c]
        previous = int(anchors[b])
        for slot in range(5):
            unary = torch.tanh(0.5 * logits[b, slot, ids[b, slot]] / 3.0) * 3.0
            h = selector.hidden_projection(states[b, slot])
            edges = unary + (selector.predecessor_codebook[previous] * h) @ selector.successor_codebook[ids[b, slot]].T
            previous = int(ids[b, slot, edges.argmax()])
            assert int(tokens[b, slot]) == previous
    assert set(ids[0, 0].tolist()) == set(logits[0, 0].topk(4).indices.tolist())


def test_the_sampled_walk_returns_q_over_the_candidates_and_draws_from_it():
    selector = tiny_selector()
    g = torch.Generator().manual_seed(2)
    states, logits = torch.randn(1, 3, HIDDEN, generator=g), torch.randn(1, 3, VOCAB, generator=g)
    ids, scores = block_lattice(selector, states, logits, torch.tensor([5]))
    draws = torch.stack([walk_sampled(ids, scores, 0.7, g)[0][0, 0] for _ in range(4000)])
    tokens, q = walk_sampled(ids, scores, 0.7, g)
    torch.testing.assert_close(q.sum(-1), torch.ones(1, 3))
    torch.testing.assert_close(q[0, 0], torch.softmax(scores[0, 0, 0] / 0.7, dim=-1))  # slot 0 follows the anchor
    frequency = torch.stack([(draws == t).float().mean() for t in ids[0, 0]])
    assert (frequency - q[0, 0]).abs().max() < 0.03
    previous = (ids[0, 0] == tokens[0, 0]).nonzero().item()
    torch.testing.assert_close(q[0, 1], torch.softmax(scores[0, 1, previous] / 0.7, dim=-1))
    with pytest.raises(ValueError, match="temperature"):
        walk_sampled(ids, scores, 0.0)


def test_the_selector_loss_puts_a_missed_label_among_the_candidates():
    selector = tiny_selector(top_k=4)
    g = torch.Generator().manual_seed(3)
    states, logits = torch.randn(2, HIDDEN, generator=g), torch.randn(2, VOCAB, generator=g)
    top = logits.topk(4).indices
    missed = next(t for t in range(VOCAB) if t not in top[1].tolist())
    labels = torch.tensor([int(top[0, 2]), missed])
    predecessors = torch.tensor([7, 9])
    loss, choice = selector_objective(selector, states, logits, predecessors, labels, torch.tensor([1.0, 0.0]))
    loss_missed, _ = selector_objective(selector, states, logits, predecessors, labels, torch.tensor([0.0, 1.0]))
    # Row 0: a 4-way CE over its top-4; row 1: over its top-3 and the label.
    edges = [selector(states[i], torch.cat([top[i, :3], labels[i:i + 1]]) if i else top[i],
                      logits[i, torch.cat([top[i, :3], labels[i:i + 1]]) if i else top[i]],
                      predecessors[i:i + 1])[0] for i in range(2)]
    torch.testing.assert_close(loss, -torch.log_softmax(edges[0], -1)[2])
    torch.testing.assert_close(loss_missed, -torch.log_softmax(edges[1], -1)[3])
    assert choice[1] in top[1] and choice[0] == top[0, selector(states[0], top[0], logits[0, top[0]],
                                                                 predecessors[:1])[0].argmax()]
    loss_missed.backward()
    assert selector.successor_codebook.grad[missed].abs().sum() > 0  # the label's row learns


def test_the_selector_loss_has_the_gradients_of_its_definition():
    # The definition, written plainly: top-K values with their gradient, the codebooks indexed.
    selector = tiny_selector(top_k=4)
    g = torch.Generator().manual_seed(4)
    states, logits = torch.randn(6, HIDDEN, generator=g), 2 * torch.randn(6, VOCAB, generator=g)
    top = logits.topk(4).indices
    labels = torch.tensor([int(top[0, 0]), int(top[1, 3]), 0, 1, 2, int(top[5, 1])])
    labels[2:5] = torch.tensor([next(t for t in range(VOCAB) if t not in top[i].tolist()) for i in range(2, 5)])
    predecessors, weights = torch.tensor([3, 3, 3, 5, 7, 3]), torch.rand(6, generator=g)

    def grads(loss_of):
        selector.zero_grad()
        x, z = states.clone().requires_grad_(), logits.clone().requires_grad_()
        loss_of(x, z).backward()
        return [x.grad, z.grad] + [p.grad for p in selector.parameters()]

    def definition(x, z):
        losses = []
        for i in range(6):
            values, ids = z[i].topk(4)
            if labels[i] not in ids:
                values, ids = torch.cat([values[:3], z[i, labels[i]][None]]), torch.cat([ids[:3], labels[i][None]])
            unary = torch.tanh(0.5 * values / 3.0) * 3.0
            h = selector.hidden_projection(x[i])
            edges = unary + (selector.predecessor_codebook[predecessors[i]] * h) @ selector.successor_codebook[ids].T
            losses.append(-torch.log_softmax(edges, -1)[(ids == labels[i]).nonzero().item()])
        return (weights * torch.stack(losses)).sum() / weights.sum()

    fast = grads(lambda x, z: selector_objective(selector, x, z, predecessors, labels, weights,
                                                 output_multiplier=0.5, softcap=3.0)[0])
    for got, expected in zip(fast, grads(definition)):
        torch.testing.assert_close(got, expected)
    assert (fast[1] != 0).sum(-1).max() <= 5  # the logits' gradient: the K candidates and the label only


def test_the_objective_adds_the_weighted_selector_loss_and_can_stop_its_gradient():
    batch = sample_batch()

    def run(weight, stop=False):
        drafter = tiny_drafter(seed=5, **DFLASH2).train()
        out = loss_of(drafter, batch, ObjectiveConfig(max_anchors=8, selector_loss_weight=weight,
                                                           selector_stop_gradient=stop),
                           generator=torch.Generator().manual_seed(0))
        out.loss.backward()
        return out, drafter

    plain, plain_model = run(0.0)
    weighted, weighted_model = run(0.5)
    stopped, stopped_model = run(0.5, stop=True)
    torch.testing.assert_close(weighted.loss, plain.loss + 0.5 * weighted.selector_loss)
    assert torch.equal(weighted.backbone_predicted, plain.backbone_predicted)
    assert torch.equal(weighted.predicted[~weighted.valid], torch.full_like(weighted.predicted[~weighted.valid], -1))
    fc = "fc.weight"
    grads = {n: dict(m.named_parameters())[fc].grad for n, m in
             (("plain", plain_model), ("weighted", weighted_model), ("stopped", stopped_model))}
    assert not torch.allclose(grads["plain"], grads["weighted"])  # the selector's loss reaches the backbone
    torch.testing.assert_close(grads["plain"], grads["stopped"])  # ... unless its gradient is stopped
    # The selector learns either way (at init its projection is 0, so that alone has a gradient).
    assert stopped_model.candidate_selector.hidden_projection.weight.grad.abs().sum() > 0


# -- the export's contract with the engines ---------------------------------------------------

# What the engines' DFlash2 loaders read, as written in their code (facts, not their code):
# vllm-project/vllm vllm/model_executor/models/qwen3_dflash2.py: per layer DFlashGroupedConv
# `attention_conv` and `mlp_conv`, each `base_kernel` [2, taps, hidden] and `kernel_projection`
# (a linear: weight [2 * taps * (hidden / conv_group_size), hidden]); `candidate_selector`
# with `predecessor_codebook` / `successor_codebook` [vocab, selector_rank] and
# `hidden_projection` (weight [selector_rank, hidden]). dflash_config: `conv_kernel_size`,
# `conv_group_size`, `selector_rank`, `selector_top_k` indexed (required);
# `input_embedding_scale`, `output_multiplier`, `final_logit_softcapping` read with defaults.
# sgl-project/sglang python/sglang/srt/models/dflash.py: the same module names and shapes
# (DFlashGroupedConv per layer when dflash_config.conv_kernel_size is set; CandidateSelector
# with the two [vocab, rank] codebooks and a bias-free hidden_projection), `selector_rank`
# required, `selector_top_k`, `output_multiplier`, `final_logit_softcapping`; both take the rest
# of the checkpoint from their DFlash loaders (tests/test_drafter_export.py lists those names).
ENGINE_DFLASH2_CONFIG_KEYS = {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                              "input_embedding_scale", "output_multiplier", "final_logit_softcapping"}


def engine_dflash2_tensors(layers: int, hidden: int, vocab: int, taps: int, group: int,
                           rank: int) -> dict[str, tuple[int, ...]]:
    out = {"candidate_selector.predecessor_codebook": (vocab, rank),
           "candidate_selector.successor_codebook": (vocab, rank),
           "candidate_selector.hidden_projection.weight": (rank, hidden)}
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = (2, taps, hidden)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * (hidden // group), hidden)
    return out


def test_the_dflash2_export_holds_exactly_what_the_engines_load_and_reloads_identically(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    drafter = DFlashDrafter.from_target(target, num_hidden_layers=2, target_layer_ids=[1, 3, 5], block_size=4,
                                        attention_backend="sdpa", **{k: v for k, v in DFLASH2.items()
                                                                      if k != "target_layer_ids"})
    with torch.no_grad():  # move every DFlash2 tensor off its init, so a lost one shows
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.normal_(std=0.05)
    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert ENGINE_DFLASH2_CONFIG_KEYS <= set(config["dflash_config"])
    assert (config["dflash_config"]["conv_kernel_size"], config["dflash_config"]["selector_top_k"]) == (3, 4)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    expected = engine_dflash2_tensors(2, HIDDEN, VOCAB, taps=3, group=16, rank=8)
    names = expected_weight_names(2) | set(expected)
    assert not names - set(shapes), f"missing: {sorted(names - set(shapes))}"
    assert not set(shapes) - names, f"unexpected: {sorted(set(shapes) - names)}"
    assert {n: shapes[n] for n in expected} == expected
    reloaded = load_drafter(out, target, attention_backend="sdpa")
    assert reloaded.config.drafter_type == "dflash2" and reloaded.candidate_selector.top_k == 4
    batch = sample_batch()
    torch.testing.assert_close(block_logits(reloaded, batch), block_logits(drafter.eval(), batch), rtol=0, atol=0)


def test_a_dflash2_run_trains_reports_both_taus_and_exports_for_the_engines(tiny_world, tmp_path, capsys):
    from conftest import read_metrics, tiny_train_config
    from dflash.train.measure.estimate import estimate_drafter, format_estimate
    from dflash.train.run.loop import train

    out = tmp_path / "run"
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, max_steps=6, eval_fraction=0.3,
                                     drafter_type="dflash2", selector_rank=8, selector_top_k=4, conv_group_size=8))
    assert result.exit_status == 0
    held_out = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert held_out and all(1.0 <= r["tau_backbone"] <= 4.0 and 1.0 <= r["tau"] <= 4.0 for r in held_out)
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[eval step")]
    assert len(shown) == len(held_out)  # the console's eval line puts the backbone's tau beside the selector's
    assert all(f"backbone_tau={r['tau_backbone']:.4g}" in line for line, r in zip(shown, held_out))
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 4
    estimate = estimate_drafter(str(out / "final"), {"cache": [str(tiny_world["cache"])],
                                                     "target_model": str(tiny_world["target"]), "num_workers": 0})
    line = format_estimate(estimate)
    assert "backbone tau" in line
    # prompt lookup beside the estimate, on the same samples, with the drafter's multiple of it
    assert f"prompt lookup {estimate['tau_lookup']:.3f} on the same samples " \
           f"({estimate['tau'] / estimate['tau_lookup']:.2f}x)" in line
    assert all(f"lookup_tau={r['tau_lookup']:.4g}" in shown_line for shown_line, r in zip(shown, held_out))
    # (this cache stores no top-k log-probs: nothing said of the target's confidence)
    assert "confidence_heldout" not in estimate and "top-1 probability" not in line


def test_a_hidden_size_the_default_group_does_not_divide_is_refused_with_the_group_that_fits():
    from dflash.train.model.drafter_config import DrafterConfig
    from test_drafter_support import tiny_config

    with pytest.raises(ValueError) as refused:
        tiny_config(drafter_type="dflash2", hidden_size=40, num_attention_heads=2, num_key_value_heads=1, head_dim=20)
    assert refused.value.code == "train.conv-group-size"
    assert refused.value.fields == {"value": 16, "hidden_size": 40, "fits": 10}
    fitted = tiny_config(drafter_type="dflash2", hidden_size=40, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=20, conv_group_size=10)
    assert isinstance(fitted, DrafterConfig) and fitted.conv_group_size == 10


def test_a_vocabulary_smaller_than_the_default_top_k_is_refused_with_the_k_that_fits():
    from test_drafter_support import tiny_config

    with pytest.raises(ValueError) as refused:
        tiny_config(drafter_type="dflash2", vocab_size=8)
    assert refused.value.code == "train.selector-top-k" and refused.value.fields == {"value": 16, "vocab_size": 8}
    assert tiny_config(drafter_type="dflash2", vocab_size=8, selector_top_k=8).selector_top_k == 8
