"""Helpers shared by the extraction tests: their target, CLI runs, cache contents (tiny data
and JSONL writers come from conftest.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from conftest import make_tiny_target
from dflash.cache_tools.reader import CacheReader
from dflash.extract.cli import main as extract_main
from dflash.train.data.loader import sample_tensors
from faults.site.fault_points import SLEEP_PER_PART


def make_target(path: Path, kind: str = "qwen3", layers: int = 6, seed: int = 0) -> Path:
    """The extraction tests' target: conftest's tiny LM (width 64, vocabulary 128) of `layers` layers."""
    return make_tiny_target(path, family=kind, layers=layers, seed=seed)


def run_cli(args: list[str]):
    """Run dflash-extract in-process; returns click's Result (exit_code, output)."""
    from click.testing import CliRunner

    return CliRunner().invoke(extract_main, [*map(str, args), "--no-progress"], catch_exceptions=False)


def cache_contents(cache_dir: Path) -> dict[int, dict]:
    """sample_id -> {hidden bits, input_ids, loss_mask}; fails on a duplicated sample id."""
    reader = CacheReader(cache_dir)
    out: dict[int, dict] = {}
    for i in range(len(reader)):
        s = sample_tensors(reader.read_sample(i))
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


def extract(target, data, out, **kw):
    """An in-process extraction with the tests' settings (fp32, layers 1, 2, parts of ~120
    tokens, no sort window, writers in this process); `kw` overrides ExtractConfig fields."""
    from dflash.extract.config import ExtractConfig
    from dflash.extract.pipeline import run_extraction

    return run_extraction(ExtractConfig(**{**dict(
        target_model=str(target), data=str(data), output=str(out), dtype="fp32", target_layer_ids=LAYER_IDS,
        part_tokens=120, token_budget=128, sort_window_tokens=0, progress=False, num_writers=0), **kw}))


def start(zygote, target, data, out, *extra, sleep: float):
    """dflash-extract with the tests' settings as a forked run of `zygote` (the conftest fixture),
    sleeping `sleep` s per part; returns its faults.helpers.Run."""
    argv = ["--target-model", target, "--data", data, "--output", out, *ARGS, *extra]
    return zygote.run("extract", argv, env={SLEEP_PER_PART: str(sleep)})


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
