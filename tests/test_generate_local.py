"""dflash-generate's in-process backend: multi-turn regeneration, truncation, resume rules, Ctrl-C,
length-sorted left-padded batches, sampling from a seed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from chat_utils import QWEN3_TEMPLATE, make_chat_target
from click.testing import CliRunner
from conftest import read_jsonl, sigint_once_written, write_jsonl
from dflash.prepare.generate_cli import main as generate_main


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_chat_target(tmp_path_factory.mktemp("local") / "model", QWEN3_TEMPLATE, seed=0)


def run(target, data, out, *extra):
    return CliRunner().invoke(generate_main, [
        "--target-model", str(target), "--data", str(data), "--output", str(out), "--no-progress",
        "--dtype", "fp32", "--thinking", "off", *extra])


def greedy(model, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)[0, len(prompt):].tolist()


def test_regenerate_all_answers_every_turn_on_the_targets_own_earlier_answers(target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    conv = [{"role": "user", "content": "go 0"}, {"role": "assistant", "content": "old one"},
            {"role": "user", "content": "second?"}, {"role": "assistant", "content": "old two"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": "m", "messages": conv}])
    out = tmp_path / "gen.jsonl"
    result = run(target, data, out, "--regenerate", "all", "--loss-on", "all-assistant", "--max-tokens", "12")
    assert result.exit_code == 0, result.output
    [rec] = read_jsonl(out)
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    render = lambda msgs: tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,  # noqa: E731
                                                  enable_thinking=False, return_dict=True)["input_ids"]
    p1 = render(conv[:1])
    g1 = greedy(model, p1, 12)
    assert g1[-1] == tok.eos_token_id, "the first answer must finish for a second turn to follow"
    first = {"role": "assistant", "content": tok.decode(g1, skip_special_tokens=True)}
    p2 = render([conv[0], first, conv[2]])
    g2 = greedy(model, p2, 12)
    assert rec["input_ids"] == p2 + g2
    # The first answer as the template renders it in the history (its text and end-of-turn),
    # right after the assistant header: the empty think block of its prompt is not kept there.
    start = len(tok(tok.apply_chat_template(conv[:1], tokenize=False) + "<|im_start|>assistant\n",
                    add_special_tokens=False)["input_ids"])
    expected_mask = [0] * len(p2) + [1] * len(g2)
    for k in range(start, start + len(g1)):
        expected_mask[k] = 1
    assert p2[start:start + len(g1)] == g1
    assert rec["loss_mask"] == expected_mask


def test_drop_truncated_records_the_ids_so_a_rerun_skips_them(target, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [
        {"id": f"t{i}", "messages": [{"role": "user", "content": f"go {i}"}, {"role": "assistant", "content": "x"}]}
        for i in range(6)])
    out = tmp_path / "gen.jsonl"
    result = run(target, data, out, "--max-tokens", "3", "--drop-truncated")
    assert result.exit_code == 0, result.output
    written = {r["id"] for r in read_jsonl(out)}
    dropped = {r["id"] for r in read_jsonl(tmp_path / "gen.jsonl.skipped.jsonl")}
    assert dropped and not written & dropped and written | dropped == {f"t{i}" for i in range(6)}
    assert f"length {len(dropped)}" in result.output and "dropped: truncated" in result.output
    again = run(target, data, out, "--max-tokens", "3", "--drop-truncated")
    assert "0 records written (6 done before)" in again.output


def test_a_resume_with_other_sampling_settings_is_refused(target, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": "a", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]}])
    out = tmp_path / "gen.jsonl"
    assert run(target, data, out, "--max-tokens", "4").exit_code == 0
    refused = run(target, data, out, "--max-tokens", "8")
    assert refused.exit_code == 2 and "generation differ" in refused.output and "new --output" in refused.output
    assert run(target, data, out, "--max-tokens", "4", "--thinking", "on").exit_code == 2


@pytest.mark.slow
def test_ctrl_c_stops_within_seconds_and_keeps_the_finished_records(target, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [
        {"id": f"s{i}", "messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": "x"}]}
        for i in range(10)])
    out = tmp_path / "gen.jsonl"
    cmd = [sys.executable, "-m", "dflash.prepare.generate_cli", "--target-model", str(target), "--data", str(data),
           "--output", str(out), "--no-progress", "--dtype", "fp32", "--batch-size", "2", "--max-tokens", "100"]
    status, output, stop_s = sigint_once_written(cmd, out, 2, wait_s=120)
    assert stop_s < 5, "the stop took too long"
    assert status == 130, output
    kept = [r["id"] for r in read_jsonl(out)]
    assert 2 <= len(kept) < 10 and len(kept) == len(set(kept))
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    ids = [r["id"] for r in read_jsonl(out)]
    assert sorted(ids) == sorted(f"s{i}" for i in range(10))


@pytest.mark.slow
def test_ranks_share_one_output_and_each_record_is_written_once(target, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [
        {"id": f"d{i}", "messages": [{"role": "user", "content": f"go {i}"}, {"role": "assistant", "content": "x"}]}
        for i in range(8)])
    out = tmp_path / "gen.jsonl"
    cmd = [sys.executable, "-m", "dflash.prepare.generate_cli", "--target-model", str(target), "--data", str(data),
           "--output", str(out), "--no-progress", "--dtype", "fp32", "--max-tokens", "16", "--thinking", "off"]
    procs = [subprocess.Popen(cmd, env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("4 records written" in o for o in outputs)
    single = tmp_path / "single.jsonl"
    assert run(target, data, single, "--max-tokens", "16").exit_code == 0
    by_id = {r["id"]: r for r in read_jsonl(out)}
    assert len(read_jsonl(out)) == 8 and by_id == {r["id"]: r for r in read_jsonl(single)}


def test_a_rank_that_starts_after_another_wrote_records_resumes_its_output(target, tmp_path, monkeypatch):
    # Rank 1 appends records before rank 0 has looked at the output: the sidecar is there already
    # (each rank checks it, or writes it, under a lock, before its first record).
    data = write_jsonl(tmp_path / "chat.jsonl", [
        {"id": f"d{i}", "messages": [{"role": "user", "content": f"go {i}"}, {"role": "assistant", "content": "x"}]}
        for i in range(4)])
    out = tmp_path / "gen.jsonl"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        result = run(target, data, out, "--max-tokens", "6")
        assert result.exit_code == 0, result.output
        assert "2 records written" in result.output
    assert sorted(r["id"] for r in read_jsonl(out)) == ["d0", "d1", "d2", "d3"]


def test_prompt_only_records_get_the_targets_answer(target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "p", "system": "Be brief.", "prompt": "go 0"}])
    out = tmp_path / "gen.jsonl"
    assert run(target, data, out, "--max-tokens", "12").exit_code == 0
    [rec] = read_jsonl(out)
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go 0"}],
                                     add_generation_prompt=True, tokenize=True, enable_thinking=False,
                                     return_dict=True)["input_ids"]
    answer = greedy(model, prompt, 12)
    assert rec["input_ids"] == prompt + answer and rec["loss_mask"] == [0] * len(prompt) + [1] * len(answer)


def test_a_damaged_output_line_is_named(target, tmp_path):
    # An output dflash-generate wrote (it has its sidecar) whose second line was damaged since:
    # the resume names that line instead of counting or rewriting it.
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": "a", "prompt": "q"}, {"id": "b", "prompt": "r"}])
    out = tmp_path / "gen.jsonl"
    assert run(target, data, out, "--max-tokens", "4").exit_code == 0
    assert (tmp_path / "gen.jsonl.meta.json").exists()
    first = out.read_text().splitlines(keepends=True)[0]
    out.write_text(first + "not json\n")
    result = run(target, data, out, "--max-tokens", "4")
    assert result.exit_code == 2 and "gen.jsonl, line 2" in result.output, result.output
    assert out.read_text() == first + "not json\n"  # nothing rewritten


def test_batches_are_sorted_by_prompt_length_and_each_answer_is_the_prompts_own(target, tmp_path, monkeypatch):
    from dflash.prepare import backends
    from transformers import AutoModelForCausalLM, AutoTokenizer

    questions = [f"q{i} " + "word " * n for i, n in enumerate([1, 9, 4, 12, 0, 6, 3])]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": f"l{i}", "prompt": q} for i, q in enumerate(questions)])
    widths = []
    real = backends.HFBackend.complete_batch

    def spy(self, requests):
        self.render(requests)
        widths.append([len(r.prompt_ids) for r in requests])
        return real(self, requests)

    monkeypatch.setattr(backends.HFBackend, "complete_batch", spy)
    out = tmp_path / "gen.jsonl"
    result = run(target, data, out, "--max-tokens", "10", "--batch-size", "3", "--sort-window", "3")
    assert result.exit_code == 0, result.output
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       enable_thinking=False, return_dict=True)["input_ids"] for q in questions]
    # One window holds all seven: batches of 3, 3 and 1, longest prompts first.
    assert widths == [sorted(map(len, prompts), reverse=True)[k: k + 3] for k in (0, 3, 6)]
    by_id = {r["id"]: r for r in read_jsonl(out)}
    assert sorted(by_id) == sorted(f"l{i}" for i in range(7))
    for i, prompt in enumerate(prompts):  # left padding changes nothing: each is its unbatched greedy answer
        answer = greedy(model, prompt, 10)
        assert by_id[f"l{i}"]["input_ids"] == prompt + answer
        assert by_id[f"l{i}"]["loss_mask"] == [0] * len(prompt) + [1] * len(answer)
    # A window of one batch: input order, window after window, and the same records.
    widths.clear()
    unsorted = tmp_path / "unsorted.jsonl"
    result = run(target, data, unsorted, "--max-tokens", "10", "--batch-size", "3", "--sort-window", "1")
    assert result.exit_code == 0, result.output
    assert widths == [sorted(map(len, prompts[k: k + 3]), reverse=True) for k in (0, 3, 6)]
    assert {r["id"]: r for r in read_jsonl(unsorted)} == by_id


def test_sampling_follows_its_seed_across_batches(target, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": f"s{i}", "prompt": "same question"} for i in range(6)])

    def answers(name, *flags):
        out = tmp_path / name
        result = run(target, data, out, "--max-tokens", "12", "--batch-size", "2", *flags)
        assert result.exit_code == 0, result.output
        return {r["id"]: r["input_ids"] for r in read_jsonl(out)}

    first = answers("a.jsonl", "--temperature", "1.0", "--seed", "3")
    assert answers("b.jsonl", "--temperature", "1.0", "--seed", "3") == first
    assert answers("c.jsonl", "--temperature", "1.0", "--seed", "4") != first
    greedy_answers = answers("d.jsonl")
    assert len(set(map(tuple, greedy_answers.values()))) == 1  # one prompt, one greedy answer
    # Sampled: the six copies of one prompt get different answers, also across the three batches
    # (one random stream from the seed, not the same draws again for each batch).
    assert len(set(map(tuple, first.values()))) == 6


def test_a_prompts_group_is_copied_to_each_of_its_answers(target, tmp_path):
    conv = [{"role": "user", "content": "go 0"}, {"role": "assistant", "content": "old"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": "a", "group": "doc-7", "messages": conv},
                                                 {"id": "b", "messages": conv}])
    out = tmp_path / "gen.jsonl"
    result = run(target, data, out, "--max-tokens", "4", "--samples-per-prompt", "2", "--temperature", "0.7")
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in read_jsonl(out)}
    assert {i: r.get("group") for i, r in records.items()} == {"a": "doc-7", "a#1": "doc-7", "b": None, "b#1": None}


def test_answers_stay_within_the_targets_positions_and_a_prompt_past_them_is_a_reported_skip(target, tmp_path):
    import json
    import shutil

    # The same weights with 80 positions (RoPE: the checkpoint does not fix the count).
    short = shutil.copytree(target, tmp_path / "model-80")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 80}))
    data = write_jsonl(tmp_path / "chat.jsonl", [
        {"id": "short", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "long", "messages": [{"role": "user", "content": "word " * 30}]}])
    out = tmp_path / "gen.jsonl"
    result = run(short, data, out, "--max-tokens", "200")
    assert result.exit_code == 0, result.output
    written = read_jsonl(out)
    assert [r["id"] for r in written] == ["short"]
    assert all(len(r["input_ids"]) <= 80 for r in written)
    skipped = read_jsonl(tmp_path / "gen.jsonl.skipped.jsonl")
    assert [r["id"] for r in skipped] == ["long"]
    assert "leaves no room within the target's 80 positions" in json.dumps(skipped)
