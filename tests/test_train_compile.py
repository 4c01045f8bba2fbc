"""The compiled training forward and the anchors drawn in the loader workers: both must leave
the numbers as they are (the tiny targets and caches come from conftest.py)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from anchor_utils import loss_of
from dflash.cache_tools.cache_set import CacheSet
from dflash.train import config as train_config
from dflash.train.config import DataConfig
from dflash.train.data.anchors import draw_anchors
from dflash.train.data.loader import TrainLoader
from dflash.train.loss.objective import ObjectiveConfig
from dflash.train.model import drafter as train_model
from test_drafter_objective import hand_batch
from test_drafter_support import tiny_drafter


def _loss_and_grads(drafter):
    out = loss_of(drafter.train(), hand_batch(), ObjectiveConfig(max_anchors=3),
                       generator=torch.Generator().manual_seed(5))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def test_the_whole_forward_compiled_gives_the_eager_loss_and_gradients(monkeypatch):
    eager_loss, eager_grads = _loss_and_grads(tiny_drafter())
    traced, real_compile = [], torch.compile

    def compile_for_test(fn, mode, dynamic=None):  # dynamo traces the forward; aot_eager runs the graphs unfused
        traced.append(mode)
        return real_compile(fn, backend="aot_eager", dynamic=dynamic)

    drafter = tiny_drafter()
    monkeypatch.setattr(train_model.torch, "compile", compile_for_test)
    drafter.compile_training("default")
    monkeypatch.undo()
    loss, grads = _loss_and_grads(drafter)
    assert traced == ["default"] and drafter._compiled_forward is not None
    assert torch.equal(loss, eager_loss)
    assert grads.keys() == eager_grads.keys() and len(grads) > 10
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def _varying_batches(count: int = 4):
    """Batches of the hand batch's kind, each with another batch size and length."""
    g = torch.Generator().manual_seed(1)
    for rows, length in [(2, 13), (3, 17), (4, 10), (2, 21)][:count]:  # no length equals the block tokens (3 anchors x 4)
        lengths = torch.full((rows,), length)
        lengths[1:] = length - 3
        mask = (torch.arange(length)[None] < lengths[:, None]).long()
        mask[:, :2] = 0
        yield {"hidden": torch.randn(rows, length, 2 * 64, generator=g).to(torch.bfloat16),
               "input_ids": torch.randint(0, 100, (rows, length), generator=g), "loss_mask": mask, "lengths": lengths}


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_dynamic_compiles_once_for_batches_of_varying_shapes(monkeypatch, dynamic):
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(train_model.torch, "compile",
                        lambda fn, mode, dynamic=None: real_compile(fn, backend="aot_eager", dynamic=dynamic))
    eager, compiled = tiny_drafter().train(), tiny_drafter().train()
    compiled.compile_training("default", dynamic=dynamic)
    monkeypatch.undo()
    torch._dynamo.reset()
    counters.clear()
    objective = ObjectiveConfig(max_anchors=3)
    for i, batch in enumerate(_varying_batches()):
        want = loss_of(eager, batch, objective, generator=torch.Generator().manual_seed(i)).loss
        got = loss_of(compiled, batch, objective, generator=torch.Generator().manual_seed(i)).loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    graphs = counters["stats"]["unique_graphs"]
    # torch's default: a static graph first, then one more as sizes start to vary; dynamic: one
    assert graphs == 1 if dynamic else graphs > 1


def test_compile_modes_are_torch_compiles_and_agree_with_the_flag():
    assert train_config.COMPILE_MODES == train_model.COMPILE_MODES
    with pytest.raises(ValueError) as e:
        tiny_drafter().compile_training("fast")
    assert (e.value.code, e.value.fields["mode"]) == ("train.compile-mode", "fast")


@pytest.mark.parametrize("world_size", [1, 2])
def test_anchors_drawn_in_the_loader_workers_are_the_trainers_draws(tiny_world, world_size):
    """Each batch carries the anchors of its (epoch, global batch index), as the trainer drew
    them itself before: the same in a worker process, on any rank, across an epoch boundary."""
    caches = CacheSet([str(tiny_world["cache"])], max_seq_len=64)
    config = DataConfig(cache=["unused"], token_budget=128, max_batch_size=4, max_seq_len=64, shuffle_window=16,
                        num_workers=1)
    draw = functools.partial(draw_anchors, seed=7, max_anchors=3, block_size=4)
    loader = TrainLoader(caches, np.arange(len(caches)), config, seed=3, epochs=2, rank=world_size - 1,
                         world_size=world_size, prepare=draw)
    seen, iterators = set(), set()
    for _ in range(sum(loader.steps_per_epoch) + 1):
        batch = loader.next_batch()
        if loader.epoch < len(loader.steps_per_epoch):  # one reader (the same workers) for the planned epochs
            iterators.add(tuple(w.pid for w in loader._iter._workers))
        expected = {k: batch[k] for k in ("input_ids", "loss_mask", "lengths")}
        draw(expected, loader.epoch, loader.last_index)
        for name in ("anchor_positions", "anchor_valid", "scored_slots"):
            assert torch.equal(batch[name], expected[name]), name
        seen.add((loader.epoch, loader.last_index))
    loader.close()
    assert {epoch for epoch, _ in seen} >= {0, 1} and len(iterators) == 1
    assert all(index % world_size == world_size - 1 for _, index in seen)


def test_evaluation_runs_the_eager_forward_of_a_compiled_drafter(tiny_world, tmp_path, monkeypatch):
    """Held-out passes have their own shapes and no backward: compiling them cost minutes on the
    benchmark for a few seconds of evaluation. Training steps keep the compiled forward."""
    from conftest import read_metrics, tiny_train_config
    from dflash.train.run.loop import train

    calls = []

    def counting_compile(self, mode="default", *, per_layer=False, dynamic=False):
        eager = self._forward

        def compiled(*args):
            calls.append(torch.is_grad_enabled())
            return eager(*args)
        self._compiled_forward = compiled

    monkeypatch.setattr(train_model.DFlashDrafter, "compile_training", counting_compile)
    out = tmp_path / "run"
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, max_steps=4, eval_fraction=0.3,
                            eval_interval=2, compile=True))
    assert len([r for r in read_metrics(out) if r["kind"] == "eval"]) >= 2
    assert len(calls) == 4 and all(calls)  # one compiled call per training step, none from evaluation


def test_a_compiled_drafter_compiles_its_head_loss_on_cuda_only_and_not_under_eager(monkeypatch):
    # compile_training() asks for the compiled head loss (head_loss.use_compiled): on CUDA, not while
    # evaluation's eager() block runs, and never on a drafter that was not compiled.
    from dflash.train.loss import head_loss

    drafter = tiny_drafter()
    cpu, cuda = torch.zeros(1), type("CudaLike", (), {"is_cuda": True})()
    assert not head_loss.use_compiled(drafter, cuda)
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, dynamic=None: fn)
    drafter.compile_training()
    assert head_loss.use_compiled(drafter, cuda) and not head_loss.use_compiled(drafter, cpu)
    with drafter.eager():
        assert not head_loss.use_compiled(drafter, cuda)
    assert head_loss.use_compiled(drafter, cuda)
    monkeypatch.setattr(head_loss, "COMPILED_KERNELS", False)  # bench_train --head-kernels eager
    assert not head_loss.use_compiled(drafter, cuda)
