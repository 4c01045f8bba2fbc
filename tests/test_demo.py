"""The embedded demo: shipped corpus, and the whole pipeline at reduced size reaching tau >= 2."""

from __future__ import annotations

import contextlib
import io
import json
import runpy

import pytest
import torch
from dflash.demo import pipeline as demo
from dflash.runtime.errors import InputError, UsageError


def test_corpus_is_shipped_small_reproducible_and_in_the_alphabet():
    assert demo.CORPUS.is_file() and demo.CORPUS.stat().st_size < 1_000_000
    documents = demo.load_documents()
    assert len(documents) > 1000
    for d in documents:
        assert demo.decode(demo.encode(d)) == d
    assert demo.vocab_size() >= len(demo.SPECIALS) + len(demo.CHARS)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(demo.CORPUS.parent / "make_corpus.py"), run_name="__main__")
    assert out.getvalue() == demo.CORPUS.read_text(encoding="utf-8")


def test_a_stage_runs_its_command_in_a_child_process_and_a_failure_names_its_log(tmp_path, capsys):
    demo.run_stage("dflash-extract", "dflash.extract.cli", ["--help"], tmp_path / "help.log")
    log = (tmp_path / "help.log").read_text()
    assert "Usage: dflash-extract" in log and "--target-model" in log
    with pytest.raises(demo.DemoError) as failed:
        demo.run_stage("dflash-train", "dflash.train.cli", ["--no-such-flag"], tmp_path / "bad.log")
    assert failed.value.code == "demo.stage-failed"
    assert failed.value.fields == {"stage": "dflash-train", "status": 2, "log": str(tmp_path / "bad.log")}
    assert "--no-such-flag" in capsys.readouterr().err  # the log's last lines


def stages_in(zygote):
    """`demo.run_stage` as a forked run of the session's zygote: the same entry point, argv and
    log, without a new interpreter's imports (the child process itself: the test above)."""
    progs = {"dflash.extract.cli": "extract", "dflash.train.cli": "train"}

    def run_stage(name, module, args, log_path):
        run = zygote.run(progs[module], args)
        status = run.wait(timeout=600)
        log_path.write_text(run.output())
        if status != 0:
            raise demo.DemoError(f"{name} failed with status {status}; the whole log is {log_path}.")

    return run_stage


@pytest.mark.slow
def test_small_demo_runs_the_whole_pipeline_and_reaches_tau_2(tmp_path, zygote, monkeypatch):
    monkeypatch.setattr(demo, "run_stage", stages_in(zygote))
    demo.claim_workdir(tmp_path)  # the work directory of an earlier demo
    stale = tmp_path / "run" / "checkpoints" / "step-00000099"  # that demo's run (other sizes)
    stale.mkdir(parents=True)
    (stale / "trainer_state.json").write_text("{}")
    result = demo.run_demo(tmp_path, demo.SMALL, seed=0, log=lambda *_: None)
    assert not stale.exists()  # a rerun of the demo starts its drafter run anew

    # (a) target saved in HF format; (b) completions with 0/1 loss masks; (c)-(e) cache, run, export.
    assert (tmp_path / "target" / "config.json").is_file()
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(records) == demo.SMALL.num_completions
    for r in records[:20]:
        mask = r["loss_mask"]
        assert len(mask) == len(r["input_ids"]) and mask[0] == 0 and mask[-1] == 1
        assert mask == sorted(mask)  # prompt zeros, then completion ones
    assert (tmp_path / "run" / "final" / "config.json").is_file()

    # (f) held-out prompts: lossless, and the drafter accepts >= 2 tokens per cycle on average.
    [report] = result["eval"]["prompt_sets"]
    assert report["lossless"]["identical"]
    assert report["tau"] >= 2.0, report
    assert json.loads((tmp_path / "demo_report.json").read_text())["eval"]["prompt_sets"][0]["tau"] == report["tau"]


def user_files(workdir):
    """A directory of someone's own target/, run/ and completions.jsonl: the names the demo writes."""
    (workdir / "target").mkdir(parents=True)
    (workdir / "target" / "config.json").write_text('{"my": "model"}')
    (workdir / "run" / "final").mkdir(parents=True)
    (workdir / "run" / "final" / "notes.txt").write_text("my run")
    (workdir / "completions.jsonl").write_text('{"mine": 1}\n')
    return {p: p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}


def test_a_workdir_holding_files_the_demo_did_not_write_is_refused_and_nothing_in_it_deleted(tmp_path, monkeypatch):
    def no_stage(*args, **kwargs):
        raise AssertionError("a refused work directory runs no stage")

    monkeypatch.setattr(demo, "prepare_target", no_stage)
    before = user_files(tmp_path / "mine")
    with pytest.raises(InputError) as refused:
        demo.run_demo(tmp_path / "mine", demo.SMALL, log=lambda *_: None)
    assert refused.value.code == "demo.workdir-not-a-demo" and refused.value.fields["dir"] == str(tmp_path / "mine")
    assert {"completions.jsonl", "run/", "target/"} <= set(refused.value.fields["holds"])
    assert {p: p.read_bytes() for p in sorted((tmp_path / "mine").rglob("*")) if p.is_file()} == before


def test_a_new_or_empty_workdir_becomes_the_demos_and_stays_its_own_on_every_rerun(tmp_path):
    (tmp_path / "empty").mkdir()
    for workdir in (tmp_path / "new" / "demo", tmp_path / "empty"):
        demo.claim_workdir(workdir)
        assert (workdir / demo.WORKDIR_MARKER).is_file()
        (workdir / "run").mkdir()  # what the demo writes there next
        demo.claim_workdir(workdir)  # a rerun in it


def test_the_workdir_of_a_demo_from_before_the_marker_is_still_the_demos(tmp_path):
    earlier = tmp_path / "earlier"
    for name in ("target", "cache", "run"):
        (earlier / name).mkdir(parents=True)
    report = {"sizes": {}, "seed": 0, "completions": {}, "timings_s": {}, "eval": {}}
    (earlier / "demo_report.json").write_text(json.dumps(report))
    demo.claim_workdir(earlier)
    assert (earlier / demo.WORKDIR_MARKER).is_file()
    (earlier / "demo_report.json").unlink()  # without its report, the same names are anybody's
    (earlier / demo.WORKDIR_MARKER).unlink()
    with pytest.raises(InputError) as refused:
        demo.claim_workdir(earlier)
    assert refused.value.code == "demo.workdir-not-a-demo" and refused.value.fields["dir"] == str(earlier)
    assert refused.value.fields["holds"] == ["cache/", "run/", "target/"]


def test_shipped_target_is_the_default_sizes_model_and_is_used_without_training(tmp_path, monkeypatch):
    sizes = demo.DemoSizes()
    assert demo.shipped_target_fits(sizes, seed=0)
    assert not demo.shipped_target_fits(sizes, seed=1)
    assert demo.shipped_target_fits(demo.SMALL, seed=0)  # --small uses it too
    assert not demo.shipped_target_fits(demo.DemoSizes(target_steps=10), seed=0)
    padded = demo.DemoSizes(vocab_size=1024)  # a padded vocabulary is never the shipped target's
    assert not demo.shipped_target_fits(padded, seed=0)
    assert demo.build_target(padded).get_output_embeddings().weight.shape[0] == 1024
    with pytest.raises(UsageError) as below:
        demo.build_target(demo.DemoSizes(vocab_size=demo.vocab_size() - 1))
    assert below.value.code == "demo.vocab-below-alphabet"
    assert below.value.fields == {"vocab_size": demo.vocab_size() - 1, "alphabet": demo.vocab_size()}
    built = demo.build_target(sizes).config
    shipped = json.loads((demo.SHIPPED_TARGET / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert shipped[key] == getattr(built, key), key

    def no_training(*args, **kwargs):
        raise AssertionError("the shipped target fits: nothing is trained")

    monkeypatch.setattr(demo, "train_target", no_training)
    model, loss = demo.prepare_target(tmp_path / "target", [], sizes, 0, train_anew=False, log=lambda *_: None)
    assert loss < 0.5  # a trained model: the corpus' next-character loss starts near 4.9
    assert sorted(p.name for p in (tmp_path / "target").iterdir()) == sorted(
        p.name for p in demo.SHIPPED_TARGET.iterdir() if p.name != demo.SHIPPED_TARGET_INFO)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in demo.build_target(sizes).parameters())
    with pytest.raises(AssertionError, match="nothing is trained"):
        demo.prepare_target(tmp_path / "anew", ["abc"], sizes, 0, train_anew=True, log=lambda *_: None)


def test_train_target_learns_the_corpus():
    sizes = demo.DemoSizes(hidden_size=32, target_layers=2, target_steps=60, batch_size=8, seq_len=64)
    torch.manual_seed(0)
    model = demo.build_target(sizes)
    losses = []
    demo.train_target(model, demo.load_documents()[:200], sizes, seed=0, log=losses.append)
    first, last = (float(line.split("loss")[1]) for line in (losses[0], losses[-1]))
    assert first > 4.0 and last < 3.3, losses  # from uniform over ~94 characters to the corpus' statistics
