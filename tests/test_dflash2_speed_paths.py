"""DFlash2's faster training step computes what the plain one did: the two-stage top-K gives
torch.topk's values (and its ids where no two values tie), and a run with it trains the weights
of one with torch.topk."""

from __future__ import annotations

import pytest
import torch
from anchor_utils import loss_of
from dflash.train.heads.dflash2 import modules as dflash2
from dflash.train.heads.dflash2.modules import exact_topk, topk_segment
from dflash.train.loss import head_loss
from dflash.train.loss.objective import ObjectiveConfig
from test_drafter_objective import hand_batch
from test_drafter_support import tiny_drafter

DFLASH2 = dict(drafter_type="dflash2", conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)


@pytest.mark.parametrize("vocab,k,segment", [(151_936, 16, None), (8192, 16, None), (4099, 16, 64), (1000, 7, 8),
                                             (512, 4, 16), (300, 16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_two_stage_top_k_gives_torch_topks_values_and_its_ids_where_nothing_ties(vocab, k, segment, dtype):
    g = torch.Generator().manual_seed(vocab + k)
    scores = (3 * torch.randn(2, 3, vocab, generator=g)).to(dtype)  # bf16: many ties among 152K values
    scores[0, 0] = float("-inf")  # a row with nothing above -inf, and one with a few values only
    scores[0, 1, 5:] = float("-inf")
    values, ids = exact_topk(scores, k, segment)
    want_values, want_ids = torch.topk(scores, k, dim=-1)
    assert torch.equal(values, want_values)
    assert torch.equal(scores.gather(-1, ids), values)  # each id holds its value ...
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # ... once
    # Where the k-th value is in the row once, the same ids; where no two of the k tie, in the same order.
    for index in torch.ones(scores.shape[:-1]).nonzero().tolist():
        row, top, at, want_at = scores[tuple(index)], values[tuple(index)], ids[tuple(index)], want_ids[tuple(index)]
        if (row == top[-1]).sum() == 1:
            assert torch.equal(at.sort().values, want_at.sort().values)
            if top.unique().numel() == k:
                assert torch.equal(at, want_at)


def test_the_segment_width_is_the_measured_one_and_short_rows_take_torch_topk():
    assert topk_segment(151_936, 16) == 256 and topk_segment(248_320, 16) == 256  # 593 / 970 segments
    assert topk_segment(8192, 16) == 128  # 64 segments, 2,048 candidates
    assert topk_segment(128, 4) == 0 and topk_segment(1000, 100) == 0 and topk_segment(4096, 16) == 0
    # with the maxima from the compiled head loss's own pass, only the second stage is left to pay for
    assert topk_segment(151_936, 16, maxima_given=True) == 128 and topk_segment(8192, 16, maxima_given=True) == 64
    assert topk_segment(2048, 16, maxima_given=True) == 0  # 32 segments: fewer than 4k
    row = torch.randn(1, 100)
    assert torch.equal(exact_topk(row, 3)[1], torch.topk(row, 3).indices)


def _torch_topk(scores, k, segment=None, maxima=None):
    return torch.topk(scores, k, dim=-1)


@pytest.mark.parametrize("stop", [False, True])
def test_a_dflash2_run_with_the_two_stage_top_k_trains_the_weights_of_one_with_torch_topk(stop, monkeypatch):
    # Three AdamW steps of a DFlash2 drafter with the two-stage top-K (segments of 8 ids, 16 of
    # them) and with torch.topk: the same losses and the same weights, bit for bit (float32 logits
    # hold no ties).
    batch = hand_batch()
    runs = []
    for fast in (True, False):
        if fast:
            monkeypatch.setattr(dflash2, "topk_segment", lambda vocab, k: 8)
        else:
            monkeypatch.setattr(head_loss, "exact_topk", _torch_topk)
        drafter = tiny_drafter(seed=4, **DFLASH2).train()
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
        cfg = ObjectiveConfig(max_anchors=64, selector_stop_gradient=stop)
        losses = []
        for step in range(3):
            out = loss_of(drafter, batch, cfg, generator=torch.Generator().manual_seed(step))
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append((out.loss.detach(), out.selector_loss, out.predicted))
        runs.append((losses, {n: p.detach().clone() for n, p in drafter.named_parameters()}))
    (fast_losses, fast_weights), (plain_losses, plain_weights) = runs
    for got, want in zip(fast_losses, plain_losses):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert fast_weights.keys() == plain_weights.keys()
    assert all(torch.equal(fast_weights[n], plain_weights[n]) for n in fast_weights)
    moved = tiny_drafter(seed=4, **DFLASH2).state_dict()
    assert any(not torch.equal(moved[n], fast_weights[n]) for n in fast_weights)  # the steps trained something


@pytest.mark.parametrize("weight", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_chunk_arithmetic_is_the_eager_chunks(weight, dtype):
    # head_loss.fused_chunk_terms (what runs compiled on CUDA) against the eager chunk: the loss,
    # log q(label), the KL, the argmax and d loss / d logits, and the top-k's segment maxima.
    g = torch.Generator().manual_seed(7)
    rows, vocab = 9, 3000
    logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
    label = torch.randint(0, vocab, (rows,), generator=g)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:8] for _ in range(rows)])
    ids[0, 0] = label[0]  # a soft id that is the label
    p_log = torch.log_softmax(torch.randn(rows, 8, generator=g), dim=-1)
    soft = (ids, p_log) if weight else (None, None)
    want = head_loss._chunk_terms(logits.clone(), label, weight, *soft, True, None, None)
    *got, maxima = head_loss.fused_chunk_terms(logits, label, weight, *soft, True, 128)
    # the top-k's segment maxima come with it: 23 whole segments of 128 ids (the last 56 ids are the tail)
    assert torch.equal(maxima, logits[:, :2944].view(rows, 23, 128).amax(-1))
    assert head_loss.fused_chunk_terms(logits, label, weight, *soft, True)[-1] is None
    assert all(torch.equal(a, b) for a, b in zip(exact_topk(logits, 4, 128, maxima), exact_topk(logits, 4, 128)))
    for a, b in zip(got[:3], want[:3]):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[3], want[3])
    assert got[4].dtype == dtype
    torch.testing.assert_close(got[4].float(), want[4].float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-6)
    assert want[4].float().abs().max() > 0.1  # the label's -1 (or the soft ids') is there


def test_gather_dot_is_the_gathered_rows_dot_products_and_their_gradients(traced_kernels):
    from dflash.train.heads.dflash2.kernels import gather_dot

    g = torch.Generator().manual_seed(8)
    x0, table0 = torch.randn(6, 5, generator=g), torch.randn(40, 5, generator=g)
    ids = torch.randint(0, 40, (6, 4), generator=g)
    ids[1] = ids[0]  # repeated rows: their table gradients add up
    ids[2, 1] = ids[2, 0]
    upstream = torch.randn(6, 4, generator=g)
    runs = []
    for fn in ("reference", "eager", "compiled"):
        x, table = x0.clone().requires_grad_(), table0.clone().requires_grad_()
        out = ((table[ids] * x[:, None]).sum(-1) if fn == "reference"
               else gather_dot(x, table, ids, compiled=fn == "compiled"))
        (out * upstream).sum().backward()
        runs.append((out.detach(), x.grad, table.grad))
    want, *got = runs
    for run in got:
        for a, b in zip(run, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)



def test_the_compiled_head_kernels_compile_once_for_steps_of_any_slot_count(traced_kernels):
    # A step's scored slots vary from batch to batch: the chunk function and the selector's three
    # gather-reductions each compile one graph, the slot count symbolic from the first call.
    from dflash.train.heads.dflash2.kernels import gather_dot
    from torch._dynamo.utils import counters

    counters.clear()
    table = torch.randn(50, 8, requires_grad=True)
    for n in (5, 7, 12):
        g = torch.Generator().manual_seed(n)
        x, ids = torch.randn(n, 8, generator=g, requires_grad=True), torch.randint(0, 50, (n, 4), generator=g)
        gather_dot(x, table, ids).sum().backward()
        logits, label = torch.randn(n, 300, generator=g), torch.randint(0, 300, (n,), generator=g)
        soft_ids = torch.randint(0, 300, (n, 8), generator=g)
        head_loss.compiled_chunk_terms()(logits, label, 0.5, soft_ids, torch.log_softmax(torch.randn(n, 8), -1), True, 16)
    assert counters["stats"]["unique_graphs"] == 4
