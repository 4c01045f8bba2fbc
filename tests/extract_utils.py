"""Helpers shared by the extraction tests: tiny targets, JSONL data, cache contents."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from dflash.cache_tools.reader import CacheReader
from dflash.extract.cli import main as extract_main
from dflash.extract.loop import TEST_SLEEP_ENV

VOCAB = 128


def make_target(path: Path, kind: str = "qwen3", layers: int = 6, seed: int = 0) -> Path:
    """A random-init tiny causal LM saved as a local HF directory (fp32 safetensors)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[kind]
    cfg = cls(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
              max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    return path


def random_records(n: int, seed: int = 0, min_len: int = 1, max_len: int = 80) -> list[dict]:
    """Records cycling through the three loss-mask conventions, with string ids."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(VOCAB) for _ in range(length)]
        p = rng.randint(0, length)
        rec: dict = {"id": f"r{i}", "input_ids": ids}
        if i % 3 == 0:
            rec["loss_mask"] = [0] * p + [1] * (length - p)
        elif i % 3 == 1:
            rec["labels"] = [-100] * p + ids[p:]
        else:
            rec["prompt_len"] = p
        out.append(rec)
    return out


def expected_mask(rec: dict) -> list[int]:
    n = len(rec["input_ids"])
    if "loss_mask" in rec:
        return rec["loss_mask"]
    if "labels" in rec:
        return [int(x != -100) for x in rec["labels"]]
    return [0] * rec["prompt_len"] + [1] * (n - rec["prompt_len"])


def write_jsonl(path: Path, records: list, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(lines)
    else:
        path.write_text(lines)
    return path


def run_cli(args: list[str]):
    """Run dflash-extract in-process; returns click's Result (exit_code, output)."""
    from click.testing import CliRunner

    return CliRunner().invoke(extract_main, [*map(str, args), "--no-progress"], catch_exceptions=False)


def cache_contents(cache_dir: Path) -> dict[int, dict]:
    """sample_id -> {hidden bits, input_ids, loss_mask}; fails on a duplicated sample id."""
    reader = CacheReader(cache_dir)
    out: dict[int, dict] = {}
    for i in range(len(reader)):
        s = reader.read_sample(i)
        assert s["sample_id"] not in out, f"sample {s['sample_id']} is in the cache twice"
        out[s["sample_id"]] = {
            "hidden": s["hidden"].view(torch.int16).numpy().copy(),
            "input_ids": s["input_ids"].numpy(),
            "loss_mask": s["loss_mask"].numpy(),
            **({"last_hidden": s["last_hidden"]} if "last_hidden" in s else {}),
            **({"topk_ids": s["topk_ids"], "topk_logprobs": s["topk_logprobs"]} if "topk_ids" in s else {}),
        }
    return out


def assert_same_contents(a: dict[int, dict], b: dict[int, dict]) -> None:
    assert sorted(a) == sorted(b)
    for sid in a:
        for key in ("hidden", "input_ids", "loss_mask"):
            np.testing.assert_array_equal(a[sid][key], b[sid][key], err_msg=f"sample {sid} {key}")


# Valid ids for the 4-layer targets of these tests (strictly increasing, at most N-2): the
# default layer rule refuses a target that shallow.
LAYER_IDS = [1, 2]
ARGS = ["--dtype", "fp32", "--target-layer-ids", "1,2", "--part-tokens", "120", "--token-budget", "128", "--sort-window-tokens", "0", "--no-progress",
        "--num-writers", "0"]


def start(target, data, out, *extra, sleep: float) -> subprocess.Popen:
    env = {**os.environ, TEST_SLEEP_ENV: str(sleep)}
    cmd = [sys.executable, "-c", "from dflash.extract.cli import main; main()",
           "--target-model", str(target), "--data", str(data), "--output", str(out), *ARGS, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def committed_parts(out) -> list[str]:
    try:
        lines = (out / "manifest.parts.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line.rsplit(" ", 1)[0])["part"] for line in lines if line.strip()]


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)
