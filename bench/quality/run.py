"""Drafter quality: a benchmark the project owns, from a fixed seed and no network.

Stages (each resumable: a stage already recorded in WORKDIR/stages/ is skipped):

  target    learn the vocabulary (a byte-level BPE of 8,192 ids, or --vocab bytes) and train a
            Qwen3 LM on a domain of the installed packages (torch, transformers, numpy): their
            Python sources (--domain code) or their docstrings' English (--domain prose, also
            sympy and networkx), files split by a hash of their path; report its held-out loss
  generate  its completions (greedy and sampled batches alternate) of prompts cut from training
            files, each record naming its file as its "group" (so the trainer's split holds out
            whole files; --set record_groups=0: by prompt only, as before), evaluation prompts cut
            from held-out files, and greedy fp32 completions of those (decoded_set) and of other
            held-out prompts (estimate_set)
  extract   dflash-extract the hidden states of the completions, estimate_set and decoded_set
  train     dflash-train a drafter per --variant, with the trainer's defaults: its held-out
            estimate comes from its own held-out split of the training data (a variant
            with `--eval-cache estimate_cache` reads greedy completions of other held-out
            prompts instead, the older estimate)
  eval      dflash-train estimate of each drafter on the decoded prompts' completions (the
            estimate without prompt-sampling noise), then dflash-eval at the block sizes (16
            and 8), prompt lookup beside it
  table     print the table (samples, epochs, GPU-seconds, held-out estimate, taus, speedups)

    python bench/quality/run.py --workdir /dev/shm/dflash-quality                    # all, one H200
    python bench/quality/run.py --workdir /dev/shm/dflash-quality --stages target,generate
    python bench/quality/run.py --workdir /dev/shm/dflash-quality --variant 1 --variant 2
    python bench/quality/run.py --small --workdir /tmp/quality-small --device cpu    # CPU smoke run

A variant is `EPOCHS [dflash-train flags]`, e.g. `--variant "2 --soft-label-weight 0.5"`; a
relative `--cache`/`--eval-cache` value names a cache of the work directory (`--cache
extra_cache`: also the extra sampled completions of `--set extra_samples=N`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from corpus import DOMAINS
from dflash.train.config import OptimizationConfig
from paired import PairingError, compare, read_prompts
from stages import (
    BenchError,
    Sizes,
    Variant,
    Work,
    check_settings,
    preset,
    stage_eval,
    stage_extract,
    stage_generate,
    stage_target,
    stage_train,
)

STAGES = ("target", "generate", "extract", "train", "eval", "table")


def apply_overrides(sizes: Sizes, items: list[str]) -> Sizes:
    """`--set key=value` on a copy of `sizes` (tuples as comma-separated values)."""
    fields = {f.name: f for f in dataclasses.fields(Sizes)}
    changes: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in fields or not _:
            raise BenchError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}.")
        current = getattr(sizes, key)
        try:
            if isinstance(current, bool):  # (bool("0") is True)
                if value.lower() not in ("0", "1", "false", "true", "no", "yes"):
                    raise ValueError(value)
                changes[key] = value.lower() in ("1", "true", "yes")
            elif isinstance(current, tuple):
                kind = type(current[0]) if current else str
                changes[key] = tuple(kind(v) for v in value.split(",") if v)
            else:
                changes[key] = type(current)(value)
        except ValueError:
            raise BenchError(f"--set {item!r}: {value!r} is not a {type(current).__name__}.") from None
    return dataclasses.replace(sizes, **changes)


def parse_variant(text: str) -> Variant:
    words = shlex.split(text)
    try:
        epochs = int(words[0])
    except (IndexError, ValueError):
        raise BenchError(f"--variant {text!r}: expected EPOCHS then dflash-train flags, e.g. '2 --lr 1e-3'.") from None
    return Variant(epochs=epochs, train_args=tuple(words[1:]))


def parse_variants(texts: list[str]) -> list[Variant]:
    """The --variant values; two different ones that would share a run directory are refused."""
    first: dict[str, tuple[str, Variant]] = {}
    variants = []
    for text in texts:
        v = parse_variant(text)
        other = first.setdefault(v.name, (text, v))
        if other[1] != v:
            raise BenchError(f"--variant {text!r} and {other[0]!r} would share the run directory "
                             f"run-{v.name}; change one of them.")
        variants.append(v)
    return variants


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def estimate_for(train: dict[str, Any], block: int) -> float | None:
    """The held-out estimate of decoding at `block`: the walk at the drafter's block, or at half of it."""
    size = train.get("block_size", 16)
    return {size: train.get("heldout_tau"), size // 2: train.get("heldout_tau_half_block")}.get(block)


def replayed_estimate(train: dict[str, Any], ev: dict[str, Any], block: int,
                          key: str = "estimate_same_prompts") -> float | None:
    """`dflash-train estimate` on the decoded prompts' own greedy completions (or, with key
    estimate_other_files, on other held-out files' prompts'), at `block`."""
    size, same = train.get("block_size", 16), ev.get(key) or {}
    return {size: same.get("tau"), size // 2: same.get(f"tau_b{size // 2}")}.get(block)


def ratio_interval(a: float | None, a_span: list[float] | None, b: float | None,
                   b_span: list[float] | None) -> list[float] | None:
    """An approximate 95 % interval of a / b from the two figures' own intervals, taken as
    independent and log-normal: the log-widths add in quadrature (the estimate walks other
    samples than the decoded prompts)."""
    if not (a and b and a_span and b_span) or min(*a_span, *b_span) <= 0:
        return None
    half = math.hypot(math.log(a_span[1] / a_span[0]), math.log(b_span[1] / b_span[0])) / 2
    return [a / b * math.exp(-half), a / b * math.exp(half)]


def _span(interval: list[float] | None) -> str:
    """` (a-b)`: a 95 % bootstrap interval over the decoded prompts, or nothing."""
    return f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else ""


def defaults_variant(trained: list[dict[str, Any]]) -> str | None:
    """The name of the run at dflash-train's defaults (no flags, the default epochs), else of the one
    run without flags (a round at other epochs, EPOCHS=6), else None."""
    epochs = OptimizationConfig.__dataclass_fields__["epochs"].default
    plain = [t for t in trained if not t["train_args"]]
    at_default = [t for t in plain if t["epochs"] == epochs]
    chosen = at_default or (plain if len(plain) == 1 else [])
    return chosen[0]["variant"] if chosen else None


def against_defaults(work: Work, variant: str, base: str | None, block: int) -> str:
    """`+x.x % (lo to hi) (per-prompt +y.y %)`: the variant's pooled tau over the defaults' run's on
    the same prompts, paired (bench/quality/paired.py); "–" for the defaults' run itself or without
    both reports."""
    paths = [work.root / f"eval-{name}-b{block}.json" for name in (base, variant)]
    if base is None or variant == base or not all(p.is_file() for p in paths):
        return "–"
    try:
        c = compare(*(read_prompts(p) for p in paths))
    except PairingError:
        return "–"
    lo, hi = c["interval"]
    return (f"{100 * (c['ratio'] - 1):+.1f} % ({100 * (lo - 1):+.1f} to {100 * (hi - 1):+.1f}) "
            f"(per-prompt {100 * (c['per_prompt_ratio'] - 1):+.1f} %)")


def table(work: Work) -> str:
    """One row per trained variant: samples, epochs, GPU-seconds, then per block size the trainer's
    held-out estimate (and dflash-train estimate over the decoded prompts themselves), the decoded
    tau pooled (tokens / verification cycles, with its 95 % bootstrap interval over the prompts)
    and as the per-prompt mean, estimate / tau, tau / prompt lookup's tau (its interval paired:
    both resampled on the same prompts), the speedup, and prompt lookup's figures."""
    s = work.sizes
    target, data = work.done("target") or {}, work.done("generate") or {}
    blocks = list(s.eval_block_sizes)
    head = ["variant", "samples", "epochs", "train GPU-s", "per-block mean"]
    for b in blocks:
        head += [f"B={b} est. tau", f"B={b} est. (other files)", f"B={b} est. (same prompts)", f"B={b} tau", f"B={b} tau per-prompt mean",
                 f"B={b} vs defaults (paired)", f"B={b} est. / tau", f"B={b} tau / lookup", f"B={b} speedup", f"B={b} lookup tau",
                 f"B={b} lookup per-prompt mean", f"B={b} lookup speedup"]
    head += [f"B={blocks[0]} tau / lookup tau, longest prompts", "est. lookup / lookup tau",
             "split text / training text", "est. text-adjusted / tau",
             "target top-1 p: split / training / decoded prompts", "est. confidence-adjusted / tau", "lossless"]
    rows = []
    trained = [json.loads(path.read_text()) for path in sorted((work.root / "stages").glob("train-*.json"))]
    base = defaults_variant(trained)
    for train in trained:
        evaluated = work.done(f"eval-{train['variant']}") or {}
        ev = evaluated.get("blocks", {})
        row = [" ".join([f"e{train['epochs']}", *train["train_args"]]),  # the epochs and the flags
               str(train.get("train_samples") or data.get("samples", "–")), str(train["epochs"]),
               _fmt(train["seconds"], ".0f") + (f" (up to {train['sharing_gpu']} sharing)" if train.get("sharing_gpu", 1) > 1 else ""),
               _fmt(train.get("heldout_tau_blocks"))]
        shared = " (shared)" if evaluated.get("sharing_gpu", 1) > 1 else ""  # decoded beside other variants
        for b in blocks:
            e = ev.get(str(b), {})
            estimate = estimate_for(train, b)
            at_block = b == train.get("block_size", 16)  # the walk's interval is the drafter's block's
            row += [_fmt(estimate) + _span(train.get("heldout_tau_interval") if at_block else None),
                    _fmt(replayed_estimate(train, evaluated, b, "estimate_other_files")),
                    _fmt(replayed_estimate(train, evaluated, b)),
                    _fmt(e.get("tau")) + _span(e.get("tau_interval")), _fmt(e.get("tau_per_prompt_mean")),
                    against_defaults(work, train["variant"], base, b),
                    _fmt(_ratio(estimate, e.get("tau")), ".3f") + _span(ratio_interval(
                        estimate, train.get("heldout_tau_interval") if at_block else None,
                        e.get("tau"), e.get("tau_interval"))),
                    _fmt(_ratio(e.get("tau"), e.get("lookup_tau"))) + ("x" if e else "") + _span(e.get("tau_vs_lookup_interval")),
                    _fmt(e.get("speedup"), ".2f") + ("x" + shared if e else ""),
                    _fmt(e.get("lookup_tau")), _fmt(e.get("lookup_tau_per_prompt_mean")),
                    _fmt(e.get("lookup_speedup"), ".2f") + ("x" + shared if e else "")]
        first = ev.get(str(blocks[0]), {})  # the longest prompts alone: where a window would show
        row.append("–" if "tau_longest_prompts" not in first else
                   f"{first['tau_longest_prompts']:.2f} / {first['lookup_tau_longest_prompts']:.2f} "
                   f"({first['longest_prompt_tokens']} tokens)")
        # prompt lookup on the split's samples against its decoded tau (what est. / tau would read
        # for a drafter that is prompt lookup), and the split's text against the training text
        row.append(_fmt(_ratio(train.get("heldout_lookup_tau"), first.get("lookup_tau")), ".3f"))
        row.append(_fmt(_ratio(train.get("lookup_text_heldout"), train.get("lookup_text_training")), ".3f"))
        row.append(_fmt(_ratio(train.get("heldout_tau_text_adjusted"), first.get("tau")), ".3f"))
        decoded = (evaluated.get("estimate_same_prompts") or {}).get("confidence")
        sure = [train.get("confidence_heldout"), train.get("confidence_training"), decoded]
        row.append("–" if all(p is None for p in sure) else " / ".join(_fmt(p, ".3f") for p in sure))
        row.append(_fmt(_ratio(train.get("heldout_tau_confidence_adjusted"), first.get("tau")), ".3f"))
        checks = [v for e in ev.values() for v in (e["lossless"], e["lookup_lossless"])]
        row.append("–" if not checks else ("yes" if all(checks) else "NO"))
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    vocab = (f"BPE of {s.vocab_size:,} ids (digest {target.get('vocab_digest', '–')})" if s.vocab == "bpe"
             else f"bytes ({s.vocab_size} ids)")
    about = (f"domain: {s.domain}, vocabulary: {vocab}, {_fmt(target.get('bytes_per_token'))} bytes a token; "
             f"target: {_fmt(target.get('parameters', 0) / 1e6, '.1f')}M parameters, {target.get('train_files', '–')} "
             f"training / {target.get('held_out_files', '–')} held-out files (digest {target.get('corpus_digest', '–')}), "
             f"held-out loss {_fmt(target.get('held_out_loss'), '.3f')} nats/token "
             f"({_fmt(target.get('held_out_bits_per_byte'))} bits/byte; training windows "
             f"{_fmt(target.get('train_loss'), '.3f')}); {data.get('samples', '–')} completions of "
             f"{s.completion_tokens} tokens (half greedy, half T={s.sample_temperature}), {data.get('tokens', '–')} tokens"
             + (f", {data.get('extra_samples')} more sampled (extra_cache)" if data.get("extra_samples") else "")
             + (f", their prompts cut from {data['prompt_files']} prompt files of {data['prompt_file_tokens']:,} tokens "
                f"({data['prompts_per_file_token']:.1f} prompts a token, {data['distinct_prompts']:,} distinct)"
                if data.get("prompt_file_tokens") else "")
             + f"; {data.get('eval_prompts', '–')} held-out "
             f"prompts, greedy, {s.eval_new_tokens} new tokens, batch {s.eval_batch}, prompt lookup n <= {s.lookup_ngram}; "
             "tau: accepted tokens / verification cycles over all prompts (pooled; in parentheses its 95 % "
             "bootstrap interval over the prompts, paired for tau / lookup), per-prompt mean beside it; vs defaults: "
             "the pooled tau over that of the run at dflash-train's defaults (no flags, its default epochs, else the one run "
             "without flags) on the "
             "same prompts, its 95 % interval paired (bench/quality/paired.py); "
             "est.: the trainer's held-out estimate at the exported (best) step, with its 95 % interval over "
             "the samples it walks (its default held-out split "
             "of the training data, unless the variant passes --eval-cache estimate_cache: greedy completions "
             f"of {data.get('estimate_prompts', '–')} other held-out prompts); est. (other files): dflash-train "
             "estimate of the exported drafter over that estimate_cache (files no training sample comes from, "
             "where the default split's samples share files with the training ones); est. (same prompts): "
             "dflash-train estimate of the exported drafter over greedy completions of the decoded prompts "
             "themselves; per-block mean: the old estimator; est. lookup / lookup tau: prompt lookup walked on the samples "
             "the estimate reads, over its decoded tau (est. / tau for a drafter that is prompt lookup); split text / "
             "training text: prompt lookup walked along the held-out samples' text over the training samples' (the "
             "trainer's last line speaks of it beyond 10 %); est. text-adjusted / tau: the trainer's estimate corrected for that "
             "text by a regression on prompt lookup's figures (tau_text_adjusted, docs/train.md), over the decoded tau; "
             "target top-1 p: the target's mean top-1 probability over the loss tokens of the split's samples, of "
             "512 training samples and of the decoded prompts' greedy completions (from the caches' top-k); est. "
             "confidence-adjusted / tau: the estimate corrected for it by the same regression (tau_confidence_adjusted)")
    return "\n".join([about, "", *lines])


def run(work: Work, stages: list[str], variants: list[Variant]) -> str | None:
    check_settings(work)
    for stage in stages:
        if stage == "table":
            continue
        jobs = [(f"{stage}-{v.name}", v) for v in variants] if stage in ("train", "eval") else [(stage, None)]
        for name, variant in jobs:
            if work.done(name) is not None:
                work.log(f"[{name}] done earlier (remove {work.stage_path(name)} to redo)")
                continue
            work.log(f"[{name}]")
            start = time.perf_counter()
            fn = {"target": stage_target, "generate": stage_generate, "extract": stage_extract,
                  "train": stage_train, "eval": stage_eval}[stage]
            result = fn(work) if variant is None else fn(work, variant)
            result["stage_seconds"] = time.perf_counter() - start
            work.record(name, result)
            work.log(f"[{name}] {result['stage_seconds']:.0f} s")
    if "table" not in stages:
        return None
    text = table(work)
    (work.root / "table.md").write_text(text + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/dev/shm/dflash-quality", help="Where every artifact goes.")
    parser.add_argument("--small", action="store_true", help="The CPU smoke run (tiny target, a few hundred samples).")
    parser.add_argument("--domain", choices=DOMAINS, default="code",
                        help="code (Python sources) or prose (docstring English) of the installed packages [default: code].")
    parser.add_argument("--vocab", choices=("bpe", "bytes"), default="bpe",
                        help="The target's vocabulary: a learned BPE (vocab_size ids) or bytes [default: bpe].")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"Comma-separated subset of {','.join(STAGES)}.")
    parser.add_argument("--variant", action="append", default=None,
                        help="'EPOCHS [dflash-train flags]' (repeatable) [default: '2'].")
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... (auto: cuda when available).")
    parser.add_argument("--eval-blocks", default=None,
                        help="Comma-separated block sizes the eval stage decodes at [default: the sizes' eval_block_sizes].")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="Change one of the sizes (see stages.Sizes), e.g. --set completions=4096.")
    args = parser.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    stages = [x.strip() for x in args.stages.split(",") if x.strip()]
    try:
        unknown = [x for x in stages if x not in STAGES]
        if unknown:
            raise BenchError(f"--stages: unknown {unknown}; choose from {', '.join(STAGES)}.")
        variants = parse_variants(args.variant or ["2"])
        sizes = apply_overrides(preset(args.domain, args.vocab, args.small), args.overrides)
        work = Work(Path(args.workdir), sizes, device, log=lambda m: print(m, flush=True),
                    eval_blocks=tuple(int(b) for b in args.eval_blocks.split(",")) if args.eval_blocks else None)
        if work.sizes.cpu_threads and device == "cpu":
            torch.set_num_threads(work.sizes.cpu_threads)  # tiny models: one thread beats contended ones
        work.log(f"bench/quality on {device} ({torch.cuda.get_device_name() if device.startswith('cuda') else platform.processor() or 'cpu'}), "
                 f"torch {torch.__version__}, python {platform.python_version()}")
        text = run(work, stages, variants)
    except BenchError as e:
        print(f"bench/quality: error: {e}", file=sys.stderr)
        return 2
    if text is not None:
        print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
