"""The benchmark's stages. Each reads what the earlier ones left in the work directory and
records its result in `stages/<name>.json` (written last), so that a stage already done is
skipped on a rerun and one run of a few minutes can do one or two stages."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from corpus import (
    Document,
    corpus_digest,
    cut_prompts,
    is_prompt_file,
    load_corpus,
    token_stream,
)
from target import build_target, complete, mean_loss, train_target
from vocab import (
    BYTE_VOCAB_SIZE,
    ByteVocabulary,
    Encoded,
    Vocabulary,
    load_vocabulary,
    train_bpe,
    vocabulary_digest,
)


@dataclass(kw_only=True)
class Sizes:
    """Everything that decides the benchmark's figures (recorded in settings.json)."""

    domain: str = "code"
    """code (the packages' Python sources) or prose (the English of their docstrings): corpus.py."""
    vocab: str = "bpe"
    """bpe (learned from the training documents, vocab_size ids) or bytes (256 and 4 specials)."""
    vocab_size: int = 8192
    """bpe: the learned vocabulary's size; bytes: 260, padded with ids no text uses when larger
    (e.g. 32768, to see what a real target's large vocabulary changes for the drafter)."""
    bpe_train_bytes: int = 32_000_000
    """The BPE is learned from the first this many bytes of the training documents (0: all)."""
    packages: tuple[str, ...] = ("torch", "transformers", "numpy")
    """Installed packages whose `*.py` files are the corpus."""
    held_out_percent: int = 10
    """Share of files (by a hash of their path) that only the evaluation sees."""
    prompt_percent: int = 20
    """Share of the other files (by another hash of their path) that the target never trains on:
    the drafter's training prompts are cut from them, so the target meets them as new text, as it
    meets the evaluation's prompts and as a real target meets its users' prompts. (With 0 the
    prompts come from the target's own training files: a target that memorised them writes its
    training text there and noise on new files, and the drafter learns the wrong half; the prose
    target's loss was 0.42 on its training windows and 3.65 held out.)"""
    max_files: int = 0
    """Keep only the first N training files (0: all)."""
    target_hidden: int = 384
    target_layers: int = 6
    # the target's training: AdamW steps of target_batch windows of target_seq_len tokens
    target_steps: int = 2500
    target_batch: int = 64
    target_seq_len: int = 384
    target_lr: float = 2e-3
    prompt_lengths: tuple[int, ...] = (64, 96, 128)
    """Prompt lengths in tokens (cycled over the batches of completions and the eval prompts)."""
    loss_windows: int = 256
    """Held-out windows of target_seq_len tokens for the target's held-out loss."""
    completions: int = 32768
    """Target-generated drafter training samples (half greedy, half sampled)."""
    sample_temperature: float = 0.7
    record_groups: bool = True
    """Each training record names its prompt's source file as its "group" (runtime/records.py), as
    docs/prepare.md asks of data cut from documents: the trainer's split then holds out whole files.
    False: no groups, the split by prompt only (the benchmark's figures before 2026-12-02's last round)."""
    train_top1_share: float = 0.0
    """dflash-extract --top1-share of the training caches (0: the extractor's default, 0.05): raise it
    to at least a variant's --eval-fraction, so that a larger held-out split keeps the target's top-1."""
    extra_samples: int = 0
    """More sampled completions of every training prompt (completions_extra/, extracted to
    extra_cache): a variant trains on them too with `--cache extra_cache`."""
    completion_tokens: int = 160
    generate_batch: int = 4096
    batches_per_part: int = 2
    """Batches of completions per `completions/part-NNN.jsonl.gz` file."""
    target_layer_ids: tuple[int, ...] = (0, 2, 4)
    """Captured target layers (at most N-2 for an N-layer target, as the serving engines need)."""
    eval_prompts: int = 240
    """Held-out-file prompts dflash-eval decodes. At 40 the pooled tau's 95 % interval was about
    +-15 % (dflash-eval prints it), at 120 a paired comparison's about +-4 % on code; 240 narrow
    both by about 1.4x for some 50 s more decoding a variant. The first 120 are the 120 that
    rounds before 2026-12-04 decoded (one seeded draw after another: more prompts only add)."""
    eval_new_tokens: int = 160
    eval_batch: int = 40
    """Prompts dflash-eval decodes together (left-padded). Batched decoding is lossless and each
    prompt's acceptance lengths are those of decoding it alone (tests/test_eval_lossless.py), so
    tau does not change with it; the speedup columns are then batched figures."""
    estimate_prompts: int = 512
    """Other held-out-file prompts whose greedy fp32 completions make estimate_cache. A variant
    reads it only when it says so (`--eval-cache estimate_cache`: the benchmark's old estimate);
    by default the trainer holds out a share of the training data, as users run it."""
    eval_block_sizes: tuple[int, ...] = (16, 8)
    lookup_ngram: int = 4
    train_args: tuple[str, ...] = ()
    """Extra dflash-train flags every variant gets (sizes for a CPU run)."""
    extract_args: tuple[str, ...] = ()
    """Extra dflash-extract flags."""
    extra_codecs: tuple[str, ...] = ()
    """The completions also extracted with each of these codecs, into cache-CODEC (e.g. nf4): a
    variant trains on one instead of `cache` with `--bench-cache cache-nf4`, so a codec's cost is
    measured on the same completions and target."""
    seed: int = 0
    cpu_threads: int = 0
    """torch threads on CPU, also for the child commands (0: torch's default)."""


FULL = Sizes()
"""One H200: a 16M-parameter target over 8,192 BPE ids, 61M tokens of training (about 100 s:
the byte target's 4,000 steps of 64 x 512 took 156 s, and at this width a BPE token of a
384-token window costs about 1.2x a byte's FLOPs of a 512-byte one), 32,768 completions of
64-128-token prompts."""
SMALL = Sizes(packages=("numpy",), max_files=40, vocab_size=512, target_hidden=64, target_layers=3, target_steps=30,
              target_batch=8, target_seq_len=128, loss_windows=16, completions=256, prompt_lengths=(24, 32, 48),
              completion_tokens=24, generate_batch=64, target_layer_ids=(0, 1), eval_prompts=3, eval_new_tokens=24,
              eval_batch=2, estimate_prompts=12,
              eval_block_sizes=(8, 4),
              train_args=("--num-draft-layers", "1", "--max-batch-size", "16", "--max-anchors", "16",
                          "--num-workers", "0", "--dtype", "fp32", "--lr", "3e-3", "--block-size", "8"),
              extract_args=("--dtype", "fp32", "--num-writers", "0"), cpu_threads=1,
              record_groups=False)
"""The CPU smoke run (seconds of compute; CI): the code path, not the figures. No record groups:
its 8 prompt files are 8 groups, which a 2 % split most often leaves all in training."""

PROSE_PACKAGES = ("torch", "transformers", "numpy", "sympy", "networkx")
"""About 10 MB of docstring prose (sympy and networkx come with torch)."""
BYTES = {"vocab": "bytes", "vocab_size": BYTE_VOCAB_SIZE, "target_steps": 4000, "target_seq_len": 512,
         "prompt_lengths": (64, 96, 128, 160, 192), "sample_temperature": 0.8}
"""The byte-level benchmark of the earlier recipe tables (docs/benchmarks-history.md)."""


def preset(domain: str = "code", vocab: str = "bpe", small: bool = False) -> Sizes:
    """The sizes of a domain and vocabulary, at the H200 size or the CPU smoke size."""
    base = SMALL if small else FULL
    changes: dict[str, Any] = {"domain": domain}
    if domain == "prose" and not small:
        # ~2.5M training tokens: 1,500 steps are ~15 passes already (the target's held-out and
        # training losses, side by side in target.json, say whether it memorised them)
        changes.update(packages=PROSE_PACKAGES, target_steps=1500)
    if vocab == "bytes":
        changes.update({k: v for k, v in BYTES.items() if not small or k in ("vocab", "vocab_size")})
        if domain == "prose" and not small:
            changes["target_steps"] = 1500
    elif vocab != "bpe":
        raise BenchError(f"--vocab {vocab!r}: choose bpe or bytes.")
    return dataclasses.replace(base, **changes)


class BenchError(RuntimeError):
    """A stage failed or the work directory does not match the settings."""


@dataclass
class Work:
    """The work directory and what is known of it."""

    root: Path
    sizes: Sizes
    device: str
    log: Any = print
    eval_blocks: tuple[int, ...] | None = None
    """Block sizes the eval stage decodes at (default: sizes.eval_block_sizes); those above a
    drafter's own block are skipped."""
    _corpus: tuple[list[Document], list[Document]] | None = field(default=None, repr=False)
    _vocab: Vocabulary | None = field(default=None, repr=False)
    _encoded: tuple[list[Encoded], list[Encoded]] | None = field(default=None, repr=False)

    def stage_path(self, name: str) -> Path:
        return self.root / "stages" / f"{name}.json"

    def done(self, name: str) -> dict[str, Any] | None:
        path = self.stage_path(name)
        return json.loads(path.read_text()) if path.is_file() else None

    def record(self, name: str, result: dict[str, Any]) -> dict[str, Any]:
        path = self.stage_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(tmp, path)
        return result

    def child_env(self) -> dict[str, str]:
        threads = self.sizes.cpu_threads
        return {"OMP_NUM_THREADS": str(threads)} if threads and self.device == "cpu" else {}

    def corpus(self) -> tuple[list[Document], list[Document]]:
        if self._corpus is None:
            s = self.sizes
            self._corpus = load_corpus(list(s.packages), s.held_out_percent, s.max_files, domain=s.domain)
        return self._corpus

    def vocab(self) -> Vocabulary:
        """The target's vocabulary: learned here the first time (bpe), else read from target/."""
        if self._vocab is None:
            s = self.sizes
            if s.vocab == "bytes":
                self._vocab = ByteVocabulary(s.vocab_size)
            elif (self.root / "target" / "tokenizer.json").is_file():
                self._vocab = load_vocabulary(s.vocab, s.vocab_size, self.root / "target")
            else:
                start = time.perf_counter()
                self._vocab = train_bpe([d.data for d in self.corpus()[0]], s.vocab_size, s.bpe_train_bytes)
                self.log(f"  BPE of {self._vocab.tokenizer.get_vocab_size()} ids learned in "
                         f"{time.perf_counter() - start:.1f} s (digest {vocabulary_digest(self._vocab)})")
        return self._vocab

    def encoded(self) -> tuple[list[Encoded], list[Encoded]]:
        """The (training, held-out) documents as token ids, kept in WORKDIR/tokens.npz once
        made (encoding tens of MB takes longer than reading them back)."""
        return self._encoded_all()[:2]

    def _encoded_all(self) -> tuple[list[Encoded], list[Encoded], np.ndarray]:
        if self._encoded is None:
            path = self.root / "tokens.npz"
            if path.is_file():
                self._encoded = _read_encoded(path)
            else:
                train, held = self.corpus()
                vocab = self.vocab()
                prompt = np.array([is_prompt_file(d.name, self.sizes.prompt_percent) for d in train], dtype=bool)
                self._encoded = (vocab.encode([d.data for d in train]), vocab.encode([d.data for d in held]), prompt)
                _write_encoded(path, *self._encoded)
        return self._encoded

    def split_training(self) -> tuple[list[Encoded], list[Encoded]]:
        """The training documents as (the target's, the drafter's prompt files): prompt_percent of
        them by a hash of the path; with prompt_percent 0 both are all of them."""
        train, _, prompt = self._encoded_all()
        if not self.sizes.prompt_percent:
            return train, train
        target = [e for e, p in zip(train, prompt) if not p]
        prompts = [e for e, p in zip(train, prompt) if p]
        if not target or not prompts:
            raise BenchError(f"prompt_percent={self.sizes.prompt_percent} leaves {len(target)} target and "
                             f"{len(prompts)} prompt files of {len(train)}; both need at least one.")
        return target, prompts


def _write_encoded(path: Path, train: list[Encoded], held: list[Encoded], prompt: np.ndarray) -> None:
    arrays: dict[str, np.ndarray] = {"train_is_prompt": prompt}
    for split, docs in (("train", train), ("held", held)):
        arrays[f"{split}_tokens"] = np.concatenate([e.tokens for e in docs])
        arrays[f"{split}_token_counts"] = np.array([len(e.tokens) for e in docs], dtype=np.int64)
        arrays[f"{split}_starts"] = np.concatenate([e.line_starts for e in docs])
        arrays[f"{split}_start_counts"] = np.array([len(e.line_starts) for e in docs], dtype=np.int64)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _read_encoded(path: Path) -> tuple[list[Encoded], list[Encoded], np.ndarray]:
    with np.load(path) as z:
        prompt = z["train_is_prompt"]
        out = []
        for split in ("train", "held"):
            tokens = np.split(z[f"{split}_tokens"], np.cumsum(z[f"{split}_token_counts"])[:-1])
            starts = np.split(z[f"{split}_starts"], np.cumsum(z[f"{split}_start_counts"])[:-1])
            out.append([Encoded(t, s) for t, s in zip(tokens, starts)])
    return out[0], out[1], prompt


_BEFORE_SETTING = {"record_groups": False, "train_top1_share": 0.0}
"""What a work directory written before a setting existed did (its settings.json lacks the key)."""


def check_settings(work: Work) -> None:
    """A work directory belongs to one set of sizes: a rerun with others would mix their data."""
    path = work.root / "settings.json"
    want = asdict(work.sizes)
    want = json.loads(json.dumps(want))  # tuples as lists, as read back
    if path.is_file():
        have = {**_BEFORE_SETTING, **json.loads(path.read_text())}
        if have != want:
            diff = sorted(k for k in want if have.get(k) != want[k])
            raise BenchError(f"{work.root} holds a benchmark of other settings ({', '.join(diff)}); "
                             "use another --workdir or remove it.")
        return
    work.root.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(want, indent=2) + "\n")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- stage 1: the target -------------------------------------------------------------------------


def stage_target(work: Work) -> dict[str, Any]:
    s, device = work.sizes, torch.device(work.device)
    train, held = work.corpus()
    work.log(f"corpus ({s.domain}): {len(train)} training files ({sum(len(d.data) for d in train) / 1e6:.1f} MB), "
             f"{len(held)} held-out files ({sum(len(d.data) for d in held) / 1e6:.1f} MB)")
    start = time.perf_counter()
    vocab = work.vocab()
    _, held_enc = work.encoded()
    train_enc, prompt_enc = work.split_training()
    if s.prompt_percent:
        work.log(f"  the target trains on {len(train_enc)} of the training files; the drafter's prompts come from "
                 f"the other {len(prompt_enc)} ({sum(len(e.tokens) for e in prompt_enc) / 1e6:.2f}M tokens)")
    train_stream = token_stream(train_enc, vocab.bos_id, vocab.eos_id)
    held_stream = token_stream(held_enc, vocab.bos_id, vocab.eos_id)
    bytes_per_token = sum(len(d.data) for d in held) / max(1, sum(len(e.tokens) for e in held_enc))
    work.log(f"  {len(train_stream) / 1e6:.1f}M training tokens, {len(held_stream) / 1e6:.2f}M held out "
             f"({bytes_per_token:.2f} bytes a token)")
    model = build_target(s.target_hidden, s.target_layers, s.seed, vocab=vocab)
    params = sum(p.numel() for p in model.parameters())
    trained = train_target(model, train_stream, steps=s.target_steps, batch_size=s.target_batch,
                           seq_len=s.target_seq_len, lr=s.target_lr, seed=s.seed, device=device, log=work.log)
    if device.type == "cuda":
        # The saved weights are bf16 (half the bytes to move) and they are the model measured
        # and sampled below: the drafter's data comes from exactly the target it is evaluated on.
        model.to(torch.bfloat16)
    held_loss = mean_loss(model, held_stream, windows=s.loss_windows, seq_len=s.target_seq_len,
                          seed=s.seed + 1, device=device)
    train_loss = mean_loss(model, train_stream, windows=s.loss_windows, seq_len=s.target_seq_len,
                           seed=s.seed + 2, device=device)
    _sync(work.device)
    seconds = time.perf_counter() - start
    model.save_pretrained(str(work.root / "target"))
    vocab.save(work.root / "target")
    result = {"parameters": params, "domain": s.domain, "vocab": vocab.kind, "vocab_size": vocab.size,
              "vocab_digest": vocabulary_digest(vocab), "mask_token_id": vocab.mask_id, "train_files": len(train), "held_out_files": len(held),
              "target_files": len(train_enc), "prompt_files": len(prompt_enc) if s.prompt_percent else 0,
              "train_bytes": sum(len(d.data) for d in train), "held_out_bytes": sum(len(d.data) for d in held),
              "train_tokens": len(train_stream), "held_out_tokens": len(held_stream),
              "bytes_per_token": bytes_per_token,
              "corpus_digest": corpus_digest(train + held), "held_out_loss": held_loss,
              "held_out_bits_per_byte": held_loss / 0.6931471805599453 / bytes_per_token, "train_loss": train_loss,
              "seconds": seconds, **trained}
    work.log(f"target: {params / 1e6:.1f}M parameters, held-out loss {held_loss:.3f} nats/token "
             f"({result['held_out_bits_per_byte']:.2f} bits/byte), training windows {train_loss:.3f}, {seconds:.0f} s")
    return result


def _load_target(work: Work) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(work.root / "target"), local_files_only=True).to(work.device).eval()


# -- stage 2: completions and evaluation prompts ---------------------------------------------------


def batch_size(s: Sizes) -> int:
    """Completions per generated batch: generate_batch, but at most half of them, so that a set of
    at most generate_batch completions still has its greedy batch and its sampled one (4,096
    completions in one batch of 4,096 were all greedy)."""
    return max(1, min(s.generate_batch, -(-s.completions // 2)))


def cut_batch(s: Sizes, prompt_files: list[Encoded], b: int, sources: list[int] | None = None) -> list[list[int]]:
    """The prompts of the generate stage's batch `b` (its own seed and prompt length), cut from the
    drafter's prompt files; `sources` gets each prompt's file index."""
    size = batch_size(s)
    count = min(size, s.completions - b * size)
    length = s.prompt_lengths[b % len(s.prompt_lengths)]
    return cut_prompts(prompt_files, count, [length], seed=s.seed * 1000 + b, tail=s.completion_tokens,
                       sources=sources)


@dataclass
class PromptPool:
    """How much text the training prompts come from: the drafter's data diversity (prompt_pool.py,
    and the generate stage's record)."""

    file_tokens: int
    prompts: int = 0
    prompt_tokens: int = 0
    seen: set = field(default_factory=set)

    def add(self, prompts: list[list[int]]) -> None:
        self.prompts += len(prompts)
        self.prompt_tokens += sum(len(p) for p in prompts)
        self.seen.update(hash(tuple(p)) for p in prompts)

    def record(self) -> dict[str, Any]:
        return {"prompt_file_tokens": self.file_tokens, "distinct_prompts": len(self.seen),
                "prompts_per_file_token": self.prompt_tokens / max(1, self.file_tokens)}


def stage_generate(work: Work) -> dict[str, Any]:
    """Target completions of prompt-file prompts (batches alternate greedy and sampled; with
    extra_samples, more sampled completions of the same prompts in completions_extra/), and
    evaluation prompts from held-out files."""
    s = work.sizes
    _, held = work.encoded()
    _, train = work.split_training()  # the drafter's prompt files
    model = _load_target(work)
    device = torch.device(work.device)
    start = time.perf_counter()
    size = batch_size(s)
    batches = -(-s.completions // size)
    tokens = extra = 0
    parts, extra_parts = work.root / "completions", work.root / "completions_extra"
    pool = PromptPool(sum(len(e.tokens) for e in train))
    for d in (parts, extra_parts):
        shutil.rmtree(d, ignore_errors=True)
    parts.mkdir()
    if s.extra_samples:
        extra_parts.mkdir()
    for first in range(0, batches, s.batches_per_part):
        name = f"part-{first // s.batches_per_part:03d}.jsonl.gz"
        with gzip.open(parts / name, "wt", compresslevel=6) as f, \
                (gzip.open(extra_parts / name, "wt", compresslevel=6) if s.extra_samples else open(os.devnull, "w")) as fx:
            for b in range(first, min(batches, first + s.batches_per_part)):
                length = s.prompt_lengths[b % len(s.prompt_lengths)]
                # as the evaluation's prompts are cut: where the document goes on for a completion
                sources: list[int] = []
                prompts = cut_batch(s, train, b, sources)
                pool.add(prompts)
                groups = sources if s.record_groups else None
                temperature = 0.0 if b % 2 == 0 else s.sample_temperature
                tokens += _write_completions(f, prompts, complete(model, prompts, s.completion_tokens, temperature,
                                                                  s.seed * 1000 + b, device), groups)
                for k in range(s.extra_samples):  # other samples of the same prompts, other seeds
                    extra += _write_completions(fx, prompts, complete(
                        model, prompts, s.completion_tokens, s.sample_temperature, (s.seed * 1000 + b) * 64 + k + 1,
                        device), groups)
                work.log(f"  completions batch {b + 1}/{batches} ({'greedy' if temperature == 0 else f'T={temperature}'}, "
                         f"prompts of {length} tokens" + (f", {s.extra_samples} more sampled" if s.extra_samples else "")
                         + f")  {time.perf_counter() - start:.0f} s")
    prompts = cut_prompts(held, s.eval_prompts, list(s.prompt_lengths), seed=s.seed + 7, tail=s.eval_new_tokens)
    with open(work.root / "eval_prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"input_ids": p}) + "\n")
    estimate = write_estimate_set(work, estimate_prompts(s, held))
    # The decoded prompts themselves: the estimate of exactly what dflash-eval decodes (per-prompt
    # tau varies widely, so another prompt set alone moves a 40-prompt tau by several percent).
    decoded = write_estimate_set(work, prompts, "decoded_set")
    _sync(work.device)
    return {"samples": s.completions, "tokens": tokens, "extra_samples": s.completions * s.extra_samples,
            "extra_tokens": extra, "eval_prompts": len(prompts),
            "estimate_prompts": estimate, "decoded_prompts": decoded, "prompt_files": len(train), **pool.record(),
            "seconds": time.perf_counter() - start}


def _write_completions(f: Any, prompts: list[list[int]], completions: list[list[int]],
                       groups: list[int] | None = None) -> int:
    """One JSONL record per prompt and its completion (loss on the completion), with `groups`
    (the index of each prompt's training file) as its "group"; tokens written."""
    tokens = 0
    for i, (prompt, new) in enumerate(zip(prompts, completions)):
        tokens += len(prompt) + len(new)
        group = {} if groups is None else {"group": f"file-{groups[i]}"}
        f.write(json.dumps({**group, "input_ids": prompt + new, "loss_mask": [0] * len(prompt) + [1] * len(new)}) + "\n")
    return tokens


def estimate_prompts(s: Sizes, held: list[Encoded]) -> list[list[int]]:
    """The --eval-cache's prompts: `estimate_prompts` held-out-file prompts other than the decoded ones."""
    prompts: list[list[int]] = []
    for i, length in enumerate(s.prompt_lengths):
        n = len(range(i, s.estimate_prompts, len(s.prompt_lengths)))
        prompts += cut_prompts(held, n, [length], seed=s.seed * 1000 + 500 + i, tail=s.eval_new_tokens)
    return prompts


def write_estimate_set(work: Work, prompts: list[list[int]], name: str = "estimate_set") -> int:
    """Greedy completions of `prompts` in WORKDIR/name, as dflash-eval's target-only decoding
    makes them (float32, no autocast, eval_new_tokens): samples a held-out estimate walks."""
    from transformers import AutoModelForCausalLM

    s = work.sizes
    model = AutoModelForCausalLM.from_pretrained(str(work.root / "target"), local_files_only=True,
                                                 dtype=torch.float32).to(work.device).eval()
    out = work.root / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    by_length: dict[int, list[list[int]]] = {}
    for prompt in prompts:  # complete() takes prompts of one length
        by_length.setdefault(len(prompt), []).append(prompt)
    count = 0
    with gzip.open(out / "part-000.jsonl.gz", "wt", compresslevel=6) as f:
        for group in by_length.values():
            for prompt, new in zip(group, complete(model, group, s.eval_new_tokens, 0.0, 0,
                                                   torch.device(work.device), autocast=False)):
                f.write(json.dumps({"input_ids": prompt + new, "loss_mask": [0] * len(prompt) + [1] * len(new)}) + "\n")
                count += 1
    work.log(f"  {name}: {count} greedy completions of held-out prompts")
    return count


# -- stages 3-5: the pipeline's own commands --------------------------------------------------------


def run_command(name: str, module: str, args: list[str], log_path: Path, stdout: Path | None = None,
                env: dict[str, str] | None = None) -> float:
    """`module`'s click `main` (the console script's code) in a child process; wall seconds.
    Output goes to log_path (stdout to `stdout` when given)."""
    command = [sys.executable, "-c", f"import sys; sys.argv[0] = {name!r}; from {module} import main; main()", *args]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        out = open(stdout, "w") if stdout else log
        try:
            done = subprocess.run(command, stdout=out, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        finally:
            if stdout:
                out.close()
    if done.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        raise BenchError(f"{name} failed with status {done.returncode} (full log in {log_path}):\n{tail}")
    return time.perf_counter() - start


def stage_extract(work: Work) -> dict[str, Any]:
    s = work.sizes
    seconds = {}
    sets = [("completions", "cache"), ("estimate_set", "estimate_cache"), ("decoded_set", "decoded_cache")]
    if s.extra_samples:
        sets.append(("completions_extra", "extra_cache"))
    sets += [("completions", f"cache-{codec}") for codec in s.extra_codecs]
    for data, cache in sets:
        codec = cache.removeprefix("cache-") if cache.startswith("cache-") else None
        seconds[cache] = run_command("dflash-extract", "dflash.extract.cli", [
            "--target-model", str(work.root / "target"), "--data", str(work.root / data),
            "--output", str(work.root / cache), "--target-layer-ids", ",".join(map(str, s.target_layer_ids)),
            "--device", work.device, "--no-progress", *s.extract_args, *(("--codec", codec) if codec else ()),
            # read whole by `dflash-train estimate --cache`: the target's top-1 of every sample
            *(("--top1-share", "1") if cache in ("estimate_cache", "decoded_cache")
              else ("--top1-share", f"{s.train_top1_share:g}") if s.train_top1_share else ())],
            work.root / f"extract-{cache}.log", env=work.child_env())
    return {"seconds": seconds["cache"], "estimate_seconds": seconds["estimate_cache"],
            "decoded_seconds": seconds["decoded_cache"], "extra_seconds": seconds.get("extra_cache"),
            **{f"{codec}_seconds": seconds[f"cache-{codec}"] for codec in s.extra_codecs}}


@dataclass(frozen=True)
class Variant:
    """One drafter training run of the table."""

    epochs: int
    train_args: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        extra = "-".join(a.lstrip("-").replace(".", "p") for a in self.train_args)  # --a b --c d: a-b-c-d
        return f"e{self.epochs}" + (f"-{extra}" if extra else "")


WORKDIR_PATH_FLAGS = ("--cache", "--eval-cache")
"""Variant flags whose relative value names a cache of the work directory (`--eval-cache
estimate_cache`: the old estimate over greedy completions of other held-out prompts; `--cache
extra_cache`: the extra sampled completions as well)."""


INIT_DRAFTER_FLAG = "--init-drafter"
"""A variant's --init-drafter whose value is another variant's name (`--init-drafter
e6-drafter-type-dflash`) starts from that variant's export in the work directory (run-NAME/final):
a DFlash2 run warm-started from the DFlash run beside it."""


BENCH_CACHE_FLAG = "--bench-cache"
"""A variant flag of the benchmark's own (not dflash-train's): train on this cache of the work
directory instead of `cache` (`--bench-cache cache-nf4`: the same completions in another codec)."""


def training_cache(work: Work, variant: Variant) -> Path:
    """The cache a variant trains on: `cache`, or the one its --bench-cache names."""
    args = list(variant.train_args)
    name = next((v for a, v in zip(args, args[1:]) if a == BENCH_CACHE_FLAG), "cache")
    if not (work.root / name / "manifest.json").is_file():
        raise BenchError(f"--variant {variant.name}: {BENCH_CACHE_FLAG} {name}: no cache {work.root / name} "
                         "(cache-CODEC needs --set extra_codecs=CODEC before the extract stage).")
    return work.root / name


def variant_args(work: Work, variant: Variant) -> list[str]:
    """The variant's dflash-train flags, a relative cache name made a path of the work directory
    (the benchmark's own --bench-cache is taken out: training_cache reads it)."""
    args = list(variant.train_args)
    if BENCH_CACHE_FLAG in args:
        at = args.index(BENCH_CACHE_FLAG)
        del args[at : at + 2]
    for i, (flag, value) in enumerate(zip(args, args[1:])):
        if flag in WORKDIR_PATH_FLAGS and not Path(value).is_absolute():
            if not (work.root / value / "manifest.json").is_file():
                raise BenchError(f"--variant {variant.name}: {flag} {value}: no cache {work.root / value} "
                                 "(extra_cache needs --set extra_samples=N before the generate stage).")
            args[i + 1] = str(work.root / value)
        if flag == INIT_DRAFTER_FLAG and not Path(value).is_absolute():
            export = work.root / f"run-{value}" / "final"
            if not (export / "config.json").is_file():
                raise BenchError(f"--variant {variant.name}: {flag} {value}: no export {export}; train the "
                                 f"variant {value} first (its run-{value}/final), or give an export's absolute path.")
            args[i + 1] = str(export)
    return args


def stage_train(work: Work, variant: Variant) -> dict[str, Any]:
    s = work.sizes
    run_dir = work.root / f"run-{variant.name}"
    # No --eval-cache unless the variant asks: the trainer's own held-out split of the (half
    # sampled) training data, with its greedy replay against the cached top-1, is what users get.
    seconds = run_command("dflash-train", "dflash.train.cli", [
        "--cache", str(training_cache(work, variant)), "--target-model", str(work.root / "target"),
        "--output-dir", str(run_dir), "--epochs", str(variant.epochs), "--seed", str(s.seed),
        "--mask-token-id", str(work.vocab().mask_id), "--device", work.device, "--save-interval", "0",
        "--no-progress", "--no-tensorboard", *s.train_args, *variant_args(work, variant)],
        work.root / f"train-{variant.name}.log", env=work.child_env())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained_on = re.search(r"(\d+) for training", (work.root / f"train-{variant.name}.log").read_text())
    evals = [r for r in records if r.get("kind") == "eval"]
    trains = [r for r in records if r.get("kind") == "train"]
    last = evals[-1] if evals else {}
    best = next((r for r in evals if r["step"] == last.get("best_step")), last)  # what final/ holds
    return {"variant": variant.name, "epochs": variant.epochs, "train_args": list(variant.train_args),
            "seconds": seconds, "steps": trains[-1]["step"] if trains else None, "best_step": best.get("step"),
            "heldout_tau": best.get("heldout_tau"), "heldout_tau_half_block": best.get(_half_key(best)),
            "heldout_tau_blocks": best.get("tau_blocks"), "estimator": best.get("estimator"),
            "heldout_tau_interval": best.get("tau_interval") or None,  # its 95 % over the samples walked
            "heldout_tau_backbone": best.get("tau_backbone"),  # DFlash2: the backbone's top-1 alone
            # prompt lookup on the samples the estimate walks, and along the held-out and training text
            "heldout_lookup_tau": best.get("tau_lookup"), "lookup_text_heldout": best.get("lookup_text_heldout"),
            "lookup_text_training": best.get("lookup_text_training"),
            "heldout_tau_text_adjusted": best.get("tau_text_adjusted"),  # the estimate corrected by that text
            # the target's mean top-1 probability on the split and on the training text, and the
            # estimate corrected by it
            "confidence_heldout": best.get("confidence_heldout"), "confidence_training": best.get("confidence_training"),
            "heldout_tau_confidence_adjusted": best.get("tau_confidence_adjusted"),
            "heldout_tau_per_sample_mean": best.get("tau_per_sample_mean"),  # beside dflash-eval's per-prompt mean
            "train_tau": trains[-1].get("tau") if trains else None,
            "train_samples": int(trained_on.group(1)) if trained_on else None,  # the data line's count
            "sharing_gpu": sharing_gpu(),
            "block_size": json.loads((run_dir / "final" / "config.json").read_text())["block_size"]}


SHARED_ENV = "DFLASH_QUALITY_SIDE_BY_SIDE"
"""Set by `device.sh side` to the number of variants run at once, and by bench/gpu_round.py to its
--slots: their seconds are shared figures (up to that many jobs on the GPU at once)."""


def sharing_gpu() -> int:
    """How many benchmark processes may have run on the device at once (1: alone)."""
    try:
        return max(1, int(os.environ.get(SHARED_ENV, "1")))
    except ValueError:
        return 1


def _half_key(record: dict[str, Any]) -> str | None:
    return next((k for k in record if k.startswith("tau_b") and k[5:].isdigit()), None)


ESTIMATE_FLAGS = ("--max-anchors", "--token-budget", "--max-batch-size", "--max-seq-len", "--num-workers", "--dtype")
"""The dflash-train flags of a variant that `dflash-train estimate` also takes (its evaluation's settings)."""


ESTIMATE_SETS = {"decoded_cache": ("estimate", "the decoded prompts"),
                 "estimate_cache": ("estimate-other", "other held-out files' prompts")}
"""The caches `dflash-train estimate` reads after each run: (its output's prefix, what it holds)."""


def estimate_over(work: Work, variant: Variant, cache_name: str = "decoded_cache") -> dict[str, Any] | None:
    """`dflash-train estimate` of the variant's final/ over the greedy completions of the decoded
    prompts themselves (decoded_cache), or of `cache_name` (estimate_cache: prompts of held-out
    files other than the decoded ones, which no training sample shares a file with, where the
    trainer's split holds samples of the files it trains on), with the run's own evaluation settings."""
    prefix, what = ESTIMATE_SETS[cache_name]
    cache = work.root / cache_name
    if not (cache / "manifest.json").is_file():
        work.log(f"  no estimate on {what}: {cache} is missing (a work directory from before "
                 "it); redo the generate and extract stages to make it")
        return None
    args = [*work.sizes.train_args, *variant.train_args]
    picked = [x for a, v in zip(args, args[1:]) if a in ESTIMATE_FLAGS for x in (a, v)]
    out = work.root / f"{prefix}-{variant.name}.json"
    seconds = run_command("dflash-train", "dflash.train.cli", [
        "estimate", str(work.root / f"run-{variant.name}" / "final"), "--cache", str(cache),
        "--target-model", str(work.root / "target"), "--device", work.device, *picked, "--json"],
        work.root / f"{prefix}-{variant.name}.log", stdout=out, env=work.child_env())
    r = json.loads(out.read_text())
    half = _half_key(r)
    work.log(f"  estimate on {what}: tau {r['tau']:.2f}" + (f", {half} {r[half]:.2f}" if half else ""))
    return {"tau": r["tau"], **({half: r[half]} if half else {}), "estimator": r["estimator"],
            "walked_samples": r["walked_samples"], "samples": r["samples"], "seconds": seconds,
            "confidence": r.get("confidence_heldout")}  # the target's mean top-1 probability on them


def _longest_tau(per_prompt: list[dict[str, Any]]) -> float:
    """tau over the prompts of the greatest length: their accepted tokens over their cycles."""
    longest = max(p["prompt_tokens"] for p in per_prompt)
    chosen = [p for p in per_prompt if p["prompt_tokens"] == longest]
    return sum(p["accepted_tokens"] for p in chosen) / max(1, sum(p["cycles"] for p in chosen))


def stage_eval(work: Work, variant: Variant) -> dict[str, Any]:
    s = work.sizes
    results = {}
    trained = json.loads((work.root / f"run-{variant.name}" / "final" / "config.json").read_text())["block_size"]
    same_prompts = estimate_over(work, variant)
    other_files = estimate_over(work, variant, "estimate_cache")
    for block in [b for b in (work.eval_blocks or s.eval_block_sizes) if b <= trained]:
        out = work.root / f"eval-{variant.name}-b{block}.json"
        seconds = run_command("dflash-eval", "dflash.eval.cli", [
            "--target-model", str(work.root / "target"), "--drafter", str(work.root / f"run-{variant.name}" / "final"),
            "--prompts", str(work.root / "eval_prompts.jsonl"), "--max-new-tokens", str(s.eval_new_tokens),
            "--ignore-eos", "--block-size", str(block), "--batch-size", str(s.eval_batch), "--device", work.device,
            "--dtype", "float32", "--lookup-ngram", str(s.lookup_ngram), "--json"],
            work.root / f"eval-{variant.name}-b{block}.log", stdout=out, env=work.child_env())
        [r] = json.loads(out.read_text())["prompt_sets"]
        lookup = r["prompt_lookup"]
        results[str(block)] = {
            "tau": r["tau"], "tau_per_prompt_mean": r.get("tau_per_prompt_mean"), "speedup": r["speedup"],
            "lossless": r["lossless"].get("identical"),
            "lookup_tau": lookup["tau"], "lookup_tau_per_prompt_mean": lookup.get("tau_per_prompt_mean"),
            "lookup_speedup": lookup["speedup"],
            "lookup_lossless": lookup["lossless"].get("identical"), "seconds": seconds,
            # 95 % bootstrap intervals over the prompts (dflash-eval's), the ratio's paired
            "tau_interval": r.get("intervals", {}).get("tau"),
            "tau_vs_lookup_interval": r.get("intervals", {}).get("tau_vs_baseline"),
            # the longest prompts alone (the sliding-window comparison's figure)
            "longest_prompt_tokens": max(p["prompt_tokens"] for p in r["per_prompt"]),
            "tau_longest_prompts": _longest_tau(r["per_prompt"]),
            "lookup_tau_longest_prompts": _longest_tau(lookup["per_prompt"]),
        }
        work.log(f"  block {block}: drafter tau {r['tau']:.2f} (per-prompt mean {r['tau_per_prompt_mean']:.2f}; "
                 f"{r['speedup']:.2f}x), prompt lookup tau {lookup['tau']:.2f} ({lookup['speedup']:.2f}x)")
    return {"variant": variant.name, "estimate_same_prompts": same_prompts, "estimate_other_files": other_files,
            "blocks": results,
            "sharing_gpu": sharing_gpu()}
