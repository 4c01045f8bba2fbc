"""bench_train times the loop dflash-train runs: its metric logs, each a wait for the GPU, come no
more often than the trainer's default interval, and the measured span starts and ends on one; and
it can draw its drafters wider than the trainer does, so that DFlash2's candidates spread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dflash.train.config import LoggingConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_train import log_interval  # noqa: E402


@pytest.mark.parametrize(("unmeasured", "measured", "expected"), [(20, 100, 10), (10, 20, 10), (8, 12, 4), (3, 4, 1)])
def test_the_bench_logs_as_often_as_the_trainer_where_the_spans_allow(unmeasured, measured, expected):
    interval = log_interval(unmeasured, measured, LoggingConfig.log_interval)
    assert interval == expected
    assert unmeasured % interval == 0 and measured % interval == 0 and interval <= LoggingConfig.log_interval


def test_the_bench_can_draw_its_drafters_at_another_std():
    # (--drafter-init-std: a drafter drawn wider proposes candidates spread over the vocabulary)
    import torch
    from bench_train import draw_drafters_at
    from dflash.train.model.drafter import DFlashDrafter
    from dflash.train.model.drafter_config import DrafterConfig
    from dflash.train.model.target_weights import TargetWeights

    def drafter():
        torch.manual_seed(0)
        config = DrafterConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                               intermediate_size=128, vocab_size=300, num_target_layers=2, num_hidden_layers=1,
                               target_layer_ids=[0, 1], block_size=4, drafter_type="dflash")
        return DFlashDrafter(config, TargetWeights(torch.randn(300, 64), torch.randn(300, 64)))

    undo = draw_drafters_at(0.1)
    try:
        wide = drafter().layers[0].mlp.up_proj.weight.detach()
    finally:
        undo()
    assert abs(float(wide.std()) - 0.1) < 0.01
    assert abs(float(drafter().layers[0].mlp.up_proj.weight.detach().std()) - 0.02) < 0.002  # undone: the trainer's
