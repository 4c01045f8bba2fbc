"""bench/quality at its CPU size: the code path end to end (its figures are measured on a GPU)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "quality"))

import corpus  # noqa: E402
import paired  # noqa: E402
import run as quality  # noqa: E402
import stages  # noqa: E402
import vocab  # noqa: E402

TEXT = b"import os\nx = 1\ny = 2\n" * 20


def test_the_split_is_by_path_and_prompts_start_at_line_starts():
    assert corpus.is_held_out("numpy/a.py", 10) == corpus.is_held_out("numpy/a.py", 10)
    names = [f"pkg/m{i}.py" for i in range(2000)]
    share = sum(corpus.is_held_out(n, 10) for n in names) / len(names)
    assert 0.07 < share < 0.13
    encoded = vocab.ByteVocabulary().encode([TEXT])
    for p in corpus.cut_prompts(encoded, 20, [8, 12], seed=3, tail=4):
        assert len(p) in (8, 12) and bytes(p).startswith((b"import o", b"x = 1\n", b"y = 2\n"))
    stream = corpus.token_stream(encoded, corpus.BOS_ID, corpus.EOS_ID)
    assert stream[0] == corpus.BOS_ID and stream[-1] == corpus.EOS_ID and len(stream) == len(TEXT) + 2
    # More prompts only add to fewer: a larger eval set begins with the smaller one's prompts.
    docs = vocab.ByteVocabulary().encode([TEXT, b"def f():\n    return 1\n" * 30, b"a = [1, 2]\n" * 40])
    fewer, more = (corpus.cut_prompts(docs, n, [8, 12], seed=5, tail=4) for n in (12, 40))
    assert more[:12] == fewer and len(more) == 40 and more[12:] != more[:28]


def _bpe_digest(texts: list[bytes], size: int) -> str:
    return vocab.vocabulary_digest(vocab.train_bpe(texts, size))


def test_the_learned_bpe_is_the_same_in_another_process_and_its_prompts_start_at_line_starts(tmp_path):
    """Same documents, same vocabulary (another process, another hash seed); prompts cut from
    its tokens decode to text that starts a line of the document."""
    import os
    import subprocess

    root = Path(corpus.package_root("json"))
    texts = [p.read_bytes() for p in sorted(root.glob("*.py"))]
    bpe = vocab.train_bpe(texts, 1024)
    assert bpe.tokenizer.get_vocab_size() == 1024 and (bpe.pad_id, bpe.bos_id, bpe.eos_id, bpe.mask_id) == (0, 1, 2, 3)
    here = vocab.vocabulary_digest(bpe)
    script = (f"import sys, pathlib; sys.path.insert(0, {str(Path(vocab.__file__).parent)!r}); import vocab; "
              f"texts = [p.read_bytes() for p in sorted(pathlib.Path({str(root)!r}).glob('*.py'))]; "
              "print(vocab.vocabulary_digest(vocab.train_bpe(texts, 1024)))")
    there = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert there == here
    assert _bpe_digest(texts[1:], 1024) != here  # the digest does tell vocabularies apart
    encoded = bpe.encode(texts)
    assert all(len(e.tokens) < len(t) / 2 for e, t in zip(encoded, texts))  # merges: under half a token a byte
    whole = [t.decode() for t in texts]
    for p in corpus.cut_prompts(encoded, 30, [16, 24], seed=1, tail=8):
        text = bpe.decode(p)
        assert len(p) in (16, 24) and any(w.startswith(text) or f"\n{text}" in w for w in whole)
    # Saved beside the target, it loads back as the same vocabulary (and as a transformers tokenizer).
    bpe.save(tmp_path)
    again = vocab.load_vocabulary("bpe", 1024, tmp_path)
    assert vocab.vocabulary_digest(again) == here
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path)).mask_token_id == bpe.mask_id


def test_prose_is_the_sentences_of_docstrings_not_their_code_or_parameter_lists():
    source = '''"""A module that does things.

This module reads the files of a package and writes them back in order, so that
their names are kept.
"""

def f(x):
    """Return the square of its argument, computed the usual way for every number.

    Args:
        x: the number.

    >>> f(2)
    4

    Parameters
    ----------
    x : int
        The number to square and return to the caller.
    """
    y = """not a docstring: it is an assignment of a string to a name in the body"""
    return x * x
'''
    prose = corpus.docstring_prose(source)
    assert prose == ("This module reads the files of a package and writes them back in order, so that\n"
                     "their names are kept.\n\n"
                     "Return the square of its argument, computed the usual way for every number.\n")
    assert corpus.docstring_prose("x = 1\n") == ""


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
    # The drafter's prompts come from files the target never trained on (prompt_percent of them).
    split = stages.Work(root=work, sizes=stages.preset(small=True), device="cpu", log=lambda *a: None).split_training()
    target_docs, prompt_docs = split
    assert target["target_files"] == len(target_docs) and target["prompt_files"] == len(prompt_docs) > 0
    assert target["target_files"] + target["prompt_files"] == target["train_files"]
    assert target["train_tokens"] == sum(len(e.tokens) + 2 for e in target_docs)  # <bos> doc <eos>, no prompt file
    prompt_text = [e.tokens.tobytes() for e in prompt_docs]
    # The generate record says how much text its prompts come from (the table prints it).
    generated = json.loads((work / "stages" / "generate.json").read_text())
    prompts = [tuple(r["input_ids"][: r["loss_mask"].index(1)]) for r in records]
    assert generated["prompt_files"] == len(prompt_docs) and generated["distinct_prompts"] == len(set(prompts))
    assert generated["prompt_file_tokens"] == sum(len(e.tokens) for e in prompt_docs)
    assert generated["prompts_per_file_token"] == pytest.approx(sum(map(len, prompts)) / generated["prompt_file_tokens"])
    for r in records[:: max(1, len(records) // 16)]:
        prompt = np.asarray(r["input_ids"][: r["loss_mask"].index(1)], dtype=prompt_docs[0].tokens.dtype).tobytes()
        assert any(prompt in text for text in prompt_text)
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
    columns = [c.strip() for c in header.strip("|").split("|")]
    for column in ("samples", "epochs", "train GPU-s", "B=8 est. tau", "B=8 est. (same prompts)", "B=8 tau",
                   "B=8 tau per-prompt mean", "B=8 est. / tau", "B=8 tau / lookup", "B=8 speedup",
                   "B=8 lookup tau", "B=8 lookup per-prompt mean", "B=4 est. tau", "B=4 est. (same prompts)",
                   "B=4 tau", "B=4 lookup tau", "B=8 tau / lookup tau, longest prompts", "lossless"):
        assert column in columns
    [row] = [line for line in out.splitlines() if line.startswith("| e2 ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == header.count("|") - 1
    assert cells[2] == "2"
    # Every figure present, both decoders lossless; the one run is the run the others would be
    # paired with, so its own "vs defaults" cells are empty.
    against = {i for i, c in enumerate(columns) if "vs defaults" in c}
    assert len(against) == 2 and all(cells[i] == "–" for i in against)
    # (the regression estimate needs MIN_GREEDY_SAMPLES greedy ones held out: this small split has fewer)
    # (nor, over a censored walk, prompt lookup's figure)
    adjusted, lookup = columns.index("est. text-adjusted / tau"), columns.index("est. lookup / lookup tau")
    adjusted_too = columns.index("est. confidence-adjusted / tau")
    assert "–" not in [c for i, c in enumerate(cells) if i not in against | {adjusted, lookup, adjusted_too}]
    assert cells[-1] == "yes"
    # the target's confidence on the split, the training text and the decoded prompts, all read
    sure = cells[columns.index("target top-1 p: split / training / decoded prompts")].split(" / ")
    assert len(sure) == 3 and all(0.0 < float(p) < 1.0 for p in sure)
    assert "domain: code, vocabulary: BPE of 512 ids" in out
    assert (f"their prompts cut from {generated['prompt_files']} prompt files of {generated['prompt_file_tokens']:,} "
            f"tokens") in out
    assert (work / "table.md").read_text().strip() in out
    # The longest prompts' own tau is read off dflash-eval's per-prompt figures.
    blocks = json.loads((work / "stages" / "eval-e2.json").read_text())["blocks"]
    assert all(b["longest_prompt_tokens"] == max(stages.SMALL.prompt_lengths) and 1 <= b["tau_longest_prompts"]
               for b in blocks.values())
    b8 = blocks["8"]
    longest = columns.index("B=8 tau / lookup tau, longest prompts")
    assert cells[longest] == (f"{b8['tau_longest_prompts']:.2f} / {b8['lookup_tau_longest_prompts']:.2f} "
                              f"({b8['longest_prompt_tokens']} tokens)")
    # Prompt lookup walked by the trainer on the split's samples, over its decoded tau, and the
    # split's text over the training text: both read off the run's best evaluation.
    run = json.loads((work / "stages" / "train-e2.json").read_text())
    assert cells[lookup] == ("–" if run["heldout_lookup_tau"] is None else
                             f"{run['heldout_lookup_tau'] / b8['lookup_tau']:.3f}")
    assert cells[columns.index("split text / training text")] == (
        f"{run['lookup_text_heldout'] / run['lookup_text_training']:.3f}")
    assert cells[adjusted] == ("–" if run["heldout_tau_text_adjusted"] is None else
                               f"{run['heldout_tau_text_adjusted'] / b8['tau']:.3f}")
    # The estimate is the trainer's greedy walk over its own held-out split of the training data
    # (no --eval-cache: the cached top-1 replays verification), at the exported (best) step.
    train = json.loads((work / "stages" / "train-e2.json").read_text())
    assert train["estimator"] == "greedy walk" and train["best_step"] is not None
    assert "--eval-cache" not in (work / "train-e2.log").read_text().splitlines()[0]
    assert 0 < train["train_samples"] < stages.SMALL.completions  # the trainer's data line: some held out
    assert cells[1] == str(train["train_samples"])
    col = {c: i for i, c in enumerate(columns)}
    span = train["heldout_tau_interval"]  # the estimate's own 95 % interval, at the drafter's own block
    assert span[0] <= train["heldout_tau"] <= span[1]
    assert cells[col["B=8 est. tau"]] == f"{train['heldout_tau']:.2f} ({span[0]:.2f}-{span[1]:.2f})"
    b8 = json.loads((work / "stages" / "eval-e2.json").read_text())["blocks"]["8"]
    lo, hi = b8["tau_interval"]  # dflash-eval's 95 % interval over the prompts, beside the tau
    assert lo <= b8["tau"] <= hi and cells[col["B=8 tau"]] == f"{b8['tau']:.2f} ({lo:.2f}-{hi:.2f})"
    assert cells[col["B=8 tau per-prompt mean"]] == f"{b8['tau_per_prompt_mean']:.2f}"
    assert cells[col["B=8 lookup per-prompt mean"]] == f"{b8['lookup_tau_per_prompt_mean']:.2f}"
    ratio = train["heldout_tau"] / b8["tau"]
    r_lo, r_hi = quality.ratio_interval(train["heldout_tau"], span, b8["tau"], b8["tau_interval"])
    assert r_lo < ratio < r_hi and cells[col["B=8 est. / tau"]] == f"{ratio:.3f} ({r_lo:.2f}-{r_hi:.2f})"
    lo, hi = b8["tau_vs_lookup_interval"]
    assert cells[col["B=8 tau / lookup"]] == f"{b8['tau'] / b8['lookup_tau']:.2f}x ({lo:.2f}-{hi:.2f})"
    # est. (same prompts): dflash-train estimate over the decoded prompts' completions, both blocks.
    same = json.loads((work / "stages" / "eval-e2.json").read_text())["estimate_same_prompts"]
    assert same["walked_samples"] == same["samples"] == stages.SMALL.eval_prompts
    assert same["estimator"] == train["estimator"]
    assert cells[col["B=8 est. (same prompts)"]] == f"{same['tau']:.2f}"
    assert cells[col["B=4 est. (same prompts)"]] == f"{same['tau_b4']:.2f}"
    assert 1.0 <= same["tau_b4"] <= 4.0 and 1.0 <= same["tau"] <= 8.0  # a walk at width B accepts 1..B a cycle
    # est. (other files): the same over estimate_cache, prompts of held-out files no training sample comes from.
    other = json.loads((work / "stages" / "eval-e2.json").read_text())["estimate_other_files"]
    held = json.loads((work / "estimate_cache" / "manifest.json").read_text())
    assert other["samples"] == other["walked_samples"] == stages.SMALL.estimate_prompts != same["samples"]
    assert held and cells[col["B=8 est. (other files)"]] == f"{other['tau']:.2f}"
    assert cells[col["B=4 est. (other files)"]] == f"{other['tau_b4']:.2f}"
    assert train["sharing_gpu"] == 1 and "sharing" not in row and "shared" not in row  # run alone

    # Variants run side by side (device.sh side) share the device: the table says so of their times.
    for name in ("train-e2", "eval-e2"):
        record = work / "stages" / f"{name}.json"
        record.write_text(json.dumps({**json.loads(record.read_text()), "sharing_gpu": 3}))
    assert quality.main(["--small", "--workdir", str(work), "--device", "cpu", "--stages", "table"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| e2 ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3].endswith("(up to 3 sharing)") and cells[col["B=8 speedup"]].endswith("x (shared)")
    assert cells[col["B=8 lookup speedup"]].endswith("x (shared)")


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


def test_a_larger_vocabulary_pads_the_byte_target_with_ids_no_text_uses():
    """--vocab bytes --set vocab_size=N (a real target's vocabulary size, for the drafter's shared
    head) pads the byte vocabulary; the bytes and specials keep their ids, and a smaller one is refused."""
    import target

    sizes = quality.apply_overrides(stages.preset("code", "bytes", small=True), ["vocab_size=1000"])
    assert sizes.vocab == "bytes" and sizes.vocab_size == 1000
    assert stages.preset("code", "bytes").vocab_size == corpus.VOCAB_SIZE and stages.FULL.vocab_size == 8192
    model = target.build_target(sizes.target_hidden, sizes.target_layers, sizes.seed,
                                vocab=vocab.ByteVocabulary(sizes.vocab_size))
    assert model.get_input_embeddings().weight.shape[0] == model.get_output_embeddings().weight.shape[0] == 1000
    assert model.config.eos_token_id == corpus.EOS_ID and corpus.MASK_ID < corpus.VOCAB_SIZE
    with pytest.raises(ValueError, match="below"):
        vocab.ByteVocabulary(corpus.VOCAB_SIZE - 1)


def test_an_extra_codec_extracts_the_same_completions_and_a_variant_trains_on_it_alone(tmp_path, monkeypatch):
    """`--set extra_codecs=nf4` extracts `completions` once more with that codec into cache-nf4, and a
    variant's `--bench-cache cache-nf4` trains on it instead of `cache` (dflash-train never sees the flag)."""
    calls = []

    def fake(name, module, args, log_path, stdout=None, env=None):
        calls.append((name, args))
        if name == "dflash-extract":
            out = Path(args[args.index("--output") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "manifest.json").write_text("{}")
        return 1.0

    monkeypatch.setattr(stages, "run_command", fake)
    sizes = stages.preset(small=True)
    sizes = stages.dataclasses.replace(sizes, extra_codecs=("nf4",))
    work = stages.Work(root=tmp_path, sizes=sizes, device="cpu", log=lambda *a: None)
    record = stages.stage_extract(work)
    by_output = {Path(a[a.index("--output") + 1]).name: a for n, a in calls}
    assert by_output["cache-nf4"][by_output["cache-nf4"].index("--data") + 1] == str(tmp_path / "completions")
    assert by_output["cache-nf4"][-2:] == ["--codec", "nf4"] and "--codec" not in by_output["cache"]
    assert record["nf4_seconds"] == 1.0

    variant = stages.Variant(6, ("--bench-cache", "cache-nf4", "--lr", "1e-3"))
    assert stages.training_cache(work, variant) == tmp_path / "cache-nf4"
    assert stages.variant_args(work, variant) == ["--lr", "1e-3"]
    assert stages.training_cache(work, stages.Variant(6)) == tmp_path / "cache"
    with pytest.raises(stages.BenchError, match="extra_codecs"):
        stages.training_cache(work, stages.Variant(6, ("--bench-cache", "cache-fp8")))


def test_every_set_of_completions_is_half_greedy_and_half_sampled():
    """Batches alternate greedy and sampled: a set no larger than one batch is cut in two, so
    4,096 completions are not all greedy (they were, in one batch of 4,096)."""
    for completions, batch in ((4096, 4096), (8192, 4096), (64, 64), (3, 4096), (32768, 4096)):
        sizes = stages.dataclasses.replace(stages.FULL, completions=completions, generate_batch=batch)
        size = stages.batch_size(sizes)
        counts = [min(size, completions - b * size) for b in range(-(-completions // size))]
        greedy, sampled = sum(counts[0::2]), sum(counts[1::2])
        assert sum(counts) == completions and abs(greedy - sampled) <= size // 2 + 1 and sampled > 0


def test_device_script_exits_with_a_failed_runs_status_after_printing_the_table(tmp_path):
    # A run that fails (here: no prep before it) must fail the script, so that a round's runner
    # sees it (and reruns a job that ran out of GPU memory) instead of recording a table without it.
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "WORKDIR": str(tmp_path / "w"), "SMALL": "1", "RESULTS": str(tmp_path / "res")}
    done = subprocess.run(["bash", str(repo / "bench" / "quality" / "device.sh"), "main", "1"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "| variant |" in done.stdout  # the table of what there is still printed
    assert "a run failed" in done.stderr
    assert (tmp_path / "res" / "results.tgz").is_file()


def test_the_ratio_interval_adds_the_two_log_widths_in_quadrature():
    # est. / tau: the estimate walks other samples than the decoded prompts, so the two
    # intervals are independent; in log space their half-widths add in quadrature.
    import math

    assert quality.ratio_interval(2.0, [1.0, 4.0], 1.0, [1.0, 1.0]) == pytest.approx([1.0, 4.0])
    lo, hi = quality.ratio_interval(3.0, [2.0, 4.5], 2.0, [1.6, 2.5])
    half = math.hypot(math.log(4.5 / 2.0), math.log(2.5 / 1.6)) / 2
    assert (lo, hi) == pytest.approx((1.5 * math.exp(-half), 1.5 * math.exp(half)))
    assert quality.ratio_interval(3.0, None, 2.0, [1.6, 2.5]) is None


def test_the_prompt_pool_counts_repeated_prompts_as_one_and_the_text_they_cover():
    """A prompt file of three line kinds repeated: every prompt of one length is one of three
    texts, however many are cut, and the coverage is the prompts' tokens over the file's."""
    import types

    import prompt_pool

    encoded = vocab.ByteVocabulary().encode([TEXT])
    sizes = stages.dataclasses.replace(stages.FULL, completions=40, generate_batch=8, prompt_lengths=(6,),
                                       completion_tokens=4)
    work = types.SimpleNamespace(sizes=sizes, split_training=lambda: ([], encoded))
    r = prompt_pool.prompt_pool(work)
    assert r["prompts"] == 40 and 1 < r["distinct_prompts"] <= 3 and r["greedy_prompts"] == 24  # batches 0, 2, 4
    assert r["distinct_greedy"] <= r["distinct_prompts"] and r["most_repeated"] >= 40 // 3
    assert r["prompts_per_file_token"] == pytest.approx(40 * 6 / len(TEXT))


def _eval_report(path: Path, rows: list[tuple[int, int]], prompt_tokens: int = 64) -> Path:
    """A dflash-eval --json report of one prompt set whose prompts accepted `rows` (tokens, cycles)."""
    per_prompt = [{"prompt_tokens": prompt_tokens, "new_tokens": t, "cycles": c, "accepted_tokens": t, "tau": t / c}
                  for t, c in rows]
    path.write_text(json.dumps({"settings": {}, "prompt_sets": [{"name": "p", "per_prompt": per_prompt}]}))
    return path


def test_the_paired_comparison_reads_eval_reports_and_refuses_other_prompts(tmp_path, capsys):
    """bench/quality/paired.py: pooled taus, per-prompt means and the ratio's paired interval from
    two reports of the same prompts; a drafter that needs half the cycles on every prompt is 2x
    with no doubt; reports of other prompts are refused, naming the fix."""
    rng = np.random.default_rng(1)
    cycles = 2 * rng.integers(5, 30, size=40)
    base = [(160, int(c)) for c in cycles]
    a = _eval_report(tmp_path / "a.json", base)
    twice = _eval_report(tmp_path / "b.json", [(160, int(c) // 2) for c in cycles])
    noisy = _eval_report(tmp_path / "c.json", [(160, int(max(1, c + d))) for c, d in zip(cycles, rng.integers(-8, 9, 40))])
    c = paired.compare(paired.read_prompts(a), paired.read_prompts(twice))
    assert c["ratio"] == pytest.approx(2.0) and c["interval"] == pytest.approx([2.0, 2.0])
    assert c["base_tau"] == pytest.approx(160 * 40 / cycles.sum())
    assert c["per_prompt_mean"] == pytest.approx(2 * c["base_per_prompt_mean"])
    n = paired.compare(paired.read_prompts(a), paired.read_prompts(noisy))
    lo, hi = n["interval"]
    assert lo < n["ratio"] < hi and hi - lo > 0.01  # a noisy difference has a width
    assert paired.main([str(a), str(twice), str(noisy)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "= +100.0 % (paired 95 %: +100.0 to +100.0 %)" in out[0]
    other = _eval_report(tmp_path / "d.json", base[:30])
    assert paired.main([str(a), str(other)]) == 2
    assert "same --prompts file" in capsys.readouterr().err
    # The benchmark's table: each run against the run at dflash-train's defaults, on its prompts.
    trained = [{"variant": "e40", "epochs": 40, "train_args": []}, {"variant": "e10-x", "epochs": 10, "train_args": ["--x"]},
               {"variant": "e10", "epochs": 10, "train_args": []}]
    assert quality.defaults_variant(trained) == "e10"
    assert quality.defaults_variant(trained[:2]) == "e40"  # the one run without flags (a round at EPOCHS=40)
    assert quality.defaults_variant([trained[0], {**trained[0], "variant": "e6", "epochs": 6}, trained[1]]) is None
    for name, report in (("e10", a), ("e10-x", twice)):
        (tmp_path / f"eval-{name}-b16.json").write_text(report.read_text())
    work = stages.Work(tmp_path, stages.Sizes(), "cpu")
    assert quality.against_defaults(work, "e10-x", "e10", 16) == "+100.0 % (+100.0 to +100.0) (per-prompt +100.0 %)"
    assert quality.against_defaults(work, "e10", "e10", 16) == "–"
    assert quality.against_defaults(work, "e10-x", "e10", 8) == "–"  # not decoded at 8
    (tmp_path / "e.json").write_text("{}")
    assert paired.main([str(a), str(tmp_path / "e.json")]) == 2
    assert "dflash-eval --json" in capsys.readouterr().err


def test_a_variant_warm_started_from_another_variant_reads_its_export_in_the_work_directory(tmp_path):
    sizes = stages.preset(small=True)
    work = stages.Work(root=tmp_path, sizes=sizes, device="cpu", log=lambda *a: None)
    base = stages.Variant(1, ("--drafter-type", "dflash"))
    warm = stages.Variant(1, ("--init-drafter", base.name))
    with pytest.raises(stages.BenchError, match=f"train the variant {base.name} first"):
        stages.variant_args(work, warm)
    (tmp_path / f"run-{base.name}" / "final").mkdir(parents=True)
    (tmp_path / f"run-{base.name}" / "final" / "config.json").write_text("{}")
    assert stages.variant_args(work, warm) == ["--init-drafter", str(tmp_path / f"run-{base.name}" / "final")]
    assert "/" not in warm.name
