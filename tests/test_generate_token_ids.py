"""dflash-generate with a server that returns token ids (as vLLM does with return_token_ids).

A stdlib HTTP server stands in for the engine's wire format: it answers with fixed ids, so
these tests check what the client does with them (trust the ids, check the prompt ids, retry a
503), not generation itself, which tests/test_generate_server.py checks against a real server.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from chat_utils import QWEN3_TEMPLATE, make_tokenizer
from click.testing import CliRunner
from conftest import read_jsonl, sigint_once_written, write_jsonl
from dflash.prepare.generate_cli import main as generate_main

ANSWER = [72, 105, 33, 257]  # "Hi!" and <|im_end|>


@pytest.fixture
def engine(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", QWEN3_TEMPLATE)
    state = {"requests": [], "fail_first": 0, "prompt_offset": 0, "delay": 0.0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["requests"].append(body)
            time.sleep(state["delay"])
            if state["fail_first"]:
                state["fail_first"] -= 1
                self.send_response(503)
                self.end_headers()
                return
            prompt = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                             return_dict=True, **body.get("chat_template_kwargs", {}))["input_ids"]
            prompt = [t + state["prompt_offset"] for t in prompt]
            reply = {"choices": [{"message": {"role": "assistant", "content": "Hi!"}, "finish_reason": "stop",
                                  "token_ids": ANSWER}], "prompt_token_ids": prompt}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client timed out first (the timeout test)
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {"url": f"http://127.0.0.1:{server.server_address[1]}", "tok": tok, "dir": tmp_path / "tok", "state": state}
    server.shutdown()


def run(engine, tmp_path, *extra):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": "a", "prompt": "hello"}])
    out = tmp_path / "gen.jsonl"
    result = CliRunner().invoke(generate_main, [
        "--target-model", str(engine["dir"]), "--data", str(data), "--output", str(out), "--server", engine["url"],
        "--no-progress", "--thinking", "off", *extra])
    return result, out


def test_the_servers_token_ids_are_the_record(engine, tmp_path):
    engine["state"]["fail_first"] = 1  # a 503 first: retried
    result, out = run(engine, tmp_path)
    assert result.exit_code == 0, result.output
    assert engine["state"]["requests"][0]["return_token_ids"] is True
    assert engine["state"]["requests"][0]["chat_template_kwargs"] == {"enable_thinking": False}
    assert "retries: 1" in result.output and "HTTP 503 x1" in result.output
    prompt = engine["tok"].apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True, enable_thinking=False)["input_ids"]
    [rec] = read_jsonl(out)
    assert rec["input_ids"] == prompt + ANSWER and rec["loss_mask"] == [0] * len(prompt) + [1] * len(ANSWER)


def test_a_server_tokenizing_prompts_otherwise_is_refused(engine, tmp_path):
    engine["state"]["prompt_offset"] = 1  # as if the server used another template or tokenizer
    result, out = run(engine, tmp_path)
    assert result.exit_code == 2
    assert "chat.jsonl, line 1 (id a)" in result.output and "tokenized the prompt differently" in result.output
    assert read_jsonl(out) == []


def test_a_resume_with_another_served_model_is_refused(engine, tmp_path):
    result, out = run(engine, tmp_path, "--model", "chatA")
    assert result.exit_code == 0, result.output
    assert engine["state"]["requests"][0]["model"] == "chatA"
    before = out.read_bytes()
    refused, _ = run(engine, tmp_path, "--model", "chatB")
    text = " ".join(refused.output.split())
    assert refused.exit_code == 2 and "holds the answers of another model" in text, refused.output
    assert "'chatA'" in text and "'chatB'" in text and engine["url"] in text and "another --output" in text
    assert out.read_bytes() == before
    again, _ = run(engine, tmp_path, "--model", "chatA")
    assert again.exit_code == 0 and "0 records written (1 done before)" in again.output, again.output


def test_a_resume_without_model_names_says_the_served_model_is_not_checked(engine, tmp_path):
    assert run(engine, tmp_path)[0].exit_code == 0
    again, _ = run(engine, tmp_path)
    assert again.exit_code == 0 and "0 records written (1 done before)" in again.output, again.output
    assert "is not checked (pass --model" in " ".join(again.output.split())


def test_ctrl_c_with_requests_in_flight_stops_within_seconds(engine, tmp_path):
    engine["state"]["delay"] = 0.5  # slow answers: requests are in flight when the signal comes
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": f"s{i}", "prompt": f"q{i}"} for i in range(200)])
    out = tmp_path / "gen.jsonl"
    cmd = [sys.executable, "-m", "dflash.prepare.generate_cli", "--target-model", str(engine["dir"]),
           "--data", str(data), "--output", str(out), "--server", engine["url"], "--concurrency", "4", "--no-progress"]
    status, output, stop_s = sigint_once_written(cmd, out, 4, wait_s=60)
    assert stop_s < 3, "the stop took too long"
    assert status == 130, output
    ids = [r["id"] for r in read_jsonl(out)]
    assert 4 <= len(ids) < 200 and len(ids) == len(set(ids))
