"""Anchors, loss weights and masking, noise and soft labels of the training objective."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from anchor_utils import loss_of
from conftest import block_metrics
from dflash.train.config import TrainConfigError
from dflash.train.loss.objective import (
    ObjectiveConfig,
    add_hidden_noise,
    compute_loss,
    default_gamma,
    position_weights,
    sample_anchors,
)
from dflash.train.measure.metrics import BlockMetrics, tau_from_accuracies
from dflash.train.model.attention import build_attention_mask
from test_drafter_support import HIDDEN, VOCAB, tiny_drafter

MASK = VOCAB - 1


def hand_batch():
    """Two sequences whose eligible anchors and scored slots are listed by hand below."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 100, (2, 8), generator=g)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]])
    return {
        "hidden": torch.randn(2, 8, 2 * HIDDEN, generator=g).to(torch.bfloat16),
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "lengths": torch.tensor([8, 5]),
    }


# anchor -> scored slots k=1..3 (block size 4), worked out from hand_batch:
HAND_ANCHORS = [
    {2: [1, 1, 0],  # targets 3, 4, 5: loss_mask[5] == 0 inside the block
     3: [1, 0, 1],  # targets 4, 5, 6: a zero in the middle, then scored again
     6: [1, 0, 0]},  # targets 7, 8, 9: the sequence ends after 7
    {0: [1, 1, 1], 1: [1, 1, 1], 2: [1, 1, 0],
     3: [1, 0, 0]},  # length 5: targets 4 only
]


def test_gamma_defaults_and_position_weights():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert default_gamma(4) == 3.0 and default_gamma(32) == 13.0
    w = position_weights(4, gamma=2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


def test_anchors_are_eligible_positions_drawn_deterministically():
    batch = hand_batch()
    anchors, valid = sample_anchors(batch["loss_mask"], batch["lengths"], max_anchors=64)
    assert [anchors[b][valid[b]].tolist() for b in range(2)] == [sorted(h) for h in HAND_ANCHORS]
    long_mask = torch.ones(3, 40)
    lengths = torch.tensor([40, 30, 3])
    draws = [sample_anchors(long_mask, lengths, 5, torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert torch.equal(draws[0][0], draws[1][0]) and not torch.equal(draws[0][0], draws[2][0])
    anchors, valid = draws[0]
    assert valid.sum(1).tolist() == [5, 5, 2]  # length 3 has only anchors 0 and 1
    assert bool((anchors[:2] + 1 < lengths[:2, None]).all())


def test_loss_is_the_weighted_mean_of_scored_slots_computed_by_hand():
    drafter = tiny_drafter()
    batch = hand_batch()
    gamma = 2.0
    out = loss_of(drafter, batch, ObjectiveConfig(max_anchors=64, gamma=gamma, loss_weighting="decay"))
    expected_valid = [[v for _, v in sorted(h.items())] for h in HAND_ANCHORS]
    assert out.valid[0, :3].int().tolist() == expected_valid[0]
    assert out.valid[1].int().tolist() == expected_valid[1]
    assert not out.valid[0, 3].any()  # padding anchor of the shorter list

    # Independent recomputation: one block at a time, built by hand, full dense attention
    # over the context before the anchor only.
    num, den = 0.0, 0.0
    for b, anchors in enumerate(HAND_ANCHORS):
        for p, scored in anchors.items():
            ids = torch.tensor([[batch["input_ids"][b, p].item(), MASK, MASK, MASK]])
            positions = torch.arange(p, p + 4)[None]
            hidden = batch["hidden"][b : b + 1, :p] if p > 0 else batch["hidden"][b : b + 1, :0]
            mask = build_attention_mask(torch.tensor([[p]]), hidden.shape[1], 4, "sdpa")
            with torch.no_grad():
                logits = drafter.logits(drafter(hidden, ids, positions, mask))[0]
            for k in (1, 2, 3):
                if scored[k - 1]:
                    w = math.exp(-(k - 1) / gamma)
                    ce = F.cross_entropy(logits[k][None], batch["input_ids"][b, p + k][None])
                    num, den = num + w * ce.item(), den + w
    assert out.loss.item() == pytest.approx(num / den, rel=1e-5)


def test_a_batch_without_anchors_gives_zero_loss_that_backpropagates():
    drafter = tiny_drafter()
    batch = hand_batch()
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    out = loss_of(drafter, batch, ObjectiveConfig())
    assert out.loss.item() == 0.0 and not out.valid.any()
    out.loss.backward()


def test_noise_follows_its_schedule_and_generator():
    hidden = torch.zeros(2, 50, 64)
    cfg = ObjectiveConfig(noise_type="uniform", noise_start=0.1, noise_end=0.02)
    assert cfg.noise_amplitude(0.0) == pytest.approx(0.1) and cfg.noise_amplitude(1.0) == pytest.approx(0.02)
    assert cfg.noise_amplitude(0.5) == pytest.approx(0.06) and cfg.noise_amplitude(7) == pytest.approx(0.02)
    noisy = add_hidden_noise(hidden, cfg, 0.5, torch.Generator().manual_seed(0))
    assert noisy.abs().max() <= 0.06 and noisy.abs().max() > 0.05
    again = add_hidden_noise(hidden, cfg, 0.5, torch.Generator().manual_seed(0))
    assert torch.equal(noisy, again) and hidden.abs().max() == 0  # input left untouched
    gauss = add_hidden_noise(hidden, ObjectiveConfig(noise_type="gaussian", noise_start=0.5), 0.3)
    assert gauss.std().item() == pytest.approx(0.5, rel=0.1)
    assert add_hidden_noise(hidden, ObjectiveConfig(), 0.5) is hidden
    with pytest.raises(TrainConfigError) as refused:
        ObjectiveConfig(noise_type="laplace")
    assert refused.value.code == "train.setting-choice"
    assert (refused.value.fields["flag"], refused.value.fields["value"]) == ("--noise-type", "laplace")


def test_soft_labels_shift_and_both_sources_agree():
    drafter = tiny_drafter()
    batch = hand_batch()
    ids = batch["input_ids"]
    # Top-1 "target" that puts all its mass on the real next token: KL then equals the CE,
    # which only holds if row t is used for the label at t + 1.
    one_hot = dict(batch, topk_ids=torch.roll(ids, -1, dims=1)[..., None], topk_logprobs=torch.zeros(2, 8, 1))
    out = loss_of(drafter, one_hot, ObjectiveConfig(max_anchors=64, soft_label_weight=1.0))
    assert out.kl.item() == pytest.approx(out.ce.item(), rel=1e-5)
    assert out.loss.item() == pytest.approx(out.kl.item(), rel=1e-5)

    # last_hidden (target norm + lm_head inside the drafter) == the same distribution as top-V.
    last_hidden = torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(5))
    norm_w = drafter.target_norm_weight
    normed = norm_w * last_hidden * torch.rsqrt(last_hidden.pow(2).mean(-1, keepdim=True) + 1e-5)
    target_logprobs = torch.log_softmax(normed @ drafter.lm_head_weight.T, dim=-1)
    full = dict(batch, topk_ids=torch.arange(VOCAB).expand(2, 8, VOCAB), topk_logprobs=target_logprobs)
    cfg = ObjectiveConfig(max_anchors=64, soft_label_weight=0.25)
    via_topk = loss_of(drafter, full, cfg)
    via_hidden = loss_of(drafter, dict(batch, last_hidden=last_hidden), cfg)
    assert via_topk.kl.item() == pytest.approx(via_hidden.kl.item(), rel=1e-4)
    assert via_hidden.loss.item() == pytest.approx(0.75 * via_hidden.ce.item() + 0.25 * via_hidden.kl.item(), rel=1e-5)
    with pytest.raises(ValueError, match="soft_label_weight"):
        loss_of(drafter, batch, cfg)


def test_metrics_count_leading_correct_slots_per_block():
    correct = torch.tensor([[[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]]], dtype=torch.bool)
    valid = torch.tensor([[[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0]]], dtype=torch.bool)
    m = block_metrics(correct, valid, loss=torch.tensor(2.0))
    # accepted: 2, 1, 0, 1 (the invalid slot ends the run) -> tau = 1 + 4/4
    assert m["tau"] == pytest.approx(2.0)
    assert (m["acc_1"], m["acc_2"], m["acc_3"]) == pytest.approx((3 / 4, 2 / 3, 2 / 3))
    assert m["tau_from_acc"] == pytest.approx(1 + 0.75 + 0.5 + 0.5 * 2 / 3)
    assert m["loss"] == 2.0 and m["blocks"] == 4.0
    running = BlockMetrics(block_size=4)
    running.update(correct[:, :2], valid[:, :2], 1.0)
    running.update(correct[:, 2:], valid[:, 2:], 3.0)
    assert running.compute() == pytest.approx(m)
    assert tau_from_accuracies([1.0, 1.0]) == 3.0


def test_the_loss_reads_the_anchors_the_loader_drew_and_draws_none_itself():
    """One producer of anchors (train/data/anchors.py, run by the loader): the loss refuses a batch
    without them, and the scored slots listed on the host (no device sync) are those of `valid`."""
    from dflash.train.data.anchors import add_anchors

    drafter = tiny_drafter()
    bs = drafter.config.block_size
    config = ObjectiveConfig(max_anchors=2)
    with pytest.raises(ValueError, match="anchor_positions"):
        compute_loss(drafter, hand_batch(), config)
    batch = add_anchors(hand_batch(), config.max_anchors, bs, torch.Generator().manual_seed(5))
    listed = compute_loss(drafter, batch, config)
    assert torch.equal(batch["scored_slots"], torch.stack(listed.valid.nonzero(as_tuple=True)))
    unlisted = compute_loss(drafter, {k: v for k, v in batch.items() if k != "scored_slots"}, config)
    assert torch.equal(listed.anchor_positions, batch["anchor_positions"])
    assert torch.equal(listed.loss, unlisted.loss) and torch.equal(listed.correct, unlisted.correct)
    other = add_anchors(hand_batch(), config.max_anchors, bs, torch.Generator().manual_seed(6))
    assert not torch.equal(compute_loss(drafter, other, config).anchor_positions, listed.anchor_positions)


def test_the_head_over_chunks_of_rows_gives_all_at_onces_log_probs_gradients_and_argmax():
    # A micro-batch of many short samples scores N slots x V ids of logits (over 200 GiB at 152K
    # ids with their backward); slot_losses holds one chunk of rows at a time. Same log-probs of
    # the labels, same gradients of the states, same argmax as autograd over all of them at once,
    # whatever the chunk.
    from dflash.train.loss.head_loss import candidate_logits, chunk_rows, needs_chunks, slot_losses

    drafter = tiny_drafter(seed=3).train()
    h = torch.randn(13, HIDDEN, requires_grad=True)
    label = torch.randint(0, VOCAB, (13,))
    g = torch.randn(13)
    logprobs = torch.log_softmax(drafter.logits(h).float(), dim=-1)
    want = logprobs.gather(1, label[:, None]).squeeze(1)
    (want * g).sum().backward()
    want_grad = h.grad.clone()
    ids = torch.randint(0, VOCAB, (13, 5))
    gc = torch.randn(13, 5)
    h.grad = None
    (drafter.logits(h).gather(-1, ids) * gc).sum().backward()
    want_cand_grad = h.grad.clone()
    for rows in (1, 4, 7, 13, 50):
        h.grad = None
        loss, got, _, top1, top3 = slot_losses(drafter, h, label, rows, top_k=3)
        (-loss * g).sum().backward()
        assert torch.allclose(got, want, atol=1e-5) and torch.allclose(-loss, want, atol=1e-5)
        assert torch.equal(top1, logprobs.argmax(-1))
        assert torch.equal(top3, torch.topk(logprobs, 3, dim=-1).indices)
        assert torch.allclose(h.grad, want_grad, atol=1e-5)
        h.grad = None
        cand = candidate_logits(drafter, h, ids, rows)
        (cand * gc).sum().backward()
        assert torch.allclose(cand, drafter.logits(h).gather(-1, ids), atol=1e-5)
        assert torch.allclose(h.grad, want_cand_grad, atol=1e-5)
    assert chunk_rows(VOCAB, 1) == (1 << 20) // (4 * VOCAB)
    assert needs_chunks(chunk_rows(152_000, 1024) + 1, 152_000, 1024) and not needs_chunks(10**9, 152_000, 0)


DFLASH2 = dict(drafter_type="dflash2", conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)


def soft_label_batch(kind: str) -> dict:
    """hand_batch with the target's top-3 or its last hidden states as soft labels."""
    batch = hand_batch()
    g = torch.Generator().manual_seed(9)
    if kind == "topk":
        ids = torch.stack([torch.randperm(VOCAB, generator=g)[:3] for _ in range(16)]).view(2, 8, 3)
        return dict(batch, topk_ids=ids, topk_logprobs=torch.randn(2, 8, 3, generator=g))
    return dict(batch, last_hidden=torch.randn(2, 8, HIDDEN, generator=g))


@pytest.mark.parametrize("weighting,kind,stop,soft", [
    ("acceptance", "dflash", False, None), ("decay", "dflash", False, None),
    ("acceptance", "dflash2", False, None), ("acceptance", "dflash2", True, None),
    ("acceptance", "dflash", False, "topk"), ("decay", "dflash", False, "hidden"),
    ("acceptance", "dflash2", False, "topk")])
def test_compute_loss_over_chunks_matches_one_chunk(weighting, kind, stop, soft, monkeypatch):
    # The objective's own switch: with a chunk smaller than the batch's slots, loss, gradients
    # and predictions equal those of one chunk of all of them (DFlash2: the selector's top-K and
    # candidates' logits too, with and without its stop-gradient; soft labels from the cached
    # top-k or from the target's last hidden state: the KL too). The one chunk against autograd
    # over the whole logits: tests/test_head_loss_reference.py.
    import dflash.train.loss.objective as objective

    batch = hand_batch() if soft is None else soft_label_batch(soft)
    runs = []
    for rows in (None, 3):
        if rows is not None:
            monkeypatch.setattr(objective, "chunk_rows", lambda vocab, mib: 3)
            monkeypatch.setattr(objective, "needs_chunks", lambda n, vocab, mib: n > 3)
        drafter = tiny_drafter(seed=4, **(DFLASH2 if kind == "dflash2" else {})).train()
        cfg = ObjectiveConfig(max_anchors=64, loss_weighting=weighting, selector_stop_gradient=stop,
                              soft_label_weight=0.0 if soft is None else 0.4)
        out = loss_of(drafter, batch, cfg, generator=torch.Generator().manual_seed(5))
        out.loss.backward()
        runs.append((out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}))
    (one, one_grads), (chunked, chunked_grads) = runs
    assert torch.allclose(one.loss, chunked.loss, atol=1e-6)
    assert torch.equal(one.predicted, chunked.predicted) and torch.equal(one.correct, chunked.correct)
    if soft is not None:
        assert torch.allclose(one.kl, chunked.kl, atol=1e-6) and torch.allclose(one.ce, chunked.ce, atol=1e-6)
    if kind == "dflash2":
        assert torch.allclose(one.selector_loss, chunked.selector_loss, atol=1e-6)
        assert torch.equal(one.backbone_predicted, chunked.backbone_predicted)
    assert one_grads.keys() == chunked_grads.keys() and one_grads
    for name in one_grads:
        assert torch.allclose(one_grads[name], chunked_grads[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_target_label_trains_toward_the_targets_top1_and_is_the_sample_on_a_greedy_completion(kind):
    """--hard-label target: each scored slot's label is the target's top-1 at its cache row. On a
    greedy completion (top-1 = the sample's next token) the objective is the sample label's, bit
    for bit; where the top-1 differs, the cross-entropy is the one toward the top-1 (the KL to a
    one-hot top-1, computed by the soft-label path), and `correct` is greedy verification's."""
    from dflash.train.measure.metrics import greedy_replay

    drafter = tiny_drafter(seed=4, **(DFLASH2 if kind == "dflash2" else {}))
    batch = hand_batch()
    nexts = torch.roll(batch["input_ids"], -1, dims=1)
    greedy = dict(batch, topk_ids=nexts[..., None], topk_logprobs=torch.zeros(2, 8, 1))
    other = (nexts + 1 + torch.arange(8) % 3) % 100  # never the sample's next token
    sampled = dict(batch, topk_ids=other[..., None], topk_logprobs=torch.zeros(2, 8, 1))

    def run(b, label, **kw):
        cfg = ObjectiveConfig(max_anchors=64, loss_weighting="decay", hard_label=label, **kw)
        return loss_of(drafter, b, cfg, generator=torch.Generator().manual_seed(5))

    a, b = run(greedy, "sample"), run(greedy, "target")
    assert torch.equal(a.loss, b.loss) and torch.equal(a.correct, b.correct)
    toward_top1, sample = run(sampled, "target"), run(sampled, "sample")
    kl_to_top1 = run(sampled, "sample", soft_label_weight=1.0)
    assert toward_top1.ce.item() == pytest.approx(kl_to_top1.kl.item(), rel=1e-5)
    assert toward_top1.ce.item() != pytest.approx(sample.ce.item(), rel=1e-3)
    # `correct` (the training tau's) is greedy verification's: the drafted token (DFlash2: the
    # selector's choice) against the target's top-1. A top-1 that agrees with some of the drafts
    # (the untrained drafter's own, one per cache row) makes those slots correct, and only them.
    top1 = other.clone()
    for (bi, ai, ki) in sample.valid.nonzero().tolist():
        row = int(sample.anchor_positions[bi, ai]) + ki
        if top1[bi, row] == other[bi, row]:
            top1[bi, row] = sample.predicted[bi, ai, ki]
    agreeing = dict(batch, topk_ids=top1[..., None], topk_logprobs=torch.zeros(2, 8, 1))
    out = run(agreeing, "target")
    assert out.correct.any() and torch.equal(out.correct, greedy_replay(out, agreeing).correct)
    if kind == "dflash2":  # the selector trains toward the top-1 as well
        assert toward_top1.selector_loss.item() != pytest.approx(sample.selector_loss.item(), rel=1e-3)
    with pytest.raises(ValueError, match="hard_label"):
        run(batch, "target")
    with pytest.raises(TrainConfigError) as refused:
        ObjectiveConfig(hard_label="argmax")
    assert refused.value.code == "train.setting-choice"
    assert (refused.value.fields["flag"], refused.value.fields["value"]) == ("--hard-label", "argmax")


def test_the_target_label_on_a_cache_without_the_targets_top1_is_refused_naming_the_cache_and_flag():
    from pathlib import Path
    from types import SimpleNamespace

    from dflash.runtime.errors import InputError
    from dflash.train.loss.objective import label_summary

    bare = SimpleNamespace(cache_dir=Path("runs/cache-a"), topk=0, top1=False, top1_share=0.0, store_last_hidden=False)
    with pytest.raises(InputError) as e:
        label_summary(ObjectiveConfig(hard_label="target"), bare)
    assert e.value.code == "train.hard-label-target-without-top1"
    assert e.value.fields == {"cache": "runs/cache-a", "flag": "--hard-label"}
    assert "hard labels" not in label_summary(ObjectiveConfig(hard_label="sample"), bare)
