"""The tests' toolkit: tiny targets and tiny data built in the test (nothing from a hub), JSONL
writers, and the session's tiny world (one target and one cache, read-only for the tests).

Test modules import the builders by name (`from conftest import make_tiny_target`); the
fixtures are found by pytest. torch and transformers load inside the builders, so collecting a
test that never builds a model does not import them.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import tempfile
from pathlib import Path

import pytest

# One CPU thread for torch in the test process and in every process a test starts (they inherit
# the environment; torch reads it when it loads, after this). The models are tiny, and on a
# machine whose cores are busy a second OpenMP thread mostly waits on the first: a drafter run
# of the demo took 5x the CPU time on 2 threads beside other work. A test that needs another
# thread count says so in the environment of its runs; their idle threads sleep instead of
# spinning (a 2-thread training beside one busy process: 1.76 s spinning, 0.62 s passive).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The weight-file hashes of every tiny target (cache_tools.identity) go to a cache directory of
# this session, not to the user's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="dflash-tests-cache-")

VOCAB = 128
"""Token ids of `random_records` are below this (the vocabulary of `make_tiny_target`'s default)."""

# The tiny world of the trainer tests: a 4-layer target of width 32 and a cache of its layers 1, 2.
HIDDEN, WORLD_VOCAB, TARGET_LAYERS, LAYERS = 32, 64, 4, (1, 2)


# -- tiny targets -------------------------------------------------------------------------------


def make_tiny_target(path: Path, *, family: str = "qwen3", hidden: int = 64, layers: int = 6,
                     vocab: int = VOCAB, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                     intermediate: int | None = None, max_positions: int = 512, tie: bool = False,
                     seed: int = 0, max_shard_size: str | None = None, generation_config: object = None,
                     **config: object) -> Path:
    """A random-init tiny causal LM (`family` qwen3 or llama) saved with save_pretrained to `path`.

    `intermediate` defaults to twice `hidden`; `config` sets further config fields (by their
    transformers names, over the ones above); `generation_config` is saved with the model. The
    same arguments always give the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[family]
    fields = dict(hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                  max_position_embeddings=max_positions, tie_word_embeddings=tie)
    cfg = cls(**{**fields, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    if generation_config is not None:
        model.generation_config = generation_config
    model.save_pretrained(str(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


# -- tiny data ----------------------------------------------------------------------------------


def random_records(n: int, seed: int = 0, min_len: int = 1, max_len: int = 80) -> list[dict]:
    """Records cycling through the three loss-mask conventions (loss_mask, labels, prompt_len),
    with string ids."""
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
    """The loss mask a record of `random_records` stands for."""
    n = len(rec["input_ids"])
    if "loss_mask" in rec:
        return rec["loss_mask"]
    if "labels" in rec:
        return [int(x != -100) for x in rec["labels"]]
    return [0] * rec["prompt_len"] + [1] * (n - rec["prompt_len"])


def write_jsonl(path: Path, records: list, gz: bool = False) -> Path:
    """One line per record (a str is written as it is: a damaged line); gzip with `gz`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(lines)
    else:
        path.write_text(lines)
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- the trainer's tiny world -------------------------------------------------------------------


def tiny_cache_header(*, layers=LAYERS, hidden: int = HIDDEN, target_layers: int = TARGET_LAYERS,
                      vocab: int = WORLD_VOCAB, data: str = "tiny") -> dict:
    from dflash.cache_tools.codecs import HiddenCodec
    from dflash.cache_tools.manifest import make_header

    return make_header(
        target={"path": "tiny-target", "architecture": "Qwen3ForCausalLM", "hidden_size": hidden,
                "num_hidden_layers": target_layers, "vocab_size": vocab},
        target_layer_ids=list(layers), hidden_size=hidden, codec=HiddenCodec(name="bf16"),
        chunk_rows=16, shard_rows=64, data={"name": data},
    )


def write_tiny_cache(path: Path, *, samples: int = 48, parts: int = 4, seed: int = 0, min_len: int = 12,
                     max_len: int = 48, **header_kw) -> Path:
    """A cache of random samples whose completions (loss_mask 1) start after a short prompt."""
    import torch
    from dflash.cache_tools.writer import CacheWriter

    header = tiny_cache_header(**header_kw)
    width = len(header["target_layer_ids"]) * header["hidden"]["hidden_size"]
    writer = CacheWriter(path, header)
    gen = torch.Generator().manual_seed(seed)
    per_part = samples // parts
    for p in range(parts):
        with writer.part_writer(f"part-{p:06d}") as pw:
            for s in range(per_part):
                n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
                ids = torch.randint(0, header["target"]["vocab_size"] - 1, (n,), generator=gen)
                mask = torch.ones(n, dtype=torch.uint8)
                mask[: n // 4] = 0
                hidden = torch.randn(n, width, generator=gen).to(torch.bfloat16)
                pw.add_sample(p * per_part + s, ids, mask, hidden)
    return path


def tiny_train_config(cache: Path | list[Path], target: Path, out: Path, **overrides):
    """A TrainConfig for a drafter of one layer that takes seconds on a CPU."""
    from dflash.train.config import TrainConfig

    values = dict(
        cache=[str(c) for c in (cache if isinstance(cache, list) else [cache])], target_model=str(target),
        output_dir=str(out), num_draft_layers=1, block_size=4, max_anchors=4, token_budget=128,
        max_batch_size=4, max_seq_len=64, shuffle_window=16, num_workers=0, epochs=2, log_interval=1,
        eval_interval=0, save_interval=0, lr=1e-3, progress=False, tensorboard=False,
        attention_backend="sdpa",
    )
    values.update(overrides)
    return TrainConfig.from_dict(values)


def final_weights(run_dir: Path) -> dict:
    """The float32 weights of the run's latest checkpoint."""
    from safetensors.torch import load_file

    latest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return load_file(str(latest / "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


def block_metrics(correct, valid, loss=None) -> dict[str, float]:
    """BlockMetrics of a single batch (train/measure/metrics.py defines them)."""
    from dflash.train.measure.metrics import BlockMetrics

    m = BlockMetrics(block_size=correct.shape[-1] + 1)
    m.update(correct, valid, loss)
    return m.compute()


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> dict[str, Path]:
    """One tiny target and one tiny cache of its layers 1, 2, built once per session (read-only)."""
    root = tmp_path_factory.mktemp("tiny-world")
    target = make_tiny_target(root / "target", hidden=HIDDEN, layers=TARGET_LAYERS, vocab=WORLD_VOCAB,
                              heads=2, kv_heads=1)
    return {"target": target, "cache": write_tiny_cache(root / "cache")}


@pytest.fixture(scope="session")
def zygote(tmp_path_factory):
    """The session's pre-imported process that forks real CLI runs (faults/zygote.py): a test
    that signals or kills a run starts it here in milliseconds instead of a new interpreter's
    seconds of imports."""
    from faults.helpers import Zygote

    z = Zygote(tmp_path_factory.mktemp("cli-runs"))
    yield z
    z.close()


def sigint_once_written(cmd: list[str], out: Path, records: int, *, wait_s: float) -> tuple[int, str, float]:
    """Start `cmd`, send it SIGINT once `out` holds `records` lines (within `wait_s`; it must
    not exit before), and return (exit status, its output, seconds from the signal to its exit)."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + wait_s
    while not (out.exists() and out.read_text().count("\n") >= records) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    output = proc.communicate(timeout=30)[0].decode()
    return proc.returncode, output, time.monotonic() - sent


@pytest.fixture
def traced_kernels(monkeypatch):
    """The head loss's compiled kernels (train/loss/compiled.py: the chunk function, DFlash2's gather-reductions)
    traced by torch.compile as on the GPU, and run by its aot_eager backend: the graphs, their
    symbolic sizes and their arithmetic are what a CUDA run compiles, without inductor's C++
    toolchain on the CPU host."""
    import torch
    from dflash.train.loss import compiled

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "aot_eager"}))
    monkeypatch.setattr(compiled, "_COMPILED", {})
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a rendezvous, below Linux's ephemeral range (32768-60999):
    a port the kernel may hand out to any other connection (gloo's own between ranks, launched a
    moment before) can be taken between this check and the rendezvous binding it, which failed a
    two-launch test with EADDRINUSE on the 2-core host; below that range only another such pick
    can take it."""
    import socket

    pick = random.SystemRandom()  # not the tests' seeded `random`: two picks in a row must differ
    for _ in range(200):
        port = pick.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in 20000-32000 on 127.0.0.1")
