"""dflash-generate against a real OpenAI-compatible server (`transformers serve`, CPU, tiny target)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from chat_utils import QWEN3_TEMPLATE, make_chat_target
from click.testing import CliRunner
from conftest import read_jsonl, write_jsonl
from dflash.prepare.generate_cli import main as generate_main

MAX_TOKENS = 16
THINKING_OFF = ["--thinking", "off"]  # passed to the server through chat_template_kwargs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def conversations(n: int) -> list[dict]:
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Answer."}] if i % 3 == 0 else []
        msgs.append({"role": "user", "content": f"question {i}?"})
        if i % 4 == 1:  # multi-turn: the last assistant turn is regenerated on the dataset's history
            msgs += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": f"and {i}?"}]
        msgs.append({"role": "assistant", "content": "to be replaced"})
        out.append({"id": f"c{i}", "messages": msgs})
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One `transformers serve` for the module, on a tiny target saved to a temp directory."""
    pytest.importorskip("fastapi", reason="transformers serve needs the serving extra (dev dependencies)")
    root = tmp_path_factory.mktemp("served")
    model = make_chat_target(root / "model", QWEN3_TEMPLATE)
    data = write_jsonl(root / "chat.jsonl", conversations(12))
    port = _free_port()
    log = open(root / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model), "--port", str(port),
         "--device", "cpu", "--dtype", "float32"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"transformers serve did not start: {(root / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.5)
    yield {"url": url, "model": model, "data": data, "root": root}
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def generate_args(served, output: Path, *extra: str) -> list[str]:
    return ["--target-model", str(served["model"]), "--data", str(served["data"]), "--output", str(output),
            "--max-tokens", str(MAX_TOKENS), "--no-progress", *THINKING_OFF, *extra]


def reference_records(served) -> dict[str, list[int]]:
    """The model's own greedy generate() after each prompt, rendered by the tokenizer itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served["model"])
    model = AutoModelForCausalLM.from_pretrained(served["model"], dtype=torch.float32).eval()
    out = {}
    for rec in read_jsonl(served["data"]):
        prompt = tok.apply_chat_template(rec["messages"][:-1], add_generation_prompt=True, tokenize=True,
                                         enable_thinking=False, return_dict=True)["input_ids"]
        with torch.no_grad():
            seq = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)[0].tolist()
        out[rec["id"]] = (len(prompt), seq)
    return out


@pytest.mark.slow
def test_kill_midway_then_rerun_has_every_record_once_equal_to_generate(served, tmp_path):
    out = tmp_path / "gen.jsonl"
    cmd = [sys.executable, "-m", "dflash.prepare.generate_cli",
           *generate_args(served, out, "--server", served["url"], "--concurrency", "2")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = out.read_text().count("\n")
    assert 3 <= first < 12, "the kill must come midway"
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"({first} done before)" in rerun.stderr
    records = read_jsonl(out)
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(f"c{i}" for i in range(12)) and len(ids) == len(set(ids))
    assert {r["finish_reason"] for r in records} == {"stop", "length"}  # both endings covered
    reference = reference_records(served)
    for r in records:
        prompt_len, seq = reference[r["id"]]
        assert r["input_ids"] == seq, r["id"]  # prompt + the greedy answer (with its EOS when it stopped)
        assert r["loss_mask"] == [0] * prompt_len + [1] * (len(seq) - prompt_len)
        assert r["finish_reason"] == ("length" if len(seq) - prompt_len == MAX_TOKENS and seq[-1] != 257 else "stop")
    served["server_records"] = {r["id"]: r for r in records}


def test_in_process_backend_gives_the_server_backends_records(served, tmp_path):
    if "server_records" not in served:
        pytest.skip("needs the server run of the test above")
    out = tmp_path / "local.jsonl"
    result = CliRunner().invoke(generate_main, generate_args(served, out, "--dtype", "fp32", "--batch-size", "5"))
    assert result.exit_code == 0, result.output
    local = {r["id"]: r for r in read_jsonl(out)}
    assert local == served["server_records"]


def test_closed_port_requests_are_retried_on_the_other_server(served, tmp_path):
    out = tmp_path / "gen.jsonl"
    closed = f"http://127.0.0.1:{_free_port()}"
    data = write_jsonl(tmp_path / "few.jsonl", conversations(4))
    args = generate_args(served, out, "--server", f"{closed},{served['url']}", "--concurrency", "2")
    args[args.index("--data") + 1] = str(data)
    result = CliRunner().invoke(generate_main, args)
    assert result.exit_code == 0, result.output
    assert len(read_jsonl(out)) == 4
    assert "4 records written" in result.output and "0 failed" in result.output
    assert "connection failed" in result.output and f"{closed}: connection failed" in result.output
    retries = int(result.output.split("retries: ")[1].split(";")[0])
    assert retries >= 1


def test_request_timeouts_are_retried_then_counted_as_failed(served, tmp_path):
    out = tmp_path / "gen.jsonl"
    data = write_jsonl(tmp_path / "few.jsonl", conversations(3))
    args = generate_args(served, out, "--server", served["url"], "--request-timeout", "0.001",
                         "--max-retries", "2", "--concurrency", "3")
    args[args.index("--data") + 1] = str(data)
    result = CliRunner().invoke(generate_main, args)
    assert result.exit_code == 1, result.output
    assert "0 records written" in result.output and "3 failed" in result.output
    assert "retries: 6" in result.output and "timed out x9" in result.output
    assert "Rerun the same command" in result.output
    assert read_jsonl(out) == []  # nothing half-written; a rerun retries them
