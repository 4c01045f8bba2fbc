"""dflash-generate --samples-per-prompt N: N records per conversation, sample 0 as a single-sample
run writes it, resume by (source id, sample), the server's seeds, extraction of the samples."""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from chat_utils import QWEN3_TEMPLATE, VOCAB_SIZE, make_tokenizer
from click.testing import CliRunner
from conftest import make_tiny_target, read_jsonl, write_jsonl
from dflash.prepare.backends import sample_seed
from dflash.prepare.generate_cli import main as generate_main

QUESTIONS = [f"question {i} " + "word " * (i % 4) for i in range(7)]
SAMPLED = ["--temperature", "1.0", "--seed", "3"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random-init tiny Qwen3 with the byte tokenizer; printable ASCII, newline and EOS only."""
    from transformers import GenerationConfig

    path = tmp_path_factory.mktemp("samples") / "model"
    tok = make_tokenizer(path, QWEN3_TEMPLATE)
    allowed = set(range(32, 127)) | {10, tok.eos_token_id}
    generation = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  suppress_tokens=[i for i in range(VOCAB_SIZE) if i not in allowed],
                                  do_sample=False)
    return make_tiny_target(path, family="qwen3", hidden=32, layers=4, vocab=VOCAB_SIZE, heads=4, kv_heads=2,
                            head_dim=8, max_positions=1024, generation_config=generation,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "chat.jsonl", [{"id": f"c{i}", "prompt": q} for i, q in enumerate(QUESTIONS)])


def run(target, data, out, *extra):
    return CliRunner().invoke(generate_main, [
        "--target-model", str(target), "--data", str(data), "--output", str(out), "--no-progress",
        "--dtype", "fp32", "--thinking", "off", "--max-tokens", "12", "--batch-size", "3", "--sort-window", "2",
        *extra])


def keys(path) -> Counter:
    return Counter((r["id"].rsplit("#", 1)[0] if r.get("sample") else r["id"], r.get("sample", 0))
                   for r in read_jsonl(path))


def test_three_samples_give_three_records_per_conversation_with_distinct_tokens_and_unique_ids(target, data, tmp_path):
    out = tmp_path / "gen.jsonl"
    result = run(target, data, out, *SAMPLED, "--samples-per-prompt", "3")
    assert result.exit_code == 0, result.output
    records = read_jsonl(out)
    assert len(records) == 21 and len({r["id"] for r in records}) == 21
    assert keys(out) == Counter({(f"c{i}", k): 1 for i in range(7) for k in range(3)})
    for r in records:
        assert ("sample" in r) == (r["id"] != r["id"].split("#")[0])  # sample 0 has no sample key
        assert r["id"] == (f"{r['id'].split('#')[0]}#{r['sample']}" if "sample" in r else r["id"])
    by_conv: dict[str, list] = {}
    for r in records:
        by_conv.setdefault(r["id"].split("#")[0], []).append(r["input_ids"])
    for conv, samples in by_conv.items():  # one prompt, three different answers
        assert len({tuple(s) for s in samples}) == 3, conv
    again = tmp_path / "again.jsonl"  # deterministic: the same command gives the same tokens
    assert run(target, data, again, *SAMPLED, "--samples-per-prompt", "3").exit_code == 0
    assert again.read_bytes() == out.read_bytes()


def test_sample_zero_is_byte_for_byte_the_record_of_a_single_sample_run(target, data, tmp_path):
    single, several = tmp_path / "single.jsonl", tmp_path / "several.jsonl"
    assert run(target, data, single, *SAMPLED).exit_code == 0
    assert run(target, data, several, *SAMPLED, "--samples-per-prompt", "3").exit_code == 0
    lines = several.read_bytes().splitlines(keepends=True)
    zeros = [line for line in lines if b'"sample"' not in line]
    assert sorted(zeros) == sorted(single.read_bytes().splitlines(keepends=True))
    # A single-sample run writes today's record: id, input_ids, loss_mask, finish_reason, compact.
    for line in single.read_bytes().splitlines():
        rec = json.loads(line)
        assert list(rec) == ["id", "input_ids", "loss_mask", "finish_reason"]
        assert line == json.dumps(rec, separators=(",", ":")).encode()


def test_a_single_sample_greedy_record_is_the_targets_greedy_answer(target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": "g", "prompt": "go 0"}])
    out = tmp_path / "gen.jsonl"
    assert run(target, data, out, "--samples-per-prompt", "1").exit_code == 0
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "go 0"}], add_generation_prompt=True,
                                     tokenize=True, enable_thinking=False, return_dict=True)["input_ids"]
    with torch.no_grad():
        answer = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    finish = "stop" if answer[-1] == tok.eos_token_id else "length"
    expected = {"id": "g", "input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer),
                "finish_reason": finish}
    assert out.read_bytes() == json.dumps(expected, separators=(",", ":")).encode() + b"\n"


class Killed(BaseException):
    """Stands in for a kill: nothing after it runs in the generator."""


def test_a_rerun_after_a_kill_mid_run_completes_without_duplicates(target, data, tmp_path, monkeypatch):
    from dflash.prepare import backends

    real, calls = backends.HFBackend.complete_batch, []

    def dies_on_the_fourth_batch(self, requests):
        calls.append(requests[0].sample)
        if len(calls) == 4:
            raise Killed
        return real(self, requests)

    monkeypatch.setattr(backends.HFBackend, "complete_batch", dies_on_the_fourth_batch)
    out = tmp_path / "gen.jsonl"
    with pytest.raises(Killed):
        run(target, data, out, *SAMPLED, "--samples-per-prompt", "3")
    assert calls == [0, 0, 1, 1]  # the window of 6: sample 0 in two batches, then sample 1
    written = keys(out)
    assert sum(written.values()) == 9 and set(written.values()) == {1}
    with open(out, "ab") as f:  # and the kill tore the line it was writing
        f.write(b'{"id":"c0#2","sample":2,"input_ids":[256,11')
    monkeypatch.setattr(backends.HFBackend, "complete_batch", real)
    rerun = run(target, data, out, *SAMPLED, "--samples-per-prompt", "3")
    assert rerun.exit_code == 0, rerun.output
    assert "12 records written (9 done before)" in rerun.output
    assert keys(out) == Counter({(f"c{i}", k): 1 for i in range(7) for k in range(3)})


def test_raising_the_samples_from_one_to_three_adds_exactly_the_missing_ones(target, data, tmp_path):
    out = tmp_path / "gen.jsonl"
    assert run(target, data, out, *SAMPLED).exit_code == 0
    first = out.read_bytes()
    more = run(target, data, out, *SAMPLED, "--samples-per-prompt", "3")
    assert more.exit_code == 0, more.output
    assert "14 records written (7 done before)" in more.output
    assert out.read_bytes().startswith(first)  # append-only: the first records are untouched
    added = read_jsonl(out)[7:]
    assert Counter(r["sample"] for r in added) == {1: 7, 2: 7}
    assert keys(out) == Counter({(f"c{i}", k): 1 for i in range(7) for k in range(3)})
    # The same samples as a run that asked for three from the start.
    fresh = tmp_path / "fresh.jsonl"
    assert run(target, data, fresh, *SAMPLED, "--samples-per-prompt", "3").exit_code == 0
    assert sorted(fresh.read_bytes().splitlines()) == sorted(out.read_bytes().splitlines())
    assert "0 records written (21 done before)" in run(target, data, out, *SAMPLED, "--samples-per-prompt", "3").output


def test_several_greedy_samples_are_refused_with_the_fix(target, data, tmp_path):
    out = tmp_path / "gen.jsonl"
    result = run(target, data, out, "--samples-per-prompt", "3")
    assert result.exit_code == 2
    message = result.output.strip()
    assert "\n" not in message and "Traceback" not in message
    assert "--samples-per-prompt 3 with --temperature 0" in message and "--temperature 0.7" in message
    assert "--samples-per-prompt 1" in message
    assert not out.exists()


def test_a_source_id_that_is_another_records_sample_id_is_refused(target, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": "a", "prompt": "q"}, {"id": "a#2", "prompt": "r"}])
    out = tmp_path / "gen.jsonl"
    result = run(target, data, out, *SAMPLED, "--samples-per-prompt", "3")
    assert result.exit_code == 2 and "'a' and 'a#2'" in result.output and "Rename one" in result.output
    assert run(target, data, out, *SAMPLED, "--samples-per-prompt", "2").exit_code == 0  # a#1 would clash, a#2 not


def test_ranks_each_take_every_other_conversation_with_all_its_samples(target, data, tmp_path, monkeypatch):
    out = tmp_path / "gen.jsonl"
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        result = run(target, data, out, *SAMPLED, "--samples-per-prompt", "2")
        assert result.exit_code == 0, result.output
        assert f"{2 * (4 - rank)} records written" in result.output
    assert keys(out) == Counter({(f"c{i}", k): 1 for i in range(7) for k in range(2)})


def test_extraction_makes_each_sample_a_sample_of_its_own(target, data, tmp_path):
    from dflash.cache_tools.reader import CacheReader
    from dflash.extract.cli import main as extract_main

    gen = tmp_path / "gen" / "train.jsonl"
    assert run(target, data, gen, *SAMPLED, "--samples-per-prompt", "3").exit_code == 0
    records = read_jsonl(gen)
    cache = tmp_path / "cache"
    result = CliRunner().invoke(extract_main, [
        "--target-model", str(target), "--data", str(gen.parent), "--output", str(cache), "--target-layer-ids", "1,2",
        "--dtype", "fp32", "--device", "cpu", "--num-writers", "0", "--no-progress"])
    assert result.exit_code == 0, result.output
    reader = CacheReader(cache)
    samples = [reader.read_sample(i) for i in range(len(reader))]
    assert len(samples) == 21 and len({int(s["sample_id"]) for s in samples}) == 21
    per_conv = Counter()
    for s in samples:  # a cached sample id names its line: each is that record's tokens
        rec = records[int(s["sample_id"])]
        assert s["input_ids"].tolist() == rec["input_ids"]
        per_conv[rec["id"].split("#")[0]] += 1
    assert per_conv == {f"c{i}": 3 for i in range(7)}


@pytest.fixture
def engine(tmp_path):
    """A stand-in OpenAI-compatible server whose answer depends on the request's seed."""
    tok = make_tokenizer(tmp_path / "tok", QWEN3_TEMPLATE)
    state = {"requests": [], "refuse_seed": None}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["requests"].append(body)
            seed = body.get("seed")
            if seed is not None and seed == state["refuse_seed"]:
                self.send_response(404)
                self.end_headers()
                return
            text = f"s{seed}"
            ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            prompt = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                             return_dict=True, **body.get("chat_template_kwargs", {}))["input_ids"]
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                                            "token_ids": ids}], "prompt_token_ids": prompt}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {"url": f"http://127.0.0.1:{server.server_address[1]}", "dir": tmp_path / "tok", "state": state}
    server.shutdown()


def run_server(engine, data, out, *extra):
    return CliRunner().invoke(generate_main, [
        "--target-model", str(engine["dir"]), "--data", str(data), "--output", str(out), "--server", engine["url"],
        "--no-progress", "--thinking", "off", "--concurrency", "4", "--temperature", "0.7", *extra])


def test_the_server_gets_one_request_per_sample_each_with_its_own_seed(engine, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": f"p{i}", "prompt": f"q{i}"} for i in range(4)])
    out = tmp_path / "gen.jsonl"
    seeds = [sample_seed(5, k) for k in range(3)]
    assert seeds[0] == 5 and len(set(seeds)) == 3
    engine["state"]["refuse_seed"] = seeds[2]  # every sample 2 fails for good this time
    result = run_server(engine, data, out, "--seed", "5", "--samples-per-prompt", "3")
    assert result.exit_code == 1 and "(id p0, sample 2)" in result.output
    assert Counter(b["seed"] for b in engine["state"]["requests"]) == {s: 4 for s in seeds}
    assert keys(out) == Counter({(f"p{i}", k): 1 for i in range(4) for k in range(2)})
    engine["state"]["refuse_seed"] = None
    engine["state"]["requests"].clear()
    rerun = run_server(engine, data, out, "--seed", "5", "--samples-per-prompt", "3")
    assert rerun.exit_code == 0, rerun.output
    assert [b["seed"] for b in engine["state"]["requests"]] == [seeds[2]] * 4  # only the missing samples
    records = read_jsonl(out)
    assert keys(out) == Counter({(f"p{i}", k): 1 for i in range(4) for k in range(3)})
    for r in records:  # each record holds the answer to its own sample's seed
        text = bytes(t for t in r["input_ids"][sum(1 for m in r["loss_mask"] if not m):-1]).decode()
        assert text == f"s{seeds[r.get('sample', 0)]}"


def test_without_a_seed_the_server_gets_none_for_any_sample(engine, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": "p", "prompt": "q"}])
    out = tmp_path / "gen.jsonl"
    assert run_server(engine, data, out, "--samples-per-prompt", "2").exit_code == 0
    assert len(engine["state"]["requests"]) == 2 and not any("seed" in b for b in engine["state"]["requests"])
    assert sorted(r["id"] for r in read_jsonl(out)) == ["p", "p#1"]
