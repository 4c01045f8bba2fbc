"""`dflash-demo`: the whole pipeline on CPU in about 80 s on 2 cores, from a corpus the package ships.

Steps (each writes into the work directory, see docs/demo.md):

1. the target: a small character-level Qwen3 trained on `data/corpus.txt`, saved in HF
   format. The package ships the one the default sizes and seed 0 give (`data/target/`,
   made by `dflash-demo --train-target`), so a first run starts at step 2; other sizes, other
   seeds or `--train-target` train it anew;
2. let that target complete prompts from the corpus (greedy) and write them as tokenized JSONL
   with loss masks (prompt 0, completion 1);
3. `dflash-extract` the target's hidden states of those completions into a cache;
4. `dflash-train` a drafter (block size 8, 2 draft layers) from the cache; it exports `run/final`;
5. `dflash-eval` the exported drafter on held-out prompts: tau, speedup, lossless check.

Everything is seeded; no network is used.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from dflash.eval.config import EvalConfig
from dflash.eval.run import format_report, run_eval
from dflash.eval.speculative import DecodeConfig, target_generate
from dflash.runtime.errors import EnvironmentFault, InputError, UsageError
from dflash.runtime.findings import Finding
from dflash.runtime.fsio import TEMP_PREFIX

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
SHIPPED_TARGET = Path(__file__).parent / "data" / "target"
SHIPPED_TARGET_INFO = "demo_target.json"
"""Beside the shipped target's weights: the sizes and seed it was trained with, and its last loss."""
TARGET_SIZE_FIELDS = ("hidden_size", "target_layers", "target_steps", "batch_size", "seq_len")
SPECIALS = ["<pad>", "<bos>", "<eos>", "<mask>"]
CHARS = "\n !\"#'()*+,-./0123456789:;<=>?[]_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


class DemoError(EnvironmentFault):
    """The demo cannot run here: its shipped data is missing, or one of its stages failed."""


@dataclass(kw_only=True)
class DemoSizes:
    """How big each stage of the demo is."""

    hidden_size: int = 128
    """Target (and drafter) width."""
    target_layers: int = 4
    """Decoder layers of the target."""
    target_steps: int = 400
    """Optimizer steps of target training (batch_size x seq_len tokens each)."""
    batch_size: int = 32
    """Target training windows per step."""
    seq_len: int = 128
    """Target training window length (tokens)."""
    num_completions: int = 1200
    """Target-generated training samples for the drafter."""
    completion_tokens: int = 96
    """Longest completion the target writes per training sample."""
    drafter_layers: int = 2
    """Draft decoder layers."""
    drafter_steps: int = 400
    """dflash-train --max-steps."""
    drafter_lr: float = 3e-3
    """dflash-train --lr (a tiny drafter and few steps take a larger rate than the 6e-4 default)."""
    max_anchors: int = 16
    """dflash-train --max-anchors: blocks per sample per step (keeps a CPU step small)."""
    drafter_batch_size: int = 32
    """dflash-train --max-batch-size."""
    block_size: int = 8
    """Drafted block size."""
    eval_prompts: int = 24
    """Held-out prompts for dflash-eval."""
    eval_new_tokens: int = 96
    """dflash-eval --max-new-tokens."""
    vocab_size: int = 0
    """Target vocabulary: 0 for the alphabet's ids (rounded up to 64); larger pads it with ids no
    text uses, for a target trained anew (bench/bench_vocab_weighting.py)."""


SMALL = DemoSizes(num_completions=300, completion_tokens=48, drafter_steps=160, drafter_batch_size=16,
                  eval_prompts=6, eval_new_tokens=48)
"""The reduced run of `--small` (tests): the shipped target, fewer completions, a shorter drafter run."""
TARGET_LAYER_IDS = (1, 2)  # strictly increasing, at most N-2 of the 4-layer target


# -- the work directory -----------------------------------------------------------------------

WORKDIR_MARKER = ".dflash-demo"
"""Written into the work directory on its first use: what the demo finds there is its own."""
DEMO_OUTPUTS = frozenset({"target", "completions.jsonl", "heldout_prompts.jsonl", "cache", "run", "extract.log",
                          "train.log", "demo_report.json"})
"""What a demo writes into its work directory (docs/demo.md)."""
REPORT_KEYS = ("sizes", "seed", "completions", "timings_s", "eval")


def _earlier_demo(workdir: Path, names: list[str]) -> bool:
    """Whether `workdir` is what a demo from before the marker left: its outputs only, with its report."""
    if not set(names) <= DEMO_OUTPUTS | {n for n in names if n.startswith(TEMP_PREFIX)}:
        return False
    try:
        report = json.loads((workdir / "demo_report.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and all(k in report for k in REPORT_KEYS)


def claim_workdir(workdir: Path) -> None:
    """Make `workdir` the demo's, or refuse it (InputError). Every run replaces what the demo
    writes there (target/, cache/, run/, completions.jsonl, ...), so it runs only in a new or
    empty directory, which it marks (`WORKDIR_MARKER`), or in one it marked before (or a
    demo's from before the marker: its outputs only, with its report). A directory that holds
    anything else is refused before anything in it is touched."""
    marker = workdir / WORKDIR_MARKER
    if marker.is_file():
        return
    if workdir.exists() and not workdir.is_dir():
        raise InputError(Finding("demo.workdir-is-file", dir=str(workdir)))
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in workdir.iterdir()) if workdir.is_dir() else []
    if names and not _earlier_demo(workdir, [n.rstrip("/") for n in names]):
        raise InputError(Finding("demo.workdir-not-a-demo", dir=str(workdir), holds=names, marker=WORKDIR_MARKER))
    workdir.mkdir(parents=True, exist_ok=True)
    marker.write_text("dflash-demo's work directory: each run of the demo here replaces what it wrote "
                      "(docs/demo.md).\n")


# -- text -------------------------------------------------------------------------------------


def vocab_size() -> int:
    return 64 * math.ceil((len(SPECIALS) + len(CHARS)) / 64)


def encode(text: str) -> list[int]:
    """Characters -> ids (specials first, then CHARS)."""
    table = {c: i + len(SPECIALS) for i, c in enumerate(CHARS)}
    try:
        return [table[c] for c in text]
    except KeyError as e:
        raise InputError(Finding("demo.character-outside-alphabet", character=e.args[0])) from None


def decode(ids: list[int]) -> str:
    return "".join(CHARS[i - len(SPECIALS)] if i >= len(SPECIALS) else "" for i in ids)


def load_documents(path: Path = CORPUS) -> list[str]:
    """The corpus: documents separated by blank lines."""
    if not path.is_file():
        raise DemoError(Finding("demo.corpus-missing", file=str(path)))
    return [d for d in path.read_text(encoding="utf-8").split("\n\n") if d.strip()]


# -- stage 1: the target ----------------------------------------------------------------------


def build_target(sizes: DemoSizes) -> Any:
    from transformers import AutoModelForCausalLM, Qwen3Config

    if sizes.vocab_size and sizes.vocab_size < vocab_size():
        raise UsageError(Finding("demo.vocab-below-alphabet", vocab_size=sizes.vocab_size, alphabet=vocab_size()))

    heads = max(2, sizes.hidden_size // 32)
    config = Qwen3Config(
        vocab_size=sizes.vocab_size or vocab_size(), hidden_size=sizes.hidden_size, intermediate_size=3 * sizes.hidden_size,
        num_hidden_layers=sizes.target_layers, num_attention_heads=heads, num_key_value_heads=heads // 2 or 1,
        head_dim=sizes.hidden_size // heads, max_position_embeddings=1024, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    return AutoModelForCausalLM.from_config(config)


def train_target(model: Any, documents: list[str], sizes: DemoSizes, seed: int, log: Any = print) -> float:
    """Next-token training on random windows of `<bos> doc <eos> <bos> doc <eos> ...`; returns the last loss."""
    stream = torch.tensor([t for d in documents for t in [BOS_ID, *encode(d), EOS_ID]], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, sizes.target_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / sizes.target_steps))))
    model.train()
    loss_value = float("nan")
    for step in range(sizes.target_steps):
        starts = torch.randint(0, len(stream) - sizes.seq_len, (sizes.batch_size,), generator=g)
        window = torch.stack([stream[s : s + sizes.seq_len] for s in starts.tolist()])
        loss = model(input_ids=window, labels=window).loss  # the model shifts the labels
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_value = float(loss.detach())
        if step % 100 == 0 or step == sizes.target_steps - 1:
            log(f"  target step {step:4d}/{sizes.target_steps}  loss {loss_value:.3f}")
    return loss_value


def shipped_target_fits(sizes: DemoSizes, seed: int) -> bool:
    """Whether the shipped target is the one `train_target` gives for these sizes and seed."""
    info_path = SHIPPED_TARGET / SHIPPED_TARGET_INFO
    if not info_path.is_file():
        return False
    info = json.loads(info_path.read_text())
    return (info["seed"] == seed and not sizes.vocab_size
            and all(info["sizes"][k] == getattr(sizes, k) for k in TARGET_SIZE_FIELDS))


def prepare_target(target_dir: Path, documents: list[str], sizes: DemoSizes, seed: int, train_anew: bool,
                   log: Any = print) -> tuple[Any, float]:
    """Stage 1: the shipped target copied to `target_dir` where it fits, else one trained here
    (an earlier demo's target there is deleted first: `target_dir` is in the demo's own work
    directory, `claim_workdir`).

    Returns the model (float32, on the CPU) and its last training loss."""
    shutil.rmtree(target_dir, ignore_errors=True)
    if not train_anew and shipped_target_fits(sizes, seed):
        from transformers import AutoModelForCausalLM

        info = json.loads((SHIPPED_TARGET / SHIPPED_TARGET_INFO).read_text())
        log(f"[1/5] the shipped {sizes.target_layers}-layer, {sizes.hidden_size}-wide character-level target "
            f"(trained by `dflash-demo --train-target`, seed {seed}; last loss {info['final_loss']:.3f})")
        shutil.copytree(SHIPPED_TARGET, target_dir)
        (target_dir / SHIPPED_TARGET_INFO).unlink()
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
        return model, float(info["final_loss"])
    log(f"[1/5] training a {sizes.target_layers}-layer, {sizes.hidden_size}-wide character-level target "
        f"on {len(documents)} documents")
    torch.manual_seed(seed)
    model = build_target(sizes)
    loss = train_target(model, documents, sizes, seed, log)
    model.save_pretrained(str(target_dir))
    return model, loss


# -- stage 2: completions ---------------------------------------------------------------------


def cut_prompt(document: str, r: random.Random) -> list[int]:
    """`<bos>` + the start of a document: a random cut in its first 40 % (at least 3 characters)."""
    cut = r.randint(3, max(3, int(0.4 * len(document))))
    return [BOS_ID, *encode(document[:cut])]


def write_completions(model: Any, documents: list[str], path: Path, sizes: DemoSizes, seed: int) -> dict[str, int]:
    """Target-generated (greedy) samples: `input_ids` = prompt + completion, `loss_mask` 0/1."""
    r = random.Random(seed)
    prompts = [cut_prompt(d, r) for d in documents[: sizes.num_completions]]
    config = DecodeConfig(max_new_tokens=sizes.completion_tokens, stop_token_ids=(EOS_ID,))
    model.eval()
    tokens = 0
    with open(path, "w") as f:
        for i in range(0, len(prompts), 64):
            batch = prompts[i : i + 64]
            for prompt, gen in zip(batch, target_generate(model, batch, config)):
                ids = prompt + gen.tokens
                tokens += len(ids)
                f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(gen.tokens)}) + "\n")
    return {"samples": len(prompts), "tokens": tokens}


def write_prompts(documents: list[str], path: Path, seed: int) -> None:
    r = random.Random(seed)
    with open(path, "w") as f:
        for d in documents:
            f.write(json.dumps({"input_ids": cut_prompt(d, r)}) + "\n")


# -- stages 3-5: the pipeline's own commands ---------------------------------------------------


def run_stage(name: str, module: str, args: list[str], log_path: Path) -> None:
    """Run the `main` of `module` (the console script's code) in a child process; output to log_path."""
    command = [sys.executable, "-c", f"import sys; sys.argv[0] = {name!r}; from {module} import main; main()", *args]
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        sys.stderr.write(f"--- the last lines of {log_path} ---\n{tail}\n")
        raise DemoError(Finding("demo.stage-failed", stage=name, status=done.returncode, log=str(log_path)))


def drafter_train_args(cache: Path, target_dir: Path, run_dir: Path, sizes: DemoSizes, seed: int) -> list[str]:
    """The `dflash-train` flags of stage 4 (the trainer's defaults otherwise)."""
    return ["--cache", str(cache), "--target-model", str(target_dir), "--output-dir", str(run_dir),
            "--max-steps", str(sizes.drafter_steps), "--block-size", str(sizes.block_size),
            "--num-draft-layers", str(sizes.drafter_layers), "--seed", str(seed), "--epochs", "1000",
            "--lr", str(sizes.drafter_lr), "--max-anchors", str(sizes.max_anchors),
            "--max-batch-size", str(sizes.drafter_batch_size), "--num-workers", "0", "--dtype", "fp32",
            "--device", "cpu", "--save-interval", "0", "--log-interval", "50", "--no-progress", "--no-tensorboard"]


def run_demo(workdir: Path, sizes: DemoSizes, seed: int = 0, log: Any = print,
             train_anew: bool = False) -> dict[str, Any]:
    """All five stages; returns the report (also written to workdir/demo_report.json).

    `train_anew` trains the target even where the shipped one fits `sizes` and `seed`. The
    work directory must be new, empty or the demo's own (`claim_workdir`)."""
    claim_workdir(workdir)
    timings: dict[str, float] = {}
    start = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal start
        timings[name] = round(time.perf_counter() - start, 1)
        log(f"  ({timings[name]:.1f} s)")
        start = time.perf_counter()

    documents = load_documents()
    held_out = documents[-max(sizes.eval_prompts, len(documents) // 20):]
    train_docs = documents[: len(documents) - len(held_out)]
    random.Random(seed).shuffle(train_docs)

    target_dir = workdir / "target"
    target, target_loss = prepare_target(target_dir, train_docs, sizes, seed, train_anew, log)
    lap("target")

    log(f"[2/5] target-generated completions for {sizes.num_completions} corpus prompts")
    data = workdir / "completions.jsonl"
    stats = write_completions(target, train_docs, data, sizes, seed)
    prompts = workdir / "heldout_prompts.jsonl"
    write_prompts(held_out[: sizes.eval_prompts], prompts, seed + 1)
    log(f"  {stats['samples']} samples, {stats['tokens']} tokens -> {data}")
    lap("completions")

    log("[3/5] dflash-extract")
    cache = workdir / "cache"
    run_stage("dflash-extract", "dflash.extract.cli", [
        "--target-model", str(target_dir), "--data", str(data), "--output", str(cache),
        "--target-layer-ids", ",".join(map(str, TARGET_LAYER_IDS)), "--dtype", "fp32", "--device", "cpu",
        "--codec", "bf16", "--num-writers", "0", "--force", "--no-progress"], workdir / "extract.log")
    lap("extract")

    log("[4/5] dflash-train")
    run_dir = workdir / "run"
    # The demo's own run from an earlier demo (of other sizes, or a finished one): start anew,
    # as the target and the cache were (resuming would refuse or train nothing). The work
    # directory is the demo's (claim_workdir), so what is there is an earlier demo's.
    shutil.rmtree(run_dir, ignore_errors=True)
    run_stage("dflash-train", "dflash.train.cli", drafter_train_args(cache, target_dir, run_dir, sizes, seed),
              workdir / "train.log")
    lap("train")

    log("[5/5] dflash-eval on held-out prompts")
    report = run_eval(EvalConfig(target_model=str(target_dir), drafter=str(run_dir / "final"), prompts=[str(prompts)],
                                 max_new_tokens=sizes.eval_new_tokens, batch_size=1, device="cpu", dtype="fp32"))
    log(format_report(report))
    lap("eval")

    result = {"sizes": asdict(sizes), "seed": seed, "target_final_loss": target_loss,
              "completions": stats, "timings_s": timings, "eval": report}
    (workdir / "demo_report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
