"""`dflash-compare` (train/measure/compare.py trains and tabulates, eval/compare.py decodes and is the
command): the candidate heads train on the same nested subset
of the training samples for the same steps, each is measured on the same held-out split (and, with
--prompts, decoded), the table has one row of finite figures per head, the pick is the best one,
and the best head then trains on the whole data as `dflash-train --drafter-type BEST` would. A
rerun reads the finished candidates instead of training them again; a candidate stopped by a
signal resumes from its checkpoint."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import assert_same_weights, final_weights, read_metrics, write_jsonl
from dflash.eval.compare import DECODED_FILE
from dflash.eval.compare import main as compare_main
from dflash.train import heads
from dflash.train.cli import main as train_main
from dflash.train.measure.compare import COMPARE_DIR, SUMMARY_FILE, CompareConfig, compare_heads

SETTINGS = dict(num_draft_layers=1, block_size=4, max_anchors=4, token_budget=128, max_batch_size=4,
                max_seq_len=64, shuffle_window=16, num_workers=0, epochs=1, log_interval=1, save_interval=0,
                lr=1e-3, progress=False, tensorboard=False, attention_backend="sdpa", eval_fraction=0.25,
                compile=False, seed=3)


def run_values(world: dict[str, Path], out: Path, **overrides) -> dict:
    return {"cache": [str(world["cache"])], "target_model": str(world["target"]), "output_dir": str(out),
            **SETTINGS, **overrides}


def cli_flags(values: dict) -> list[str]:
    from dflash.train.measure.compare import settings_flags

    return settings_flags(values)


def test_candidates_train_on_the_same_subset_and_the_pick_is_the_best_row(tiny_world, tmp_path, monkeypatch):
    out = tmp_path / "run"
    values = run_values(tiny_world, out)
    lines: list[str] = []
    result = compare_heads(values, CompareConfig(heads=("dflash", "dflash2"), fraction=0.5, train_best=False),
                           log=lines.append)
    assert result.exit_status == 0
    plan = result.plan
    assert [r.head for r in result.rows] == ["dflash", "dflash2"]
    for row in result.rows:
        assert math.isfinite(row.heldout["tau"]) and row.heldout["tau"] >= 1.0
        assert len(row.heldout["tau_interval"]) == 2 and math.isfinite(row.heldout["tau_lookup"])
        assert row.record["steps"] == plan.candidate_steps and row.record["train_seconds"] > 0
        assert math.isfinite(row.record["steps_per_second"])
        run_dir = out / COMPARE_DIR / row.head
        config = json.loads((run_dir / "final" / "config.json").read_text())
        assert config["architectures"] == [heads.get_head(row.head).architecture]
        meta = json.loads(next((run_dir / "checkpoints").glob("step-*/meta.json")).read_text())
        assert meta["config"]["max_train_samples"] == plan.candidate_samples  # the same subset for every head
        assert meta["config"]["max_steps"] == 0 and meta["config"]["epochs"] == 1
    assert plan.candidate_samples == math.ceil(0.5 * plan.train_samples) < plan.train_samples
    assert plan.cost == pytest.approx(2 * plan.candidate_steps / plan.full_steps)
    taus = {r.head: r.heldout["tau"] for r in result.rows}
    assert result.pick.by == "heldout" and result.pick.tau == max(taus.values()) == taus[result.pick.best]
    assert result.pick.second != result.pick.best and result.pick.overlap is not None
    summary = json.loads((out / COMPARE_DIR / SUMMARY_FILE).read_text())
    assert [r["head"] for r in summary["rows"]] == ["dflash", "dflash2"] and summary["pick"]["best"] == result.pick.best
    spent = summary["time_cost"]
    assert spent["candidates_seconds"] == pytest.approx(sum(r.record["train_seconds"] for r in result.rows))
    assert 0 < spent["ratio"] < math.inf
    assert not (out / "final").exists()  # --no-train-best: the full run is only printed
    table = "\n".join(lines)
    assert all(f"{taus[h]:.3f}" in table for h in taus)

    # a rerun trains nothing again: the figures are the candidates' own records
    import dflash.train.run.loop as loop

    def no_training(cfg):
        raise AssertionError(f"{cfg.logging.output_dir} was trained again")

    with monkeypatch.context() as m:
        m.setattr(loop, "train", no_training)
        again = compare_heads(values, CompareConfig(heads=("dflash", "dflash2"), fraction=0.5, train_best=False),
                              log=lambda _: None)
    assert again.exit_status == 0 and [r.heldout for r in again.rows] == [r.heldout for r in result.rows]
    assert again.pick.best == result.pick.best

    # with the best trained after: a whole-data run of the best head in OUTPUT_DIR, of the planned steps
    best = compare_heads(values, CompareConfig(heads=("dflash", "dflash2"), fraction=0.5), log=lambda _: None)
    assert best.exit_status == 0
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["architectures"] == [heads.get_head(result.pick.best).architecture]
    assert max(r["step"] for r in read_metrics(out)) == plan.full_steps


@pytest.fixture()
def toy():
    from toy_head import HEAD

    heads.register_head(HEAD)
    HEAD.calls, HEAD.stop_at_call = 0, 0
    yield HEAD
    heads.unregister_head(HEAD.name)


def test_a_candidate_stopped_by_a_signal_resumes_and_finished_ones_are_kept(toy, tiny_world, tmp_path):
    options = CompareConfig(heads=("dflash", "toy"), fraction=0.5, train_best=False)
    out = tmp_path / "stopped"
    toy.calls, toy.stop_at_call = 0, 3  # SIGINT during the toy candidate's third step
    stopped = compare_heads(run_values(tiny_world, out), options, log=lambda _: None)
    assert stopped.exit_status == 130
    finished = out / COMPARE_DIR / "dflash" / "compare.json"
    assert finished.is_file() and not (out / COMPARE_DIR / "toy" / "compare.json").exists()
    assert [p.name for p in (out / COMPARE_DIR / "toy" / "checkpoints").glob("step-*")] == ["step-000003"]
    kept = finished.stat().st_mtime_ns, (out / COMPARE_DIR / "dflash" / "metrics.jsonl").read_bytes()

    toy.stop_at_call = 0
    resumed = compare_heads(run_values(tiny_world, out), options, log=lambda _: None)
    assert resumed.exit_status == 0 and [r.head for r in resumed.rows] == ["dflash", "toy"]
    assert (finished.stat().st_mtime_ns, (out / COMPARE_DIR / "dflash" / "metrics.jsonl").read_bytes()) == kept

    # the resumed candidate is the one an uninterrupted compare trains, bit for bit
    whole = tmp_path / "whole"
    alone = compare_heads(run_values(tiny_world, whole), CompareConfig(heads=("toy",), fraction=0.5, train_best=False),
                          log=lambda _: None)
    assert alone.exit_status == 0 and alone.pick.second is None
    assert_same_weights(final_weights(out / COMPARE_DIR / "toy"), final_weights(whole / COMPARE_DIR / "toy"))


def test_the_command_decodes_the_prompts_picks_by_decoded_tau_and_prints_the_full_run(tiny_world, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt_ids": [5, 9, 13, 2, 7]}, {"prompt_ids": [11, 3, 8]},
                                                         {"prompt_ids": [1, 2, 3, 4, 5, 6]}])
    out = tmp_path / "run"
    args = [*cli_flags(run_values(tiny_world, out)), "--heads", "dflash,dflash2", "--fraction", "0.5",
            "--prompts", str(prompts), "--max-new-tokens", "8", "--no-train-best"]
    done = CliRunner().invoke(compare_main, args)
    assert done.exit_code == 0, done.output
    summary = json.loads((out / COMPARE_DIR / SUMMARY_FILE).read_text())
    rows = {r["head"]: r for r in summary["rows"]}
    assert set(rows) == {"dflash", "dflash2"}
    for row in rows.values():
        decoded = row["decoded"]
        assert decoded["prompts"] == 3 and decoded["lossless"]
        assert math.isfinite(decoded["tau"]) and math.isfinite(decoded["tau_per_prompt_mean"])
        assert len(decoded["tau_interval"]) == 2 and len(decoded["per_prompt_interval"]) == 2
    pick = summary["pick"]
    assert pick["by"] == "decoded" and pick["tau"] == max(r["decoded"]["tau"] for r in rows.values())
    assert "decoded tau" in done.output and pick["best"] in done.output
    assert all((out / COMPARE_DIR / head / DECODED_FILE).is_file() for head in rows)

    # the printed command is the best head's normal run on the whole data
    command = shlex.split(summary["command"])
    assert command[0] == "dflash-train" and command[command.index("--drafter-type") + 1] == pick["best"]
    assert summary["command"] in done.output
    full = CliRunner().invoke(train_main, command[1:])
    assert full.exit_code == 0, full.output
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["architectures"] == [heads.get_head(pick["best"]).architecture]
    assert max(r["step"] for r in read_metrics(out)) == summary["plan"]["full_steps"]


@pytest.mark.parametrize(("extra", "named"), [
    (["--fraction", "0"], "--fraction"),
    (["--fraction", "1.5"], "--fraction"),
    (["--heads", "dflash,nope"], "--heads"),
    (["--drafter-type", "dflash"], "--heads"),
    (["--eval-fraction", "0"], "--eval-fraction"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_settings_it_cannot_compare_with_are_refused_naming_the_flag(tiny_world, tmp_path, extra, named):
    args = [*cli_flags(run_values(tiny_world, tmp_path / "run")), *extra]
    done = CliRunner().invoke(compare_main, args)
    assert done.exit_code == 2, done.output
    assert named in done.output and not (tmp_path / "run" / COMPARE_DIR).exists()


def test_dflash_train_compare_is_refused_naming_dflash_compare(tiny_world, tmp_path):
    # the comparison decodes through dflash-eval, so it is no subcommand of the trainer (train may
    # not import eval: tests/test_import_graph.py); the old spelling names the command to run
    args = ["compare", *cli_flags(run_values(tiny_world, tmp_path / "run")), "--heads", "dflash"]
    done = CliRunner().invoke(train_main, args)
    assert done.exit_code == 2, done.output
    assert "dflash-compare" in done.output and not (tmp_path / "run").exists()


def test_the_help_of_dflash_compare_imports_neither_torch_nor_transformers():
    script = ("import contextlib, io, json, sys\n"
              "from dflash.eval.compare import main\n"
              "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
              "    main(['--help'])\n"
              "assert '--prompts' in out.getvalue() and '--heads' in out.getvalue()\n"
              "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
