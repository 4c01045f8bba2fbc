"""The target head's loss, one path for every micro-batch (train/loss/head_loss.py), computes what
autograd computes from the full logits: the slots' cross-entropy, the KL to soft labels (the
target's cached top-k, or its own head over its last hidden state), the gradient of the states
formed by hand, the argmax, DFlash2's top-K and its candidates' logits. The reference below is
written here, with autograd over `log_softmax` of the whole [N, V] logits, as a step would be
written without chunks; one chunk and several give its values within float32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from anchor_utils import loss_of
from dflash.train.loss import head_loss, objective
from dflash.train.loss.head_loss import candidate_logits, slot_losses
from dflash.train.loss.objective import ObjectiveConfig
from test_drafter_objective import DFLASH2, hand_batch, soft_label_batch
from test_drafter_support import tiny_drafter

VOCAB, HIDDEN, N = 2048, 32, 11  # 2,048 ids: the top-4 is taken in two stages (segments of 128)


class Head:
    """A frozen head over h (its lm_head W) and a target head of its own over the last hidden states."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lm_head_weight = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5 * 4
        self.target_weight = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5 * 4

    def logits(self, h):
        return F.linear(h, self.lm_head_weight)

    def target_logits(self, last_hidden):
        return F.linear(last_hidden, self.target_weight)


def reference_slot_losses(head, h, label, rows_per_chunk, *, top_k=0, soft_weight=0.0, soft_ids=None,
                          soft_logprobs=None, soft_hidden=None, fused=False):
    """`slot_losses` by autograd over the whole logits (`rows_per_chunk` and `fused` unused)."""
    logits = head.logits(h)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    label_lp = logprobs.gather(1, label[:, None]).squeeze(1)
    loss, kl = -label_lp, torch.empty(0)
    if soft_weight:
        if soft_hidden is not None:
            target = torch.log_softmax(head.target_logits(soft_hidden).float(), dim=-1)
            kl = (target.exp() * (target - logprobs)).sum(-1)
        else:
            kl = (soft_logprobs.exp() * (soft_logprobs - logprobs.gather(1, soft_ids))).sum(-1)
        loss = (1 - soft_weight) * loss + soft_weight * kl
    top = torch.topk(logits.detach(), top_k, dim=-1).indices if top_k else torch.empty(len(h), 0, dtype=torch.long)
    return loss, label_lp.detach(), kl.detach(), logprobs.argmax(-1), top


def reference_candidate_logits(head, h, ids, rows_per_chunk):
    return head.logits(h).gather(-1, ids)


def _soft(kind: str, g: torch.Generator) -> dict:
    if kind == "topk":
        ids = torch.stack([torch.randperm(VOCAB, generator=g)[:5] for _ in range(N)])
        return {"soft_ids": ids, "soft_logprobs": torch.log_softmax(torch.randn(N, 5, generator=g), dim=-1)}
    if kind == "hidden":
        return {"soft_hidden": torch.randn(N, HIDDEN, generator=g)}
    return {}


@pytest.mark.parametrize("soft,weight", [(None, 0.0), ("topk", 0.4), ("hidden", 0.4), ("topk", 1.0)])
def test_the_slots_losses_gradients_argmax_and_top_k_are_autograds_over_the_whole_logits(soft, weight):
    head, g = Head(), torch.Generator().manual_seed(1)
    h = torch.randn(N, HIDDEN, generator=g)
    label = torch.randint(0, VOCAB, (N,), generator=g)
    label[3] = torch.topk(head.logits(h[3]), 2).indices[1]  # a label among the top-K
    extra = _soft(soft, g) if soft else {}
    slot_weights = torch.rand(N, generator=g)  # what the objective's loss weights send back
    runs = []
    for fn, rows in ((reference_slot_losses, N), (slot_losses, N), (slot_losses, 4), (slot_losses, 1)):
        x = h.clone().requires_grad_()
        loss, label_lp, kl, argmax, top = fn(head, x, label, rows, top_k=4, soft_weight=weight, **extra)
        (slot_weights * loss).sum().backward()
        runs.append((loss.detach(), label_lp, kl, argmax, top, x.grad))
    (want_loss, want_lp, want_kl, want_argmax, want_top, want_grad), *got = runs
    assert want_grad.abs().max() > 1e-3  # the reference's gradient is not nothing
    for loss, label_lp, kl, argmax, top, grad in got:
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(label_lp, want_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kl, want_kl, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-6)
        assert torch.equal(argmax, want_argmax) and torch.equal(top, want_top)


def test_the_candidates_logits_and_their_gradient_are_the_gathered_full_logits():
    head, g = Head(), torch.Generator().manual_seed(2)
    h = torch.randn(N, HIDDEN, generator=g)
    ids = torch.randint(0, VOCAB, (N, 5), generator=g)
    upstream = torch.randn(N, 5, generator=g)
    runs = []
    for fn, rows in ((reference_candidate_logits, N), (candidate_logits, N), (candidate_logits, 3)):
        x = h.clone().requires_grad_()
        out = fn(head, x, ids, rows)
        (out * upstream).sum().backward()
        runs.append((out.detach(), x.grad))
    (want, want_grad), *got = runs
    for out, grad in got:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_the_logits_keep_their_dtype_and_the_references_values():
    # Autocast runs the head's matmul in bf16, on both paths: the same bf16 logits (one chunk),
    # the candidates' logits in bf16 as gathered from them, the losses in float32 and the states'
    # gradient in their own dtype, within bf16 rounding of the reference's.
    head, g = Head(), torch.Generator().manual_seed(3)
    h = torch.randn(N, HIDDEN, generator=g)
    label = torch.randint(0, VOCAB, (N,), generator=g)
    ids = torch.randint(0, VOCAB, (N, 5), generator=g)
    runs = []
    for losses, cands in ((reference_slot_losses, reference_candidate_logits), (slot_losses, candidate_logits)):
        x = h.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, label_lp, _, argmax, top = losses(head, x, label, N, top_k=4)
            cand = cands(head, x, ids, N)
        (loss.sum() + cand.float().sum()).backward()
        runs.append((loss.detach(), label_lp, argmax, top, cand.detach(), x.grad))
    (want_loss, want_lp, want_argmax, want_top, want_cand, want_grad), (loss, label_lp, argmax, top, cand, grad) = runs
    assert loss.dtype == torch.float32 and cand.dtype == want_cand.dtype == torch.bfloat16 and grad.dtype == h.dtype
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(label_lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cand, want_cand, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad, want_grad, rtol=2e-2, atol=2e-2)
    assert torch.equal(argmax, want_argmax)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head.logits(h)  # bf16 ties: the same top-K values, the ids among the tied ones
    assert torch.equal(logits.gather(1, top), logits.gather(1, want_top))


@pytest.mark.parametrize("kind,weighting,stop,soft", [
    ("dflash", "acceptance", False, None), ("dflash", "decay", False, "topk"), ("dflash", "acceptance", False, "hidden"),
    ("dflash2", "acceptance", False, None), ("dflash2", "acceptance", True, None), ("dflash2", "decay", False, "topk"),
    ("dflash2", "acceptance", False, "hidden")])
def test_a_step_of_the_objective_is_the_autograd_references(kind, weighting, stop, soft, monkeypatch,
                                                           traced_kernels):
    # The whole objective (the drafter, the loss weights, DFlash2's selector over its top-K and the
    # candidates' logits) with the head's loss from head_loss.py, in one chunk and in chunks of 3
    # slots, the compiled kernels of a compiled drafter on CUDA (forced here on the CPU), and with the
    # reference's autograd in its place: the same loss, KL, predictions, and gradients of every
    # trained weight.
    batch = hand_batch() if soft is None else soft_label_batch(soft)
    runs = []
    for mode in ("reference", "one chunk", "chunks", "compiled"):
        with monkeypatch.context() as m:
            if mode == "compiled":
                m.setattr(head_loss, "use_compiled", lambda drafter, h: True)
            if mode == "reference":
                m.setattr(objective, "slot_losses", reference_slot_losses)
                m.setattr(objective, "candidate_logits", reference_candidate_logits)
            elif mode == "chunks":
                m.setattr(objective, "chunk_rows", lambda vocab, mib: 3)
                m.setattr(objective, "needs_chunks", lambda n, vocab, mib: n > 3)
            drafter = tiny_drafter(seed=4, **(DFLASH2 if kind == "dflash2" else {})).train()
            cfg = ObjectiveConfig(max_anchors=64, loss_weighting=weighting, selector_stop_gradient=stop,
                                  soft_label_weight=0.0 if soft is None else 0.4)
            out = loss_of(drafter, batch, cfg, generator=torch.Generator().manual_seed(5))
            out.loss.backward()
        runs.append((out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}))
    (want, want_grads), *got = runs
    assert want_grads and any(gr.abs().max() > 0 for gr in want_grads.values())
    for out, grads in got:
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.ce, want.ce, rtol=1e-5, atol=1e-6)
        if soft is not None:
            torch.testing.assert_close(out.kl, want.kl, rtol=1e-5, atol=1e-6)
        assert torch.equal(out.predicted, want.predicted) and torch.equal(out.correct, want.correct)
        if kind == "dflash2":
            torch.testing.assert_close(out.selector_loss, want.selector_loss, rtol=1e-5, atol=1e-6)
            assert torch.equal(out.backbone_predicted, want.backbone_predicted)
        assert grads.keys() == want_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_no_limit_and_a_limit_the_slots_fit_run_the_head_in_one_chunk(monkeypatch):
    # --logits-chunk-mib keeps its meaning: 0 is no limit, and a micro-batch whose float32 logits
    # fit the limit (all of them here) runs in one chunk of all its slots.
    seen = []

    def recording(head, h, label, rows_per_chunk, **kw):
        seen.append((len(h), rows_per_chunk))
        return slot_losses(head, h, label, rows_per_chunk, **kw)

    monkeypatch.setattr(objective, "slot_losses", recording)
    drafter = tiny_drafter(seed=4)
    for mib in (0, 8192, 1):
        loss_of(drafter, hand_batch(), ObjectiveConfig(max_anchors=64, logits_chunk_mib=mib),
                generator=torch.Generator().manual_seed(5))
    assert len(seen) == 3 and all(rows == n > 1 for n, rows in seen)


def test_the_eager_chunk_frees_its_bf16_logits_once_their_float32_copy_exists(monkeypatch):
    # The eager chunk holds one float32 copy of its logits: the bf16 logits the head returned are
    # gone before the copy is turned into exponentials (else a chunk holds 2 bytes a logit more).
    import weakref

    made, freed = [], []

    class Bf16Head(Head):
        def logits(self, h):
            out = super().logits(h).bfloat16()
            made.append(weakref.ref(out))
            return out

    exp_ = torch.Tensor.exp_

    def watched(self):
        freed.append(all(ref() is None for ref in made))
        return exp_(self)

    monkeypatch.setattr(torch.Tensor, "exp_", watched)
    h = torch.randn(N, HIDDEN, requires_grad=True)
    slot_losses(Bf16Head(), h, torch.randint(0, VOCAB, (N,)), 4, top_k=4)
    assert freed == [True, True, True]  # 11 slots in chunks of 4
