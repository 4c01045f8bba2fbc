"""A record's "group" (the document it was cut from) keys the held-out split (issue #34, point 2):
every sample of one group lands on one side, whatever its prompt, so the trainer's held-out
estimate reads documents the drafter never trained on; dflash-prepare and dflash-generate carry
the group to the records they write, and the cache tools keep and check it."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import read_jsonl, write_jsonl
from dflash.cache_tools.cache_set import CacheSet
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.manifest import read_manifest
from dflash.runtime.records import BadRecord, parse_record, parse_sample
from dflash.train.data.heldout import eval_split
from extract_utils import run_cli
from test_split_keys import extract_records, rewrite_record
from test_target_families import VOCAB
from test_top1_share import prompt_key

GROUPS, PER_GROUP = 12, 3


def group_key(group) -> int:
    """The group's split key by hand: blake2b-8 (person dflash-group) of the group as JSON."""
    digest = hashlib.blake2b(json.dumps(group).encode(), digest_size=8, person=b"dflash-group").digest()
    return int.from_bytes(digest, "little", signed=True)


def grouped_records() -> list[dict]:
    """GROUPS documents of PER_GROUP records each, every record with its own prompt, the groups
    interleaved (as prompts cut from files at random arrive); then 6 records without a group."""
    g = torch.Generator().manual_seed(5)
    out = []
    for k in range(GROUPS * PER_GROUP + 6):
        prompt = torch.randint(0, VOCAB, (4 + k % 5,), generator=g).tolist()
        answer = torch.randint(0, VOCAB, (6 + k % 4,), generator=g).tolist()
        rec = {"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)}
        if k < GROUPS * PER_GROUP:
            rec = {"group": f"doc-{k % GROUPS}" if k % 2 else k % GROUPS, **rec}  # strings and integers
        out.append(rec)
    return out


@pytest.fixture(scope="module")
def grouped(tmp_path_factory) -> dict:
    return extract_records(tmp_path_factory.mktemp("grouped"), grouped_records())


def test_a_group_is_a_string_or_an_integer_and_anything_else_is_a_bad_record():
    line = lambda group: json.dumps({"group": group, "input_ids": [1, 2, 3], "prompt_len": 1}).encode()  # noqa: E731
    assert parse_sample(line("a.py"), 10)[2] == "a.py" and parse_sample(line(7), 10)[2] == 7
    assert parse_sample(json.dumps({"input_ids": [1], "prompt_len": 0}).encode(), 10)[2] is None
    ids, mask = parse_record(line("a.py"), 10)  # the two-value form is unchanged
    assert ids.tolist() == [1, 2, 3] and mask.tolist() == [0, 1, 1]
    for bad in (True, [1], {"a": 1}, 1.5):
        with pytest.raises(BadRecord) as err:
            parse_sample(line(bad), 10)
        assert err.value.code == "runtime.record-group-type"


def test_every_sample_of_a_group_has_its_groups_key_and_the_record_lists_them(grouped):
    manifest = read_manifest(grouped["cache"])
    records = grouped["records"]
    got = {i: k for p in manifest.parts for i, k in zip(p.sample_ids, p.split_keys, strict=True)}
    want = {i: group_key(r["group"]) if "group" in r else prompt_key(r["input_ids"], r["loss_mask"])
            for i, r in enumerate(records)}
    assert got == want
    assert len({got[i] for i, r in enumerate(records) if "group" in r}) == GROUPS
    listed = {p.sample_ids[j] for p in manifest.parts for j in (p.grouped or ())}
    assert listed == {i for i, r in enumerate(records) if "group" in r}


@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_the_split_holds_out_whole_groups(grouped, fraction):
    caches = CacheSet([str(grouped["cache"])], max_seq_len=64)
    train, held = eval_split(caches, fraction)
    ids = caches.sample_ids()
    group_of = {i: r.get("group") for i, r in enumerate(grouped["records"])}
    norm = lambda g: None if g is None else (g if isinstance(g, int) else int(g.split("-")[1]))  # noqa: E731
    sides: dict[int, set[bool]] = {}
    for index, held_out in [(t, False) for t in train] + [(h, True) for h in held]:
        group = norm(group_of[int(ids[index])])
        if group is not None:
            sides.setdefault(group, set()).add(held_out)
    assert all(len(s) == 1 for s in sides.values())  # no group on both sides
    assert {True, False} <= set().union(*sides.values())  # and both sides hold some


def test_the_startup_summary_counts_the_groups_it_holds_out(grouped, tmp_path):
    from conftest import tiny_train_config
    from dflash.train.data.caches import open_training_data

    cfg = tiny_train_config(grouped["cache"], grouped["target"], tmp_path / "run", eval_fraction=0.4)
    data = open_training_data(cfg, rank=0, world_size=1, pin_memory=False)
    data.loader.close()
    ids = data.caches.sample_ids()
    held = {grouped["records"][int(i)].get("group") for i in ids[data.eval_indices]} - {None}
    held = {g if isinstance(g, int) else int(g.split("-")[1]) for g in held}
    assert 0 < len(held) < GROUPS
    assert f"({len(held)} of {GROUPS} record groups held out whole)" in data.summary()
    assert data.caches.grouped().sum() == GROUPS * PER_GROUP


def test_verify_passes_a_grouped_cache_recompress_keeps_the_groups_and_an_edit_is_still_named(grouped, tmp_path):
    verify = CliRunner().invoke(cache_main, ["verify", str(grouped["cache"]), "--no-progress"])
    assert verify.exit_code == 0, verify.output
    dst = tmp_path / "fp8"
    result = CliRunner().invoke(cache_main, ["recompress", str(grouped["cache"]), str(dst), "--codec", "fp8",
                                             "--no-progress"])
    assert result.exit_code == 0, result.output
    view = lambda c: [(p.sample_ids, p.split_keys, p.grouped) for p in read_manifest(c).parts]  # noqa: E731
    assert view(dst) == view(grouped["cache"])
    # A key edited on a sample keyed by its prompt is still found; the grouped ones are not flagged.
    cache = Path(shutil.copytree(grouped["cache"], tmp_path / "edited"))
    manifest = read_manifest(cache)
    line, part = next((n, p) for n, p in enumerate(manifest.parts)
                      if len(p.grouped or ()) < p.samples)
    j = next(j for j in range(part.samples) if j not in set(part.grouped or ()))
    rewrite_record(cache, line, lambda r: {"split_keys": tuple(k ^ 1 if n == j else k for n, k in enumerate(r.split_keys))})
    verify = CliRunner().invoke(cache_main, ["verify", str(cache), "--no-progress"])
    assert verify.exit_code == 1 and f"{part.name} split_keys" in verify.output, verify.output
    assert f"(first: sample {j})" in verify.output


def test_a_bad_group_names_the_file_and_line(grouped, tmp_path):
    records = [{"input_ids": [1, 2, 3], "prompt_len": 1}, {"group": [1], "input_ids": [1, 2], "prompt_len": 1}]
    data = write_jsonl(tmp_path / "bad.jsonl", records)
    result = run_cli(["--target-model", grouped["target"], "--data", data, "--output", tmp_path / "c",
                      "--dtype", "fp32", "--target-layer-ids", "1,3", "--num-writers", "0"])
    assert result.exit_code != 0
    assert "bad.jsonl" in result.output and "line 2" in result.output and "group must be" in result.output


def test_prepare_and_generate_carry_the_group(tmp_path):
    from chat_utils import QWEN3_TEMPLATE, make_tokenizer
    from dflash.prepare.cli import main as prepare_main
    from dflash.prepare.formats import Conversation, iter_conversations

    tok = tmp_path / "tok"
    make_tokenizer(tok, QWEN3_TEMPLATE)
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": "a", "group": "doc-1", "messages": messages},
                                                 {"id": "b", "messages": messages}])
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(prepare_main, ["--target-model", str(tok), "--data", str(data), "--output", str(out),
                                               "--no-progress"])
    assert result.exit_code == 0, result.output
    a, b = read_jsonl(out)
    assert a["group"] == "doc-1" and "group" not in b and a["input_ids"] == b["input_ids"]
    [conv, _] = list(iter_conversations([data]))
    assert isinstance(conv, Conversation) and conv.group == "doc-1"
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "c", "group": 1.5, "messages": messages}])
    [(where, problem)] = list(iter_conversations([bad]))
    assert where == f"{bad}, line 1" and problem.code == "prepare.record-field-type" and problem.fields["field"] == "group"
    # --group-key takes the group from another field of the source records.
    data = write_jsonl(tmp_path / "conv.jsonl", [{"id": "a", "conversation_id": 42, "messages": messages}])
    out = tmp_path / "out2.jsonl"
    result = CliRunner().invoke(prepare_main, ["--target-model", str(tok), "--data", str(data), "--output", str(out),
                                               "--group-key", "conversation_id", "--no-progress"])
    assert result.exit_code == 0, result.output
    [rec] = read_jsonl(out)
    assert rec["group"] == 42 and "conversation_id" not in rec


def test_the_quality_benchmark_names_each_prompts_file_as_its_group():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "quality"))
    import corpus
    import stages
    from vocab import Encoded

    docs = [Encoded(np.arange(40 * (k + 1), dtype=np.int32) % 50, np.arange(0, 40 * (k + 1), 5)) for k in range(5)]
    sources: list[int] = []
    with_sources = corpus.cut_prompts(docs, 20, [6], seed=3, tail=4, sources=sources)
    assert with_sources == corpus.cut_prompts(docs, 20, [6], seed=3, tail=4)  # the same draws
    assert len(sources) == 20 and len(set(sources)) > 1
    for prompt, k in zip(with_sources, sources):  # each prompt is a piece of the document it names
        text = docs[k].tokens.tolist()
        assert any(text[i: i + 6] == prompt for i in range(len(text) - 5))

    class Lines:
        def __init__(self):
            self.lines = []

        def write(self, s):
            self.lines.append(json.loads(s))

    f = Lines()
    stages._write_completions(f, with_sources[:3], [[1, 2]] * 3, sources[:3])
    assert [r["group"] for r in f.lines] == [f"file-{k}" for k in sources[:3]]
    f = Lines()
    stages._write_completions(f, with_sources[:3], [[1, 2]] * 3)
    assert all("group" not in r for r in f.lines)
    assert stages.preset().record_groups and not stages.preset(small=True).record_groups


def test_a_split_of_few_groups_is_warned_of_with_a_fraction_that_holds_out_more(grouped, tmp_path, monkeypatch):
    from conftest import tiny_train_config
    from dflash.train.data import caches as data_module

    def caveats(fraction: float) -> tuple[dict, int]:
        cfg = tiny_train_config(grouped["cache"], grouped["target"], tmp_path / f"run-{fraction}", eval_fraction=fraction)
        data = data_module.open_training_data(cfg, rank=0, world_size=1, pin_memory=False)
        data.loader.close()
        return {f.code: f.fields for f in data.caveats()}, data.heldout_groups[0]

    found, held = caveats(0.2)
    assert 0 < held < GROUPS
    warned = found["train.few-heldout-groups"]
    assert warned["held"] == held
    suggested = warned["eval_fraction"]
    assert suggested > 0.2
    assert caveats(suggested)[1] > held  # the fraction it names holds out more groups
    monkeypatch.setattr(data_module, "FEW_HELDOUT_GROUPS", held)  # enough groups: no warning
    assert "train.few-heldout-groups" not in caveats(0.2)[0]


def test_the_last_line_of_a_run_says_when_its_heldout_tau_rests_on_few_documents(grouped, tmp_path, capsys,
                                                                                 monkeypatch):
    from conftest import tiny_train_config
    from dflash.train.data import caches as data_module
    from dflash.train.run.loop import train

    cfg = dict(eval_fraction=0.2, eval_interval=2, max_steps=2, save_interval=2)
    train(tiny_train_config(grouped["cache"], grouped["target"], tmp_path / "few", **cfg))
    last = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done: ")][-1]
    assert "holds the best held-out checkpoint" in last and "too few to trust within 10 %" in last
    assert "whole group(s) of the records (documents)" in last and "dflash-eval" in last
    # prompt lookup's walk over the same held-out samples stands beside the drafter's tau
    import json
    evals = [json.loads(line) for line in (tmp_path / "few" / "metrics.jsonl").read_text().splitlines()]
    best = max((r for r in evals if r.get("kind") == "eval"), key=lambda r: r["heldout_tau"])
    assert best["tau_lookup"] >= 1.0
    assert (f"prompt lookup, which needs no training, {best['tau_lookup']:.3f} on the same samples: the drafter "
            f"reads {best['heldout_tau'] / best['tau_lookup']:.2f}x it") in last
    monkeypatch.setattr(data_module, "FEW_HELDOUT_GROUPS", 1)  # enough groups: the line says nothing of them
    train(tiny_train_config(grouped["cache"], grouped["target"], tmp_path / "enough", **cfg))
    last = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done: ")][-1]
    assert "holds the best held-out checkpoint" in last and "too few" not in last


def test_the_heldout_interval_resamples_the_held_out_groups_whole(grouped, tmp_path, monkeypatch):
    """The evaluation hands the interval each walked sample's cluster: its group's split key
    (a prompt's own key when it has no group), so that a document's samples are drawn together."""
    import dflash.train.measure.evaluation as evaluation
    from conftest import tiny_train_config
    from dflash.train.run.loop import train

    seen = []
    real = evaluation.walk_interval
    monkeypatch.setattr(evaluation, "walk_interval", lambda rows, tau: seen.append(rows) or real(rows, tau))
    train(tiny_train_config(grouped["cache"], grouped["target"], tmp_path / "run", eval_fraction=0.4,
                            eval_interval=1, max_steps=1))
    rows = seen[-1]
    manifest = read_manifest(grouped["cache"])
    keys = {k % (1 << 52) for p in manifest.parts for j, k in enumerate(p.split_keys) if j in set(p.grouped or ())}
    clusters = [r[3] for r in rows]
    assert len(rows) > 0 and all(len(r) == 4 for r in rows)
    in_groups = [c for c in clusters if c in keys]
    assert len(set(in_groups)) < len(in_groups)  # several samples of one group: one cluster
    assert set(clusters) - keys  # the ungrouped samples are clusters of their own prompts
