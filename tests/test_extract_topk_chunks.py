"""The target's top-k log-probs reduced chunk by chunk (extract/target.py next_token_reducer):
the same ids, log-probs and top-1 as the float32 log_softmax of the whole vocabulary and its
topk of before (kept in bench/bench_topk.py as the reference), and an engine that keeps no last
hidden state it does not store."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.schema import (
    HIDDEN,
    LAST_HIDDEN,
    TOP1_IDS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    scale_of,
)
from dflash.extract.batching import Batch
from dflash.extract.engine import ExtractionEngine
from dflash.extract.target import LayerCapture, next_token_outputs, next_token_reducer
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def old_formula(logits: torch.Tensor, k: int, scale=None, softcap=None):
    z = logits.float()
    if scale is not None:
        z = z * scale
    if softcap is not None:
        z = (z / softcap).tanh() * softcap
    logprobs, ids = torch.log_softmax(z, dim=-1).topk(k, dim=-1)
    return logprobs, ids, z.argmax(dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("steps", [{}, {"scale": 0.25}, {"softcap": 5.0}, {"scale": 2.0, "softcap": 30.0}])
def test_the_chunk_reduction_gives_the_full_log_softmax_topk_and_argmax(dtype, steps):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(96, 3000, generator=gen)).to(dtype)
    logprobs, ids, top1 = next_token_reducer(8, True, **steps)(logits)
    ref_lp, ref_ids, ref_top1 = old_formula(logits, 8, **steps)
    assert torch.equal(ids, ref_ids) and torch.equal(top1, ref_top1)
    assert logprobs.dtype == torch.float32
    assert torch.equal(logprobs, ref_lp)  # eager: the same arithmetic, bit for bit (compiled: to rounding)


def test_tied_logits_come_out_as_the_full_log_softmax_put_them_and_the_top1_is_the_first_maximum():
    """bf16 logits tie often; equal logits have equal log-probs, and topk orders them the same
    whether it sorts the logits or their float32 log-probs. The top-1 stays the argmax (the first
    of tied maxima), which a tie can put after another id in the top-k."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 6, (200, 3000), generator=gen).to(torch.bfloat16)
    logprobs, ids, top1 = next_token_reducer(8, True)(logits)
    ref_lp, ref_ids, ref_top1 = old_formula(logits, 8)
    assert torch.equal(ids, ref_ids) and torch.equal(top1, ref_top1)
    torch.testing.assert_close(logprobs, ref_lp, rtol=0, atol=2e-5)
    assert not torch.equal(top1, ids[:, 0])  # ties at the maximum happen here, and the argmax keeps its own rule
    assert torch.equal(logits.float().gather(1, top1[:, None]), logits.float().gather(1, ids[:, :1]))


def tiny_target(dtype=torch.bfloat16, vocab: int = 70000, **extra):
    cfg = Qwen3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      intermediate_size=64, vocab_size=vocab, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


@pytest.mark.parametrize("vocab, top1", [(70000, "int32"), (500, "uint16")])
def test_next_token_outputs_in_row_chunks_equal_the_old_path_and_the_target_forward(vocab, top1):
    from bench_topk import old_next_token_outputs

    model = tiny_target(vocab=vocab)
    gen = torch.Generator().manual_seed(2)
    last = (4 * torch.randn(37, 32, generator=gen)).to(torch.bfloat16)
    new = next_token_outputs(model, last, topk=8, top1=top1, chunk_tokens=5)  # 8 chunks, the last of 2 rows
    old = old_next_token_outputs(model, last, topk=8, top1=top1)  # one chunk
    assert new[TOPK_IDS].dtype == old[TOPK_IDS].dtype == torch.int32
    assert torch.equal(new[TOPK_IDS], old[TOPK_IDS]) and torch.equal(new[TOP1_IDS], old[TOP1_IDS])
    assert new[TOP1_IDS].dtype == old[TOP1_IDS].dtype and new[TOP1_IDS].shape == (37, 1)
    torch.testing.assert_close(new[TOPK_LOGPROBS], old[TOPK_LOGPROBS], rtol=0, atol=2e-5)
    with torch.no_grad():  # and what the target's own forward gives for those states
        logits = model.lm_head(model.model.norm(last))
    lp, ids, _ = old_formula(logits, 8)
    assert torch.equal(new[TOPK_IDS].long(), ids)
    torch.testing.assert_close(new[TOPK_LOGPROBS], lp, rtol=0, atol=2e-5)
    # the top-1 alone (the --top1-share rows' head pass) is the same argmax
    alone = next_token_outputs(model, last, top1=top1, chunk_tokens=4)
    assert torch.equal(alone[TOP1_IDS], new[TOP1_IDS])
    if top1 == "uint16":  # ids travel as int16 of the same bits
        assert torch.equal(new[TOP1_IDS].view(torch.uint16).long(), logits.float().argmax(-1, keepdim=True))


def test_the_top1_alone_of_a_soft_capped_head_is_the_capped_argmax():
    model = tiny_target(vocab=300, final_logit_softcapping=0.5)  # (Qwen3 ignores it; post_head_steps reads it)
    last = (4 * torch.randn(9, 32, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    from bench_topk import old_next_token_outputs

    for kw in ({"top1": "uint16"}, {"topk": 4, "top1": "uint16"}):
        new, old = next_token_outputs(model, last, **kw), old_next_token_outputs(model, last, **kw)
        assert new.keys() == old.keys()
        for name in new:
            torch.testing.assert_close(new[name], old[name], rtol=0, atol=2e-5)


def one_batch(lengths: list[int]) -> Batch:
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    gather = []
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, 400, (n,), generator=torch.Generator().manual_seed(row))
        gather += [row * width + t for t in range(n)]
    return Batch(members=list(range(len(lengths))), input_ids=ids, gather_index=torch.tensor(gather),
                 lengths=lengths, split_keys=[0] * len(lengths))


def test_an_engine_storing_the_topk_without_the_last_hidden_state_neither_encodes_nor_copies_it():
    """The top-k needs every row's last layer; a cache without --store-last-hidden keeps only the
    head's output of it. Before, the engine encoded the last layer's states and copied them to a
    host slot in every batch all the same."""
    model = tiny_target(dtype=torch.float32, vocab=400)
    batch = one_batch([7, 5, 3])
    got = {}
    for stored in (None, False):  # None: as before (whenever the capture reaches the last layer)
        capture = LayerCapture(model, [0], need_last=True)
        engine = ExtractionEngine(model, capture, HiddenCodec(name="fp8"), device=torch.device("cpu"), topk=4,
                                  min_rows=4, store_last_hidden=stored)
        got[stored] = {k: np.array(v) for k, v in engine.wait(engine.launch(batch)).items()}
        capture.close()
    assert set(got[None]) - set(got[False]) == {LAST_HIDDEN, scale_of(LAST_HIDDEN)}
    assert LAST_HIDDEN not in got[False]
    for name in (TOPK_IDS, TOPK_LOGPROBS, HIDDEN, scale_of(HIDDEN)):
        assert np.array_equal(got[None][name], got[False][name])
    assert got[False][TOPK_IDS].shape == (15, 4)


def test_an_extract_bench_entry_ending_in_old_runs_the_old_formula_at_its_own_k():
    import bench_extract

    assert bench_extract.parse_topk("bf16@8+old") == ("bf16", 8)
    assert bench_extract.parse_codec("bf16:0@8+old") == ("bf16", 0.0)
    assert bench_extract.parse_topk("bf16+old") == ("bf16", None)
