"""The held-out estimate works for every registered head: a run's own evaluation and `dflash-train
estimate` of its export read a finite tau (the drafter's: the head's drafts), with the backbone's tau
beside it exactly where the head picks the drafts, and the estimate of the exported best step is the
run's figure of that step."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from conftest import read_metrics, tiny_train_config
from dflash.train.heads import get_head, head_names
from dflash.train.run.loop import train
from test_train_distributed import head_settings
from test_train_estimate import SETTINGS, invoke


@pytest.mark.parametrize("name", head_names())
def test_each_heads_export_is_estimated_as_its_run_evaluated_it(tiny_world, tmp_path, name):
    cache, target = tiny_world["cache"], tiny_world["target"]
    held_out = tmp_path / "held-out-copy"  # the cache's own samples, held out (one path may not be both)
    shutil.copytree(cache, held_out)
    kind = {k: v for k, v in head_settings(name).items() if k != "eval_fraction"}
    run_dir = tmp_path / "run"
    result = train(tiny_train_config(cache, target, run_dir, eval_cache=[str(held_out)], block_size=8, max_steps=2,
                                     eval_interval=1, **kind))
    assert result.exit_status == 0
    picks = get_head(name).picks_drafts
    evals = [r for r in read_metrics(run_dir) if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [1, 2]
    for r in evals:
        assert math.isfinite(r["tau"]) and 1.0 <= r["tau"] <= 8.0 and ("tau_backbone" in r) == picks
        assert not picks or math.isfinite(r["tau_backbone"])
    best = next(r for r in evals if r["step"] == evals[-1]["best_step"])
    # that step's weights as they were trained (float32; final/ holds them in bf16)
    exported = invoke("export", run_dir / "checkpoints" / f"step-{best['step']:06d}", tmp_path / "drafter",
                      "--dtype", "fp32")
    assert exported.exit_code == 0, exported.output

    out = invoke("estimate", tmp_path / "drafter", "--cache", cache, "--target-model", target, *SETTINGS, "--json")
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert ("tau_backbone" in got) == picks and got["walked_samples"] == best["walked_samples"] > 0
    for key in ("tau", "tau_b4", "tau_blocks", "blocks") + (("tau_backbone",) if picks else ()):
        assert got[key] == best[key], key
    # the run's final/ (bf16) is estimated too
    final = invoke("estimate", run_dir / "final", "--cache", cache, "--target-model", target, *SETTINGS, "--json")
    assert final.exit_code == 0, final.output
    got = json.loads(final.stdout)
    assert math.isfinite(got["tau"]) and ("tau_backbone" in got) == picks
