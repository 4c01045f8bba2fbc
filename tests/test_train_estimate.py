"""`dflash-train estimate`: the trainer's own held-out evaluation of an exported drafter."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from click.testing import CliRunner
from conftest import read_metrics, tiny_train_config
from dflash.train.cli import main as train_main
from dflash.train.run.loop import train

# The settings of tiny_train_config that decide the held-out batches and anchor chunks.
SETTINGS = ["--max-anchors", "4", "--token-budget", "128", "--max-batch-size", "4", "--max-seq-len", "64",
            "--num-workers", "0", "--dtype", "fp32"]


def invoke(*args: object):
    return CliRunner().invoke(train_main, [str(a) for a in args])


def test_estimate_is_the_final_evaluation_of_a_run_on_the_same_cache(tiny_world, tmp_path):
    cache, target = tiny_world["cache"], tiny_world["target"]
    run_dir = tmp_path / "run"
    same_samples = tmp_path / "held-out-copy"  # the cache's own samples, held out (one path may not be both)
    shutil.copytree(cache, same_samples)
    result = train(tiny_train_config(cache, target, run_dir, eval_cache=[str(same_samples)], block_size=8, max_steps=2,
                                     eval_interval=1))
    assert result.exit_status == 0
    evals = [r for r in read_metrics(run_dir) if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [1, 2]
    assert evals[0]["heldout_tau"] != evals[1]["heldout_tau"]  # so the match below names one step's weights
    best = next(r for r in evals if r["step"] == evals[-1]["best_step"])  # the step final/ holds
    # That step's weights as they were trained (float32; final/ holds them in bf16).
    exported = invoke("export", run_dir / "checkpoints" / f"step-{best['step']:06d}", tmp_path / "drafter",
                      "--dtype", "fp32")
    assert exported.exit_code == 0, exported.output

    out = invoke("estimate", tmp_path / "drafter", "--cache", cache, "--target-model", target, *SETTINGS, "--json")
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert got["estimator"] == best["estimator"] == "labels walk"
    assert got["walked_samples"] == best["walked_samples"] > 0 and got["samples"] == 48
    for key in ("tau", "tau_b4", "tau_blocks", "blocks"):
        assert got[key] == best[key], key
    assert got["tau"] == best["heldout_tau"]
    assert abs(got["loss"] - best["loss"]) < 1e-5

    line = invoke("estimate", tmp_path / "drafter", "--cache", cache, "--target-model", target, *SETTINGS)
    # one line of figures, then the notes on the cache (this one records no hash of its target's weights)
    assert line.exit_code == 0
    assert [n for n in line.stdout.strip().splitlines()[1:] if not n.startswith("Note: ")] == []
    lo, hi = best["tau_interval"]  # the run's own interval over the samples, as the estimate's
    assert got["tau_interval"] == [lo, hi] and lo <= got["tau"] <= hi
    assert line.stdout.startswith(f"tau {best['heldout_tau']:.3f} [95 %: {lo:.3f}-{hi:.3f} over the samples] "
                                  "(labels walk, block 8), tau_b4 ")


def test_a_missing_drafter_or_cache_exits_2_with_one_paragraph(tiny_world, tmp_path):
    cases = [(tmp_path / "no-drafter", tiny_world["cache"], "no-drafter"),
             (tiny_world["target"], tmp_path / "no-cache", "no-cache")]
    for drafter, cache, name in cases:
        result = invoke("estimate", drafter, "--cache", cache, "--target-model", tiny_world["target"])
        assert result.exit_code == 2, result.output
        err = result.stderr.strip()
        assert err.startswith("Error: ") and "\n" not in err and name in err and "Traceback" not in err, err


def test_estimate_help_does_not_import_torch():
    script = ("import contextlib, io, sys\nfrom dflash.train.cli import main\n"
              "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
              "    main(['estimate', '--help'])\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_a_dflash2_estimate_reports_the_selector_tau_beside_the_backbone_tau_of_dflash(tiny_world, tmp_path):
    import torch
    from dflash.train.exports.export import export_drafter
    from dflash.train.model.drafter import DFlashDrafter

    cache, target = tiny_world["cache"], tiny_world["target"]
    shape = dict(num_hidden_layers=1, target_layer_ids=[1, 2], block_size=8, mask_token_id=63, attention_backend="sdpa")
    dflash = DFlashDrafter.from_target(target, **shape, drafter_type="dflash")
    dflash2 = DFlashDrafter.from_target(target, **shape, drafter_type="dflash2", selector_rank=8, selector_top_k=4,
                                        conv_group_size=8)
    dflash2.load_state_dict(dflash.state_dict(), strict=False)  # the same backbone; identity convolutions

    def estimate(drafter, name):
        export_drafter(drafter, tmp_path / name, dtype=torch.float32)
        out = invoke("estimate", tmp_path / name, "--cache", cache, "--target-model", target, *SETTINGS, "--json")
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout)

    plain, fresh = estimate(dflash, "dflash"), estimate(dflash2, "dflash2")
    assert "tau_backbone" not in plain and 1.0 < plain["tau"] <= 8.0  # (some drafts are accepted)
    # A fresh DFlash2 computes DFlash's states, and its untrained selector (a zero projection:
    # every edge is the candidate's own logit) walks the backbone's top-1.
    assert fresh["tau_backbone"] == plain["tau"]
    assert fresh["tau"] == fresh["tau_backbone"] and fresh["tau_b4"] == plain["tau_b4"]
    assert fresh["walked_samples"] == plain["walked_samples"] > 0

    # A selector that moves changes the selector path's tau, never the backbone's.
    with torch.no_grad():
        dflash2.candidate_selector.hidden_projection.weight.normal_(std=5.0)
        dflash2.candidate_selector.predecessor_codebook.normal_(std=5.0)
    moved = estimate(dflash2, "moved")
    assert moved["tau_backbone"] == plain["tau"] and moved["tau"] != plain["tau"]
    line = invoke("estimate", tmp_path / "moved", "--cache", cache, "--target-model", target, *SETTINGS)
    assert line.exit_code == 0, line.output
    lo, hi = moved["tau_interval"]
    assert line.stdout.startswith(f"tau {moved['tau']:.3f} [95 %: {lo:.3f}-{hi:.3f} over the samples] "
                                  "(labels walk, block 8)")
    assert f"backbone tau {plain['tau']:.3f}" in line.stdout
