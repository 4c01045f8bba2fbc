"""The training step's memory estimate (train/run/memory.py): its terms grow with what they count, the
startup check lowers --logits-chunk-mib or refuses with a setting that fits, and its per-token
activation figures match the bytes autograd saves at a small shape on the CPU."""

from __future__ import annotations

import types
import weakref

import numpy as np
import pytest
import torch
from conftest import tiny_train_config
from dflash.train.run import memory
from dflash.train.run.memory import (
    GIB,
    Dims,
    MemoryBudgetError,
    MicroBatch,
    estimate_step_memory,
    plan_step_memory,
    worst_micro_batches,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

QWEN3_8B = Dims(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
                context_layers=5, draft_layers=5, block_size=16, drafter_type="dflash2")


def _config(tmp_path, **overrides):
    return tiny_train_config(tmp_path / "cache", tmp_path / "target", tmp_path / "run", **overrides)


def test_estimate_grows_with_context_anchors_and_samples():
    base = estimate_step_memory(QWEN3_8B, MicroBatch(1, 8192, 512)).total
    assert estimate_step_memory(QWEN3_8B, MicroBatch(1, 32768, 512)).total > base
    assert estimate_step_memory(QWEN3_8B, MicroBatch(1, 8192, 1024)).total > base
    assert estimate_step_memory(QWEN3_8B, MicroBatch(2, 8192, 1024)).total > base
    dflash = estimate_step_memory(Dims(**{**QWEN3_8B.__dict__, "drafter_type": "dflash"}), MicroBatch(1, 8192, 512))
    assert dflash.total < base


def test_chunked_head_and_gradient_checkpointing_need_less():
    chat = MicroBatch(32, 512, 32 * 300)
    at_once = estimate_step_memory(QWEN3_8B, chat, logits_chunk_mib=0)
    chunked = estimate_step_memory(QWEN3_8B, chat, logits_chunk_mib=1024)
    assert chunked.terms["head"] < at_once.terms["head"] / 10
    recomputed = estimate_step_memory(QWEN3_8B, chat, gradient_checkpointing=True)
    assert recomputed.terms["block activations"] < chunked.terms["block activations"] / 2


def test_the_8b_shape_at_32k_tokens_fits_an_80_gib_card_at_the_defaults():
    """One 32,768-token sample, 512 anchors, DFlash2, the head all at once (its 7,680 slots are under
    --logits-chunk-mib 8192): well under 80 GiB, and the sdpa mask adds its dense [Q, T + Q]."""
    flex = estimate_step_memory(QWEN3_8B, MicroBatch(1, 32768, 512))
    assert flex.total < 70 * GIB
    sdpa = estimate_step_memory(QWEN3_8B, MicroBatch(1, 32768, 512), backend="sdpa")
    assert sdpa.terms["attention mask"] == 8192 * (32768 + 8192) * 3


def test_worst_micro_batches_follow_the_packing_bound():
    batches = worst_micro_batches(np.array([32768, 512, 512, 100]), token_budget=32768, max_batch_size=64,
                                  max_anchors=512)
    by_length = {b.tokens: b for b in batches}
    assert by_length[32768] == MicroBatch(1, 32768, 512)
    assert by_length[512] == MicroBatch(64, 512, 64 * 511)
    assert by_length[100] == MicroBatch(64, 100, 64 * 99)


def test_a_run_that_fits_is_left_as_it_is(tmp_path):
    cfg = _config(tmp_path, logits_chunk_mib=8192, token_budget=32768, max_seq_len=32768, max_batch_size=1)
    plan = plan_step_memory(cfg, QWEN3_8B, [32768] * 4, 80 * GIB)
    assert plan.config is cfg and plan.note is None
    assert plan.batch == MicroBatch(1, 32768, 4)  # this config's --max-anchors 4


def test_the_head_goes_to_chunks_where_its_logits_at_once_do_not_fit(tmp_path):
    cfg = _config(tmp_path, logits_chunk_mib=8192, token_budget=32768, max_seq_len=32768, max_batch_size=1,
                  max_anchors=512)
    # the eager head loss (10 bytes a logit): its logits at once outweigh the gradients that take
    # the head's place at the peak once it is chunked
    at_once = plan_step_memory(cfg, QWEN3_8B, [32768], 200 * GIB, compiled=False).estimate
    free = int((at_once.total - at_once.terms["head"] / 2) / memory.USABLE_FRACTION)
    plan = plan_step_memory(cfg, QWEN3_8B, [32768], free, compiled=False)
    assert plan.config.objective.logits_chunk_mib < 8192
    assert plan.estimate.total <= free * memory.USABLE_FRACTION
    assert plan.note.code == "train.logits-chunk-lowered"
    assert plan.note.fields["logits_chunk_mib"] == plan.config.objective.logits_chunk_mib
    assert plan.config.data == cfg.data and plan.config.model == cfg.model


def test_a_run_that_cannot_fit_names_a_setting_whose_value_fits(tmp_path):
    # 64 samples of 512 tokens a micro-batch: ~33K anchors, far over 80 GiB at the 8B shape
    cfg = _config(tmp_path, token_budget=32768, max_seq_len=32768, max_batch_size=64, max_anchors=512)
    lengths = [32768, 512, 512]
    with pytest.raises(MemoryBudgetError) as refused:
        plan_step_memory(cfg, QWEN3_8B, lengths, 80 * GIB)
    assert refused.value.code == "train.memory-over-budget"
    size = refused.value.fields["fits"]["--max-batch-size"]  # the fix: a value that fits
    fixed = _config(tmp_path, token_budget=32768, max_seq_len=32768, max_batch_size=size, max_anchors=512)
    assert plan_step_memory(fixed, QWEN3_8B, lengths, 80 * GIB).estimate.total <= 80 * GIB
    with pytest.raises(MemoryBudgetError):
        plan_step_memory(_config(tmp_path, token_budget=32768, max_seq_len=32768, max_batch_size=size + 1,
                                 max_anchors=512), QWEN3_8B, lengths, 80 * GIB)


def test_the_check_does_nothing_off_cuda(tmp_path):
    cfg = _config(tmp_path)
    data = types.SimpleNamespace(caches=types.SimpleNamespace(lengths=np.array([64, 64])), train_indices=np.arange(2))
    assert memory.fit_to_device(cfg, None, data, "cpu") is cfg


def test_chunk_size_agrees_with_the_head():
    from dflash.train.loss.head_loss import CHUNK_MIB

    assert memory.CHUNK_MIB == CHUNK_MIB


def _saved_activation_bytes(dims: Dims, context: int, anchors: int) -> int:
    """Bytes of the tensors autograd saves in a bf16 forward of a drafter of `dims` (eager, CPU),
    the attention saving what a fused kernel saves (q, k, v, its output, a float32 logsumexp),
    without the weights and their bf16 copies."""
    import dflash.train.model.layers as layers
    import torch.nn.functional as F
    from dflash.train.model.attention import build_layer_masks
    from dflash.train.model.drafter import DFlashDrafter
    from dflash.train.model.drafter_config import DrafterConfig
    from dflash.train.model.target_weights import TargetWeights

    class FusedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask):
            with torch.no_grad():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=True)
            ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:-1]))
            return out

        @staticmethod
        def backward(ctx, grad):
            return None, None, None, None

    config = DrafterConfig(hidden_size=dims.hidden, num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
                           head_dim=dims.head_dim, intermediate_size=dims.intermediate, vocab_size=dims.vocab,
                           num_target_layers=dims.context_layers, num_hidden_layers=dims.draft_layers,
                           target_layer_ids=list(range(dims.context_layers)), block_size=dims.block_size,
                           drafter_type=dims.drafter_type, attention_backend="sdpa")
    drafter = DFlashDrafter(config, TargetWeights(torch.randn(dims.vocab, dims.hidden),
                                                  torch.randn(dims.vocab, dims.hidden)))
    hidden = torch.randn(1, context, dims.context_layers * dims.hidden, dtype=torch.bfloat16)
    positions = torch.arange(anchors)[None] * (context // anchors)
    block = (positions[:, :, None] + torch.arange(dims.block_size)).flatten(1)
    masks = build_layer_masks(positions, context, dims.block_size, [(None, False)] * dims.draft_layers, "sdpa")
    weights = {p.untyped_storage().data_ptr() for p in (*drafter.parameters(), *drafter.buffers())}
    shapes = {tuple(p.shape) for p in drafter.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        cast = t.dim() == 2 and tuple(t.shape) in shapes and t.dtype == torch.bfloat16
        if storage.data_ptr() not in weights and t.data_ptr() != hidden.data_ptr() and not cast:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    attend = layers.attend
    layers.attend = lambda q, k, v, mask: FusedAttention.apply(q, k, v, mask)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            drafter(hidden, torch.zeros_like(block), block, masks)
    finally:
        layers.attend = attend
    return sum(saved.values())


@pytest.mark.parametrize("drafter_type", ["dflash", "dflash2"])
def test_activation_terms_match_the_bytes_autograd_saves(drafter_type):
    dims = Dims(hidden=320, heads=4, kv_heads=2, head_dim=64, intermediate=1152, vocab=64, context_layers=2,
                draft_layers=2, block_size=16, drafter_type=drafter_type)
    batch = MicroBatch(1, 400, 24)
    measured = _saved_activation_bytes(dims, batch.tokens, batch.anchors)
    terms = estimate_step_memory(dims, batch, compiled=False).terms
    estimated = terms["context activations"] + terms["block activations"]
    assert 0.85 < estimated / measured < 1.15, (estimated, measured)


def _qwen3_8b_data(lengths):
    from transformers import Qwen3Config

    target = Qwen3Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=12288, vocab_size=151936, num_hidden_layers=36)
    caches = types.SimpleNamespace(lengths=np.asarray(lengths),
                                   manifest=types.SimpleNamespace(target_layer_ids=[1, 9, 17, 25, 33]))
    return target, types.SimpleNamespace(caches=caches, train_indices=np.arange(len(lengths)))


@pytest.mark.parametrize("free_gib", [20, 300])
def test_the_startup_check_refuses_on_a_small_device_and_passes_on_a_large_one(tmp_path, monkeypatch, free_gib):
    """A fake CUDA device of `free_gib` free: one 32K-token sample of the 8B drafter refused at 20 GiB
    (naming the flags), left as it is at 300 GiB; --no-memory-check skips it."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gib * GIB, 300 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    cfg = _config(tmp_path, token_budget=32768, max_seq_len=32768, max_batch_size=1, max_anchors=512,
                  drafter_type="dflash2", block_size=16, num_draft_layers=5)
    target, data = _qwen3_8b_data([32768, 32768])
    if free_gib == 20:
        with pytest.raises(MemoryBudgetError) as refused:
            memory.fit_to_device(cfg, target, data, "cuda")
        f = refused.value.fields
        assert refused.value.code == "train.memory-over-budget" and f["needed_gib"] > f["usable_gib"]
        assert f["settings"]["--max-anchors"] == 512 and f["settings"]["--max-seq-len"] == 32768
        assert f["fits"] == {}  # at 18 GiB usable no single setting fits: the renderer says to combine them
    else:
        assert memory.fit_to_device(cfg, target, data, "cuda") is cfg
    unchecked = _config(tmp_path, token_budget=32768, max_seq_len=32768, memory_check=False)
    assert memory.fit_to_device(unchecked, target, data, "cuda") is unchecked


def test_a_logit_costs_what_the_head_loss_path_holds_of_it():
    # compiled: bf16 logits and gradient; eager: and a float32 copy; soft labels from the last hidden
    # states: and the target's own logits and log-probabilities beside it
    batch = MicroBatch(1, 3072, 512)
    compiled = estimate_step_memory(QWEN3_8B, batch).terms["head"]
    eager = estimate_step_memory(QWEN3_8B, batch, compiled=False).terms["head"]
    hidden = estimate_step_memory(QWEN3_8B, batch, soft_from_hidden=True).terms["head"]
    logits = 512 * 15 * QWEN3_8B.vocab
    assert eager - compiled == logits * (memory.LOGIT_BYTES["eager"] - memory.LOGIT_BYTES["compiled"])
    assert hidden - eager == logits * (memory.LOGIT_BYTES["target head"] - memory.LOGIT_BYTES["eager"])
    assert estimate_step_memory(QWEN3_8B, batch, compiled=False, soft_from_hidden=True).terms["head"] == hidden


@pytest.mark.parametrize(("topk", "last_hidden", "weight", "expected"),
                         [(8, True, 0.5, False), (0, True, 0.5, True), (0, True, 0.0, False), (0, False, 0.5, False)])
def test_the_plan_counts_the_target_head_where_the_soft_labels_come_from_hidden_states(tmp_path, topk, last_hidden,
                                                                                        weight, expected):
    cfg = _config(tmp_path, soft_label_weight=weight)
    manifest = types.SimpleNamespace(topk=topk, store_last_hidden=last_hidden)
    assert memory.soft_labels_from_hidden(cfg, manifest) is expected


@pytest.mark.parametrize(("shape", "kind", "measured_gib"),
                         [("8b", "dflash", 26.9), ("8b", "dflash2", 29.9), ("27b", "dflash", 44.5),
                          ("27b", "dflash2", 48.7), ("8b-8k", "dflash", 27.5), ("8b-8k", "dflash2", 30.5),
                          ("8b-32k", "dflash", 30.5), ("8b-32k", "dflash2", 33.5),
                          ("27b-32k", "dflash", 48.8), ("27b-32k", "dflash2", 52.9)])
def test_the_compiled_estimate_lies_a_little_above_the_measured_peaks(shape, kind, measured_gib):
    # docs/BENCHMARKS.md, one sample of the shape's length (3,072 tokens, 8,192 or 32,768) and 512
    # anchors, compiled, H100 (e2b6ed3; the long shapes e8db04f, 8B at 32K 0f9014c): an estimate below a measured peak
    # lets a run start that runs out of memory; one far above refuses runs that fit
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_train import LAYER_IDS, SHAPES

    s = SHAPES[shape]
    dims = Dims(hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, intermediate=s.intermediate,
                vocab=s.vocab, context_layers=len(LAYER_IDS[s.target_layers]), draft_layers=s.draft_layers,
                block_size=s.block_size, drafter_type=kind)
    estimate = estimate_step_memory(dims, MicroBatch(1, s.seq_len, 512)).total / GIB
    assert measured_gib + 1 < estimate < measured_gib + 6


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensors the ops under it return and keep alive (their storages, each
    counted once until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (key := t.untyped_storage().data_ptr()) and key not in self.live:
                self.live[key] = t.untyped_storage().nbytes()
                weakref.finalize(t.untyped_storage(), self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


@pytest.mark.parametrize(("soft", "path"), [("topk", "eager"), ("none", "eager"), ("hidden", "target head")])
def test_the_eager_head_loss_holds_no_more_than_its_bytes_a_logit(soft, path):
    from types import SimpleNamespace

    from dflash.train.loss.head_loss import slot_losses

    rows, vocab, width, k = 64, 16384, 32, 8
    weight = torch.randn(vocab, width)
    head = SimpleNamespace(lm_head_weight=weight, logits=lambda h: h @ weight.T, target_logits=lambda x: x @ weight.T)
    soft_labels = {"topk": dict(soft_weight=0.5, soft_ids=torch.randint(0, vocab, (rows, k)),
                                soft_logprobs=torch.log_softmax(torch.randn(rows, k), -1)),
                   "hidden": dict(soft_weight=0.5, soft_hidden=torch.randn(rows, width)), "none": {}}[soft]
    h = torch.randn(rows, width, requires_grad=True)
    live = _LiveBytes()
    with torch.autocast("cpu", dtype=torch.bfloat16), live:  # bf16 logits, as on the GPU
        slot_losses(head, h, torch.randint(0, vocab, (rows,)), rows, **soft_labels)
    per_logit = (live.peak - rows * width * 8) / (rows * vocab)  # less the estimate's [N, D] term
    # (within 1 %: the loss's few [N] vectors, nothing at a real vocabulary)
    assert memory.LOGIT_BYTES[path] - 3 <= per_logit <= memory.LOGIT_BYTES[path] * 1.01
