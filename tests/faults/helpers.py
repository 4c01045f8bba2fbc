"""Shared pieces of the fault campaign: tiny target and data, runs in forked children of a
pre-imported zygote, process-tree checks, and content hashes of caches and drafters."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import conftest
import numpy as np
import torch
from conftest import write_jsonl  # noqa: F401 (the campaign's modules import it from here)
from dflash.cache_tools.manifest import read_manifest
from dflash.cache_tools.reader import CacheReader
from dflash.train.data.loader import sample_tensors

HIDDEN, VOCAB, TARGET_LAYERS, LAYER_IDS = 32, 64, 4, "1,2"
SITE_DIR = Path(__file__).with_name("site")
# Samples up to 40 tokens, parts of at most 100 tokens: ~16 parts for 60 records.
EXTRACT_ARGS = ["--dtype", "fp32", "--target-layer-ids", LAYER_IDS, "--part-tokens", "100", "--sort-window-tokens", "200",
                "--token-budget", "128", "--num-writers", "0", "--no-progress"]
TRAIN_SETTINGS = dict(num_draft_layers=1, block_size=4, max_anchors=4, token_budget=128, max_batch_size=4,
                      max_seq_len=64, shuffle_window=16, num_workers=0, epochs=2, log_interval=1,
                      eval_interval=0, save_interval=4, keep_checkpoints=2, lr=1e-3, progress=False,
                      tensorboard=False, attention_backend="sdpa", noise_type="uniform",
                      noise_start=0.05, noise_end=0.0)


# -- tiny inputs ------------------------------------------------------------------------------


def make_tiny_target(path: Path, *, hidden: int = HIDDEN, layers: int = TARGET_LAYERS, vocab: int = VOCAB,
                     seed: int = 0) -> Path:
    return conftest.make_tiny_target(path, hidden=hidden, layers=layers, vocab=vocab, heads=2, kv_heads=1, seed=seed)


def make_records(n: int, *, seed: int = 0, min_len: int = 8, max_len: int = 40) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        out.append({"input_ids": [rng.randrange(VOCAB) for _ in range(length)],
                    "prompt_len": rng.randint(1, length // 2)})
    return out


def extract_argv(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--target-model", str(target), "--data", str(data), "--output", str(out), *EXTRACT_ARGS, *extra]


def train_config_file(path: Path, cache: Path, target: Path, **overrides) -> Path:
    values = {**TRAIN_SETTINGS, "cache": [str(cache)], "target_model": str(target), **overrides}
    path.write_text(json.dumps(values))
    return path


# -- content hashes ---------------------------------------------------------------------------


def cache_hash(cache_dir: Path) -> str:
    """sha256 over every sample in sample_id order: its id, hidden bits, input_ids and loss_mask.

    Independent of part order and commit order; fails on a sample id stored twice."""
    reader = CacheReader(cache_dir)
    samples = {}
    for i in range(len(reader)):
        s = sample_tensors(reader.read_sample(i))
        assert s["sample_id"] not in samples, f"sample {s['sample_id']} is in {cache_dir} twice"
        samples[s["sample_id"]] = s
    h = hashlib.sha256()
    for sid in sorted(samples):
        s = samples[sid]
        h.update(np.int64(sid).tobytes())
        h.update(s["hidden"].contiguous().view(torch.int16).numpy().tobytes())
        h.update(s["input_ids"].numpy().astype(np.int64).tobytes())
        h.update(s["loss_mask"].numpy().astype(np.uint8).tobytes())
    reader.close()
    return h.hexdigest()


def committed_parts(cache_dir: Path) -> list[str]:
    try:
        return [p.name for p in read_manifest(cache_dir).parts]
    except FileNotFoundError:
        return []


def temp_parts(cache_dir: Path) -> list[str]:
    parts = cache_dir / "parts"
    return sorted(p.name for p in parts.iterdir() if p.name.startswith(".tmp-")) if parts.is_dir() else []


def weights_hash(run_dir: Path) -> str:
    """The name of the run's latest complete checkpoint and the sha256 of its float32 weights
    (the name first: a run that ends without its last step's checkpoint shows as such)."""
    from safetensors.torch import load_file

    latest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    state = load_file(str(latest / "model.safetensors"))
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].contiguous().view(torch.uint8).numpy().tobytes())
    return f"{latest.name}:{h.hexdigest()}"


def complete_checkpoints(run_dir: Path) -> list[str]:
    d = run_dir / "checkpoints"
    return sorted(p.name for p in d.iterdir() if p.name.startswith("step-")) if d.is_dir() else []


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if rec.get("kind") == "train":
            out.append(rec["step"])
    return out


# -- processes --------------------------------------------------------------------------------


def children_of(pid: int) -> set[int]:
    """Direct children of `pid` (from /proc/<pid>/task/*/children)."""
    out: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out |= {int(x) for x in f.read().split()}
        except FileNotFoundError:
            pass
    return out


def descendants_of(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        for c in children_of(todo.pop()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an exited orphan nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.01, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(interval)


class Run:
    """One forked CLI run: its pid, its log, and what it left behind."""

    def __init__(self, zygote: Zygote, pid: int, log: Path):
        self.zygote, self.pid, self.log = zygote, pid, log
        self.status: int | None = None
        self.seen_children: set[int] = set()

    def watch_children(self) -> set[int]:
        """Remember the run's descendants (writers, DataLoader workers) seen so far."""
        self.seen_children |= descendants_of(self.pid)
        return self.seen_children

    def handles(self, signum: int) -> bool:
        """Whether the run has installed a handler for `signum` (SigCgt in /proc/<pid>/status)."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        except (FileNotFoundError, StopIteration):
            return False
        return bool(caught >> (signum - 1) & 1)

    def signal(self, signum: int) -> float:
        self.watch_children()
        os.kill(self.pid, signum)
        return time.monotonic()

    def wait(self, timeout: float = 60.0) -> int | None:
        if self.status is None:
            self.status = self.zygote.wait(self.pid, timeout)
        return self.status

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def surviving_children(self, grace: float = 0.0) -> list[int]:
        deadline = time.monotonic() + grace
        while True:
            left = [p for p in self.seen_children if alive(p)]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)


class Zygote:
    """Client of zygote.py: starts forked runs of dflash-extract / dflash-train."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None):
        self.log_dir = log_dir
        self._count = 0
        self._pids: list[int] = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", **(env or {})}
        # site/ (fault_points and its sitecustomize) for the zygote and every interpreter a run
        # starts afresh (the writers' fork server): the slow points live there, not in the product.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("zygote.py"))], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env, cwd=str(log_dir),
        )
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def run(self, prog: str, argv: list[str], env: dict[str, str] | None = None) -> Run:
        self._count += 1
        log = self.log_dir / f"run-{self._count:04d}-{prog}.log"
        pid = self._ask({"op": "run", "prog": prog, "argv": [str(a) for a in argv], "env": env or {},
                         "log": str(log)})["pid"]
        self._pids.append(pid)
        return Run(self, pid, log)

    def wait(self, pid: int, timeout: float) -> int | None:
        return self._ask({"op": "wait", "pid": pid, "timeout": timeout})["status"]

    def close(self) -> None:
        for pid in self._pids:  # runs a failed test left behind, with their process groups
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
