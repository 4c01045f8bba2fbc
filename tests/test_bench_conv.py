"""bench/bench_conv.py: revisions of DFlash2's convolution timed side by side only once they compute
the same values (the timings themselves are measured on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_conv  # noqa: E402


def test_each_revision_is_timed_in_both_modes_relative_to_the_first(tmp_path):
    rows = bench_conv.measure(["worktree", "worktree"], 64, 32, torch.device("cpu"), 1, 1, tmp_path)
    assert [(r["mode"], r["rev"]) for r in rows] == [("compiled", "worktree")] * 2 + [("eager", "worktree")] * 2
    assert rows[0]["vs_first"] == 1.0 and all(r["ms"] > 0 for r in rows)


def test_a_revision_that_computes_other_values_is_refused_before_timing(tmp_path, monkeypatch):
    real = bench_conv.load
    loaded = []

    def load(rev, scratch):
        module = real("worktree", scratch)
        if loaded:  # the second revision's taps read another block's token: other values
            class Shifted(module.GroupedDynamicConv):
                def finish(self, x, delta, block_size):
                    return super().finish(x.roll(1, 1), delta, block_size)
            module.GroupedDynamicConv = Shifted
        loaded.append(rev)
        return module

    monkeypatch.setattr(bench_conv, "load", load)
    monkeypatch.setattr(bench_conv, "timed", lambda *a, **k: pytest.fail("timed before the values were checked"))
    with pytest.raises(AssertionError, match="other values"):
        bench_conv.measure(["a", "b"], 64, 32, torch.device("cpu"), 1, 1, tmp_path)
