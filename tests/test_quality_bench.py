"""bench/quality at its CPU size: the code path end to end (its figures are measured on a GPU)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "quality"))

import corpus  # noqa: E402
import run as quality  # noqa: E402
import stages  # noqa: E402


def test_the_split_is_by_path_and_prompts_start_at_line_starts():
    assert corpus.is_held_out("numpy/a.py", 10) == corpus.is_held_out("numpy/a.py", 10)
    names = [f"pkg/m{i}.py" for i in range(2000)]
    share = sum(corpus.is_held_out(n, 10) for n in names) / len(names)
    assert 0.07 < share < 0.13
    docs = [corpus.Document("a.py", b"import os\nx = 1\ny = 2\n" * 20)]
    for p in corpus.cut_prompts(docs, 20, [8, 12], seed=3, tail=4):
        assert len(p) in (8, 12) and bytes(p).startswith((b"import o", b"x = 1\n", b"y = 2\n"))
    assert corpus.token_stream(docs)[0] == corpus.BOS_ID and corpus.token_stream(docs)[-1] == corpus.EOS_ID


@pytest.mark.slow
def test_small_benchmark_runs_every_stage_and_prints_the_whole_table(tmp_path, capsys):
    work = tmp_path / "q"
    assert quality.main(["--small", "--workdir", str(work), "--device", "cpu", "--stages", "target,generate"]) == 0
    assert {p.stem for p in (work / "stages").glob("*.json")} == {"target", "generate"}
    target = json.loads((work / "stages" / "target.json").read_text())
    assert target["held_out_loss"] > 0 and target["held_out_files"] > 0
    records = [json.loads(line) for part in sorted((work / "completions").glob("part-*.jsonl.gz"))
               for line in gzip.open(part, "rt")]
    assert len(records) == stages.SMALL.completions
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) == sum(r["loss_mask"]) + r["loss_mask"].index(1)
               for r in records)
    assert all(sum(r["loss_mask"]) == stages.SMALL.completion_tokens for r in records)
    estimate = [json.loads(line) for line in gzip.open(work / "estimate_set" / "part-000.jsonl.gz", "rt")]
    assert len(estimate) == stages.SMALL.estimate_prompts
    assert all(sum(r["loss_mask"]) == stages.SMALL.eval_new_tokens for r in estimate)
    # The decoded prompts' own greedy completions: every eval prompt, continued.
    decoded = [json.loads(line) for line in gzip.open(work / "decoded_set" / "part-000.jsonl.gz", "rt")]
    prompts = [json.loads(line)["input_ids"] for line in (work / "eval_prompts.jsonl").read_text().splitlines()]
    assert len(decoded) == len(prompts) == stages.SMALL.eval_prompts
    assert sorted(r["input_ids"][:r["loss_mask"].index(1)] for r in decoded) == sorted(prompts)
    assert all(sum(r["loss_mask"]) == stages.SMALL.eval_new_tokens for r in decoded)
    capsys.readouterr()

    # The rest resumes from what the first call left (the target is not retrained).
    assert quality.main(["--small", "--workdir", str(work), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "[target] done earlier" in out and "[generate] done earlier" in out
    header = next(line for line in out.splitlines() if line.startswith("| variant"))
    for column in ("samples", "epochs", "train GPU-s", "B=8 est. tau", "B=8 est. (same prompts)", "B=8 tau",
                   "B=8 speedup", "B=8 lookup tau", "B=4 est. tau", "B=4 est. (same prompts)", "B=4 tau",
                   "B=4 lookup tau", "B=8 tau / lookup tau, longest prompts", "lossless"):
        assert column in header
    [row] = [line for line in out.splitlines() if line.startswith("| e2 ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == header.count("|") - 1
    assert cells[1] == str(stages.SMALL.completions) and cells[2] == "2"
    assert "–" not in cells and cells[-1] == "yes"  # every figure present, both decoders lossless
    assert (work / "table.md").read_text().strip() in out
    # The longest prompts' own tau is read off dflash-eval's per-prompt figures.
    blocks = json.loads((work / "stages" / "eval-e2.json").read_text())["blocks"]
    assert all(b["longest_prompt_tokens"] == max(stages.SMALL.prompt_lengths) and 1 <= b["tau_longest_prompts"]
               for b in blocks.values())
    b8 = blocks["8"]
    assert cells[-2] == (f"{b8['tau_longest_prompts']:.2f} / {b8['lookup_tau_longest_prompts']:.2f} "
                         f"({b8['longest_prompt_tokens']} tokens)")
    # The estimate is the trainer's walk over the estimate set, at the exported (best) step.
    train = json.loads((work / "stages" / "train-e2.json").read_text())
    assert train["estimator"] == "labels walk" and train["best_step"] is not None
    assert train["train_samples"] == stages.SMALL.completions  # the trainer's data line, read back
    assert cells[5] == f"{train['heldout_tau']:.2f}"  # B=8 est. tau: the drafter's own block
    # est. (same prompts): dflash-train estimate over the decoded prompts' completions, both blocks.
    same = json.loads((work / "stages" / "eval-e2.json").read_text())["estimate_same_prompts"]
    assert same["walked_samples"] == same["samples"] == stages.SMALL.eval_prompts
    assert same["estimator"] == train["estimator"]
    assert cells[6] == f"{same['tau']:.2f}" and cells[6 + 6] == f"{same['tau_b4']:.2f}"
    assert 1.0 <= same["tau_b4"] <= 4.0 and 1.0 <= same["tau"] <= 8.0  # a walk at width B accepts 1..B a cycle
    assert train["sharing_gpu"] == 1 and "sharing" not in row and "shared" not in row  # run alone

    # Variants run side by side (device.sh side) share the device: the table says so of their times.
    for name in ("train-e2", "eval-e2"):
        record = work / "stages" / f"{name}.json"
        record.write_text(json.dumps({**json.loads(record.read_text()), "sharing_gpu": 3}))
    assert quality.main(["--small", "--workdir", str(work), "--device", "cpu", "--stages", "table"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| e2 ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3].endswith("(3 sharing)") and cells[8].endswith("x (shared)") and cells[10].endswith("x (shared)")


def test_a_workdir_of_other_settings_is_refused(tmp_path, capsys):
    (tmp_path / "settings.json").write_text(json.dumps({"target_steps": 1}))
    assert quality.main(["--small", "--workdir", str(tmp_path), "--device", "cpu", "--stages", "table"]) == 2
    assert "holds a benchmark of other settings" in capsys.readouterr().err
    assert quality.main(["--small", "--workdir", str(tmp_path / "new"), "--stages", "bogus"]) == 2


def test_variant_names_keep_every_flag_apart_and_clashes_are_refused():
    """Run directories and stage records are named after the variant: the name reads as its
    flags, and two different variants that would share one are refused."""
    names = [v.name for v in quality.parse_variants(
        ["1", "1 --lr-schedule wsd", "1 --draft-layer-types sliding --draft-sliding-window 128",
         "1 --soft-label-weight 0.5", "1 --lr-schedule wsd"])]
    assert names == ["e1", "e1-lr-schedule-wsd", "e1-draft-layer-types-sliding-draft-sliding-window-128",
                     "e1-soft-label-weight-0p5", "e1-lr-schedule-wsd"]
    with pytest.raises(quality.BenchError, match="share the run directory"):
        quality.parse_variants(["1 --draft-layer-types sliding --draft-sliding-window 128",
                                "1 --draft-layer-types sliding-draft --sliding-window 128"])


def test_a_larger_vocabulary_pads_the_target_with_ids_no_text_uses():
    """--set vocab_size=N (a real target's vocabulary size, for the drafter's shared head) pads the
    byte vocabulary; the bytes and specials keep their ids, and a smaller one is refused."""
    import target

    sizes = quality.apply_overrides(stages.SMALL, ["vocab_size=1000"])
    assert sizes.vocab_size == 1000 and stages.SMALL.vocab_size == corpus.VOCAB_SIZE
    model = target.build_target(sizes.target_hidden, sizes.target_layers, sizes.seed, vocab_size=sizes.vocab_size)
    assert model.get_input_embeddings().weight.shape[0] == model.get_output_embeddings().weight.shape[0] == 1000
    assert model.config.eos_token_id == corpus.EOS_ID and corpus.MASK_ID < corpus.VOCAB_SIZE
    with pytest.raises(ValueError, match="below"):
        target.build_target(64, 2, 0, vocab_size=corpus.VOCAB_SIZE - 1)
