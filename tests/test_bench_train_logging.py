"""bench_train times the loop dflash-train runs: its metric logs, each a wait for the GPU, come no
more often than the trainer's default interval, and the measured span starts and ends on one."""

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
