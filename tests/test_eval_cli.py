"""`dflash-eval` end to end on exported tiny models: report, lossless check, input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from dflash.eval import run as eval_cli
from dflash.eval.cli import main
from dflash.eval.run import load_prompts
from dflash.train.exports.export import export_drafter
from test_eval_support import PERIOD, periodic_ids, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    target = tiny_target()
    target.save_pretrained(str(root / "target"))
    export_drafter(tiny_drafter(target, steps=150), root / "drafter", dtype=torch.float32)
    ids = periodic_ids(torch.Generator().manual_seed(4), 5, 3 * PERIOD)
    prompts = root / "prompts.jsonl"
    lines = [{"input_ids": ids[i, : 6 + i].tolist()} for i in range(4)]
    # An extraction-style record: only the part before the completion is the prompt.
    lines.append({"input_ids": ids[4].tolist(), "loss_mask": [0] * 8 + [1] * (3 * PERIOD - 8)})
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return {"target": root / "target", "drafter": root / "drafter", "prompts": prompts, "root": root}


def run(pair, *extra: str):
    args = ["--target-model", str(pair["target"]), "--drafter", str(pair["drafter"]),
            "--prompts", str(pair["prompts"]), "--max-new-tokens", "16", *extra]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_json_report_gives_tau_histogram_speedup_and_a_passed_lossless_check(pair):
    result = run(pair, "--json", "--batch-size", "2", "--strict")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["settings"] | {"device": "cpu", "dtype": "fp32", "drafter_type": "dflash", "block_size": 4,
                                 "batch_size": 2} == report["settings"]
    [r] = report["prompt_sets"]
    assert r["num_prompts"] == 5 and r["new_tokens"] == 5 * 16
    assert r["lossless"] == {"checked": True, "identical": True, "divergent_prompts": 0, "divergences": []}
    assert r["tau"] > 2.0
    assert sum(r["histogram"].values()) == r["cycles"]
    assert r["tau"] == pytest.approx(sum(int(k) * v for k, v in r["histogram"].items()) / r["cycles"])
    assert r["speculative"]["tokens_per_second"] > 0 and r["target_only"]["tokens_per_second"] > 0
    assert r["speedup"] == pytest.approx(r["speculative"]["tokens_per_second"] / r["target_only"]["tokens_per_second"])
    # Per prompt, in order: their cycles and accepted tokens add up to the totals.
    for per, total in ((r["per_prompt"], r), (r["prompt_lookup"]["per_prompt"], r["prompt_lookup"])):
        assert len(per) == 5 and all(p["new_tokens"] == 16 and p["prompt_tokens"] > 0 for p in per)
        assert sum(p["cycles"] for p in per) == total["cycles"]
        assert sum(p["accepted_tokens"] for p in per) / total["cycles"] == pytest.approx(total["tau"])
        assert all(p["tau"] == pytest.approx(p["accepted_tokens"] / p["cycles"]) for p in per)


def test_text_report_and_a_smaller_block(pair):
    result = run(pair, "--block-size", "2")
    assert result.exit_code == 0, result.output
    assert "tau (accepted+1 per cycle)" in result.stdout and "identical to target" in result.stdout
    assert "block_size=2" in result.stdout
    assert "drafter=DFlash block_size" in result.stdout  # the drafter's kind: the pair's is plain DFlash


def test_prompt_lookup_runs_beside_the_drafter_under_the_same_lossless_check(pair):
    result = run(pair, "--json", "--strict")
    assert result.exit_code == 0, result.output
    [r] = json.loads(result.stdout)["prompt_sets"]
    lookup = r["prompt_lookup"]
    assert lookup["max_ngram"] == 4
    assert lookup["lossless"] == {"checked": True, "identical": True, "divergent_prompts": 0, "divergences": []}
    assert lookup["tau"] > 1.5  # periodic prompts: lookup copies the period
    assert sum(lookup["histogram"].values()) == lookup["cycles"]
    assert lookup["tau"] == pytest.approx(sum(int(k) * v for k, v in lookup["histogram"].items()) / lookup["cycles"])
    assert r["tau_vs_prompt_lookup"] == pytest.approx(r["tau"] / lookup["tau"])
    assert lookup["speedup"] == pytest.approx(lookup["tokens_per_second"] / r["target_only"]["tokens_per_second"])

    text = run(pair, "--lookup-ngram", "2").stdout
    assert "tau (accepted+1 per cycle)" in text and "prompt lookup (n-gram <= 2, the free baseline):" in text
    assert f"drafter / lookup: {r['tau'] / lookup['tau']:.2f}x" in run(pair).stdout
    assert text.count("identical to target") == 2  # the drafter's check and the baseline's

    result = run(pair, "--json", "--no-baseline")
    [r] = json.loads(result.stdout)["prompt_sets"]
    assert "prompt_lookup" not in r and "tau_vs_prompt_lookup" not in r
    assert "prompt lookup" not in run(pair, "--no-baseline").stdout
    assert run(pair, "--lookup-ngram", "0").exit_code == 2


def corrupt_output(monkeypatch, decoder: str, position: int) -> None:
    """Make `eval_cli.<decoder>` change token `position` of the first prompt of every batch."""
    real = getattr(eval_cli, decoder)

    def corrupted(*args, **kwargs):
        gens = real(*args, **kwargs)
        gens[0].tokens[position] += 1
        return gens

    monkeypatch.setattr(eval_cli, decoder, corrupted)


def test_strict_exits_1_when_prompt_lookup_output_diverges(pair, monkeypatch):
    corrupt_output(monkeypatch, "lookup_generate", 2)
    result = run(pair, "--strict", "--max-prompts", "1")
    assert result.exit_code == 1
    assert "DIVERGED on 1 prompt(s)" in result.stdout


def test_strict_exits_1_when_speculative_output_diverges(pair, monkeypatch):
    corrupt_output(monkeypatch, "speculative_generate", 3)
    result = run(pair, "--strict", "--max-prompts", "2")
    assert result.exit_code == 1
    assert "DIVERGED on 2 prompt(s)" in result.stdout  # the warm-up call is not counted; both batches are
    assert "prompt 0: token 3" in result.stdout
    assert run(pair, "--max-prompts", "2").exit_code == 0  # without --strict: reported, not fatal


def test_sampling_skips_the_lossless_check(pair):
    result = run(pair, "--json", "--temperature", "0.8", "--max-prompts", "2")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompt_sets"][0]["lossless"]["checked"] is False


def test_prompt_records_are_cut_where_the_completion_starts(tmp_path):
    path = tmp_path / "p.jsonl"
    records = [
        {"prompt_ids": [1, 2, 3]},
        {"input_ids": [4, 5, 6, 7], "prompt_len": 2},
        {"input_ids": [4, 5, 6, 7], "loss_mask": [0, 0, 0, 1]},
        {"input_ids": [4, 5, 6, 7], "labels": [-100, 5, 6, 7]},
        {"input_ids": [9, 8]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert load_prompts(path, 32) == [[1, 2, 3], [4, 5], [4, 5, 6], [4], [9, 8]]
    assert load_prompts(path, 32, max_prompts=2) == [[1, 2, 3], [4, 5]]


@pytest.mark.parametrize("line, message", [
    ('{"input_ids": [1, 2', "line 2 is not valid JSON"),
    ('{"input_ids": [1, 99]}', "line 2: token ids [99] are outside the target's vocabulary (0..31)"),
    ('{"input_ids": []}', "line 2: the prompt is empty"),
    ('{"text": "hello"}', "line 2: the record has only `text` and the target directory has no tokenizer"),
    ('{"ids": [1]}', "line 2: the record has none of"),
])
def test_bad_prompt_files_fail_with_one_clear_message(pair, tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [5, 6]}\n' + line + "\n")
    result = CliRunner().invoke(main, ["--target-model", str(pair["target"]), "--drafter", str(pair["drafter"]),
                                       "--prompts", str(bad)])
    assert result.exit_code == 2
    assert message in result.stderr and str(bad) in result.stderr
    assert "Traceback" not in result.output


def test_a_prompt_whose_decoding_would_pass_the_targets_positions_is_refused_naming_the_fix(pair, tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text('{"input_ids": [5, 6]}\n' + json.dumps({"input_ids": [5, 6, 7, 8] * 50}) + "\n")
    args = ["--target-model", str(pair["target"]), "--drafter", str(pair["drafter"]), "--prompts", str(long)]
    result = CliRunner().invoke(main, args)  # --max-new-tokens 128: 200 + 128 + a block of 4 > 256
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (f"{long}, line 2: the prompt's 200 tokens, up to --max-new-tokens 128 more and a verify block of 4 "
            "need up to 332 positions, more than the target's 256 positions") in result.stderr
    assert "Lower --max-new-tokens to 52 or less" in result.stderr
    result = CliRunner().invoke(main, [*args, "--max-new-tokens", "52", "--json", "--no-baseline"])
    assert result.exit_code == 0, result.output  # the fix it names is enough


def test_bad_settings_fail_with_one_clear_message(pair, tmp_path):
    result = run(pair, "--block-size", "5")
    assert result.exit_code == 2 and "--block-size 5 must be between 2 and the drafter's trained block size 4" in result.stderr
    result = CliRunner().invoke(main, ["--target-model", str(pair["target"]), "--drafter", str(tmp_path),
                                       "--prompts", str(pair["prompts"])])
    assert result.exit_code == 2 and "is not a drafter export" in result.stderr


def test_the_report_names_a_dflash2_drafter():
    settings = {"device": "cpu", "dtype": "fp32", "drafter_type": "dflash2", "block_size": 8, "batch_size": 1,
                "temperature": 0.0, "max_new_tokens": 4}
    assert eval_cli.format_report({"settings": settings, "prompt_sets": []}).startswith(
        "dflash-eval  device=cpu dtype=fp32 drafter=DFlash2 block_size=8")
