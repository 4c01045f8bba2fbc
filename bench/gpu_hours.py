"""GPU-hours per billion tokens: offline (extract once, then train N epochs) vs an online pipeline.

Reads the figures of bench/bench_extract.py and bench/bench_train.py (each file either the JSON
they write with --json, or their captured output: the last JSON object in it is taken) and
prints one row per extraction codec:

    python bench/gpu_hours.py extract-27b-hybrid.json train-27b.json

How each figure is derived (B = 1e9 tokens, all tokens of a sample counted, prompt included, as
both benches and the online pipeline's rate count them):
  extract     GPU-h = G x B / (full-extraction tokens/s of that codec) / 3600. The rate is
              bench_extract's timed span (first batch to last commit) on one GPU (G = 1), or
              bench_scale.py's aggregate over its G ranks (first batch of any rank to the last
              commit of any rank; its figures carry `gpus`).
  train       GPU-h = P x epochs x B / (context tokens/s) / 3600, where context tokens/s is
              bench_train's rate summed over its P processes (one GPU each). Measured on a bf16
              cache; an fp8 cache changes what the loader decodes, not the step.
  offline     extract + train: the target runs once, the drafter trains `epochs` times over the cache.
  online      G x epochs x B / R / 3600: the online pipeline runs the target again every epoch, at its
              peak of R tokens/s on G GPUs (the pipeline this project replaces: R = 14,500, G = 8; 5 GPUs
              ran the target, 3 the drafter, all 8 are held).
  ratio       online / offline.
Start-up (model load, compilation, writer start) is left out of every figure: per billion tokens
it is minutes against tens to hundreds of hours.

A user's plan (`plan`): disk and GPU-hours for a target shape, token count, epochs, codec and
disk budget, from the measured one-GPU rates of docs/BENCHMARKS.md (or bench JSON files):

    python bench/gpu_hours.py plan --shape 8b --tokens 2e9 --epochs 6 --codec fp8 --disk-budget 10T
    python bench/gpu_hours.py plan --hidden-size 5120 --layers 5 --extract-rate 7805 --train-rate 9933 ...

  disk        tokens x stored bytes/token of the codec (its measured ratio to raw bf16 K x D x 2,
              plus the per-token ids and masks)
  offline     extract once + epochs x train (the cache holds everything)
  follow      --follow with --disk-budget: the trainer reads parts as they are extracted and a
              part is evicted once trained on; with a budget b below the cache's size d, every
              epoch after the first re-extracts the fraction 1 - b/d that was evicted:
              extract x (1 + (epochs - 1)(1 - b/d)) + epochs x train
              (on one GPU the two stages share it at a combined 0.996 of running them one after
              the other, bench_colocate.py on one H200, so the sum holds there too)
  online      the target's forward every epoch on the same GPU as the training (one GPU's rates:
              epochs x (extract + train)), and the seed's online pipeline (R tokens/s on G GPUs)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BILLION = 1e9
ONLINE_TOKENS_PER_SECOND = 14_500.0
ONLINE_GPUS = 8
EPOCHS = 6  # the offline-against-online figure's epochs (docs/BENCHMARKS.md); `plan` takes dflash-train's default


@dataclass(frozen=True)
class Row:
    """One extraction codec's offline GPU-hours per billion tokens against the online pipeline's."""

    what: str
    extract_tokens_per_second: float
    train_tokens_per_second: float
    extract_gpu_hours: float
    train_gpu_hours: float
    online_gpu_hours: float

    @property
    def offline_gpu_hours(self) -> float:
        return self.extract_gpu_hours + self.train_gpu_hours

    @property
    def ratio(self) -> float:
        return self.online_gpu_hours / self.offline_gpu_hours


def read_figures(path: Path) -> dict[str, Any]:
    """The bench's figures in `path`: the whole file as JSON, else the last JSON object that starts a line."""
    text = path.read_text()
    try:
        found = json.loads(text)
    except json.JSONDecodeError:
        decoder, found, pos = json.JSONDecoder(), None, 0
        for line in text.splitlines(keepends=True):
            if line.startswith("{"):
                try:
                    found = decoder.raw_decode(text, pos)[0]
                except json.JSONDecodeError:
                    pass
            pos += len(line)
    if not isinstance(found, dict):
        raise SystemExit(f"{path}: no JSON object of bench_extract.py or bench_train.py in it. Pass the file "
                         "their --json option wrote, or their captured output.")
    return found


def kind(figures: dict[str, Any]) -> str:
    if "extract" in figures and "prefill_tokens_per_second" in figures:
        return "extract"
    if "context_tokens_per_second" in figures:
        return "train"
    raise SystemExit("a JSON object that is neither bench_extract.py's (no 'extract') nor bench_train.py's "
                     "(no 'context_tokens_per_second') figures; check the file names given.")


def gpu_hours(extract: dict[str, Any], train: dict[str, Any], *, epochs: int = EPOCHS,
              online_tokens_per_second: float = ONLINE_TOKENS_PER_SECOND, online_gpus: int = ONLINE_GPUS,
              ) -> list[Row]:
    """One row per codec of `extract` (bench_extract's figures) with `train` (bench_train's)."""
    train_rate = train["context_tokens_per_second"]
    train_hours = train.get("processes", 1) * epochs * BILLION / train_rate / 3600
    online = online_gpus * epochs * BILLION / online_tokens_per_second / 3600
    rows = []
    for codec, fig in extract["extract"].items():
        rate = fig["tokens_per_second"]
        shape = extract["shape"] + (" (small, CPU)" if extract.get("small") else "")
        gpus = extract.get("gpus", 1)
        what = f"{shape}{f' on {gpus} GPUs' if gpus > 1 else ''}, {codec}"
        rows.append(Row(what=what, extract_tokens_per_second=rate,
                        train_tokens_per_second=train_rate, extract_gpu_hours=gpus * BILLION / rate / 3600,
                        train_gpu_hours=train_hours, online_gpu_hours=online))
    return rows


def format_table(rows: list[Row], epochs: int) -> str:
    lines = [f"| target, cache codec | extract tokens/s | extract GPU-h | train context tokens/s | "
             f"{epochs} epochs GPU-h | offline GPU-h | online GPU-h | online / offline |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.what} | {r.extract_tokens_per_second:,.0f} | {r.extract_gpu_hours:,.1f} | "
                     f"{r.train_tokens_per_second:,.0f} | {r.train_gpu_hours:,.1f} | {r.offline_gpu_hours:,.1f} | "
                     f"{r.online_gpu_hours:,.1f} | {r.ratio:.2f}x |")
    return "\n".join(lines)


# Measured one-GPU rates of today's defaults (docs/BENCHMARKS.md, H100 80GB): full-extraction tokens/s
# per codec with the top-8 soft labels stored, training context tokens/s of DFlash2, and each codec's
# stored hidden-state bytes as a fraction of raw bf16 K x D x 2 (bf16 and fp8 on a trained model's
# activations, bench/gpu_benchmarks.sh cache; nf4 by bench/bench_codec4.py). At the 8B shape only bf16
# with the top-8 is measured: fp8 and nf4 take its rate (at the 27B shape fp8 ran at 1.006x bf16).
SHAPES = {
    "8b": {"hidden_size": 4096, "layers": 5, "extract": {"bf16": 27_119.0, "fp8": 27_119.0, "nf4": 27_119.0,
                                                         "raw": 27_119.0}, "train": 18_692.0},
    "27b": {"hidden_size": 5120, "layers": 5, "extract": {"bf16": 7_757.0, "fp8": 7_805.0, "nf4": 7_805.0,
                                                          "raw": 7_757.0}, "train": 9_933.0},
}
CODEC_FRACTION = {"raw": 1.0, "bf16": 1 / 1.535, "fp8": 1 / 2.383, "nf4": 0.263}
PER_TOKEN_EXTRA_BYTES = 8 + 8 * (4 + 4)  # input_ids, loss_mask, top1_ids; the top-8 ids and log-probs (before compression)


@dataclass(frozen=True)
class Plan:
    tokens: float
    epochs: int
    codec: str
    disk_budget: float | None
    bytes_per_token: float
    extract_tokens_per_second: float
    train_tokens_per_second: float

    @property
    def disk_bytes(self) -> float:
        return self.tokens * self.bytes_per_token

    @property
    def extract_hours(self) -> float:
        return self.tokens / self.extract_tokens_per_second / 3600

    @property
    def train_hours(self) -> float:
        return self.epochs * self.tokens / self.train_tokens_per_second / 3600

    @property
    def kept_fraction(self) -> float:
        """The share of the cache a disk budget keeps from one epoch to the next."""
        if self.disk_budget is None:
            return 1.0
        return min(1.0, self.disk_budget / self.disk_bytes)

    @property
    def offline_hours(self) -> float:
        return self.extract_hours + self.train_hours

    @property
    def follow_hours(self) -> float:
        return self.extract_hours * (1 + (self.epochs - 1) * (1 - self.kept_fraction)) + self.train_hours

    @property
    def online_hours(self) -> float:
        return self.epochs * self.extract_hours + self.train_hours


def make_plan(*, tokens: float, epochs: int, codec: str, disk_budget: float | None, hidden_size: int, layers: int,
              extract_tokens_per_second: float, train_tokens_per_second: float) -> Plan:
    if codec not in CODEC_FRACTION:
        raise SystemExit(f"codec {codec!r}: choose one of {', '.join(CODEC_FRACTION)}")
    per_token = layers * hidden_size * 2 * CODEC_FRACTION[codec] + PER_TOKEN_EXTRA_BYTES
    return Plan(tokens, epochs, codec, disk_budget, per_token, extract_tokens_per_second, train_tokens_per_second)


def format_plan(p: Plan, online_tokens_per_second: float, online_gpus: int) -> str:
    from dflash.cache_tools.staging import format_size

    seed = online_gpus * p.epochs * p.tokens / online_tokens_per_second / 3600
    budget = "none" if p.disk_budget is None else format_size(p.disk_budget)
    kept = p.kept_fraction
    lines = [
        f"plan: {p.tokens:,.0f} tokens, {p.epochs} epochs, codec {p.codec}, disk budget {budget}",
        f"  disk needed for the whole cache: {format_size(p.disk_bytes)} ({p.bytes_per_token:,.0f} B/token)",
        f"  rates (one GPU): extraction {p.extract_tokens_per_second:,.0f} tok/s, training "
        f"{p.train_tokens_per_second:,.0f} context tok/s",
        "",
        "| mode | disk | GPU-hours | extraction GPU-h | training GPU-h |",
        "|---|---:|---:|---:|---:|",
        f"| offline (extract once, then train) | {format_size(p.disk_bytes)} | {p.offline_hours:,.1f} | "
        f"{p.extract_hours:,.1f} | {p.train_hours:,.1f} |",
        f"| follow with the budget ({kept:.0%} of the cache kept; "
        f"{(p.epochs - 1) * (1 - kept):.2f} re-extractions) | "
        f"{format_size(min(p.disk_bytes, p.disk_budget or p.disk_bytes))} | {p.follow_hours:,.1f} | "
        f"{p.follow_hours - p.train_hours:,.1f} | {p.train_hours:,.1f} |",
        f"| online (the target every epoch, one GPU's rates) | 0 | {p.online_hours:,.1f} | "
        f"{p.online_hours - p.train_hours:,.1f} | {p.train_hours:,.1f} |",
        f"| the seed's online pipeline ({online_tokens_per_second:,.0f} tok/s on {online_gpus} GPUs) | 0 | "
        f"{seed:,.1f} | | |",
    ]
    return "\n".join(lines)


def plan_main(argv: list[str]) -> None:
    from dflash.cache_tools.staging import parse_size

    ap = argparse.ArgumentParser(prog="gpu_hours.py plan", description="Disk and GPU-hours of a user's plan.")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="measured shape whose rates to use [8b]")
    ap.add_argument("--tokens", type=float, required=True, help="training tokens (e.g. 1e9)")
    from dflash.train.config import OptimizationConfig

    ap.add_argument("--epochs", type=int, default=OptimizationConfig.epochs,
                    help=f"training epochs [dflash-train's default, {OptimizationConfig.epochs}]")
    ap.add_argument("--codec", default="fp8", choices=sorted(CODEC_FRACTION))
    ap.add_argument("--disk-budget", default=None, help="e.g. 2T, 500G (default: none, the whole cache on disk)")
    ap.add_argument("--hidden-size", type=int, help="target hidden size [the shape's]")
    ap.add_argument("--layers", type=int, help="captured layers K [the shape's]")
    ap.add_argument("--extract-rate", type=float, help="extraction tokens/s on one GPU [the shape's, per codec]")
    ap.add_argument("--train-rate", type=float, help="training context tokens/s on one GPU [the shape's]")
    ap.add_argument("--figures", nargs="*", type=Path, default=[],
                    help="bench_extract.py / bench_train.py JSON whose rates replace the shape's")
    ap.add_argument("--online-tokens-per-second", type=float, default=ONLINE_TOKENS_PER_SECOND)
    ap.add_argument("--online-gpus", type=int, default=ONLINE_GPUS)
    a = ap.parse_args(argv)
    shape = SHAPES[a.shape]
    extract_rate, train_rate = shape["extract"][a.codec], shape["train"]
    for f in map(read_figures, a.figures):
        if kind(f) == "extract" and a.codec in f["extract"]:
            extract_rate = f["extract"][a.codec]["tokens_per_second"] / f.get("gpus", 1)
        elif kind(f) == "train":
            train_rate = f["context_tokens_per_second"] / f.get("processes", 1)
    p = make_plan(tokens=a.tokens, epochs=a.epochs, codec=a.codec,
                  disk_budget=None if a.disk_budget is None else float(parse_size(a.disk_budget)),
                  hidden_size=a.hidden_size or shape["hidden_size"], layers=a.layers or shape["layers"],
                  extract_tokens_per_second=a.extract_rate or extract_rate,
                  train_tokens_per_second=a.train_rate or train_rate)
    print(format_plan(p, a.online_tokens_per_second, a.online_gpus))


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        plan_main(argv[1:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path,
                    help="bench_extract.py and bench_train.py figures (one train file; any number of extract files)")
    ap.add_argument("--epochs", type=int, default=EPOCHS, help=f"training epochs [{EPOCHS}]")
    ap.add_argument("--online-tokens-per-second", type=float, default=ONLINE_TOKENS_PER_SECOND,
                    help=f"the online pipeline's rate [{ONLINE_TOKENS_PER_SECOND:,.0f}]")
    ap.add_argument("--online-gpus", type=int, default=ONLINE_GPUS, help=f"GPUs the online pipeline holds [{ONLINE_GPUS}]")
    a = ap.parse_args(argv)
    figures = [(p, read_figures(p)) for p in a.files]
    extracts = [f for _, f in figures if kind(f) == "extract"]
    trains = [(p, f) for p, f in figures if kind(f) == "train"]
    if not extracts or len(trains) != 1:
        ap.error(f"need bench_extract.py figures and one bench_train.py file; got {len(extracts)} extract and "
                 f"{len(trains)} train files ({', '.join(str(p) for p, _ in trains) or 'none'}).")
    train = trains[0][1]
    rows = [r for e in extracts for r in gpu_hours(e, train, epochs=a.epochs, online_gpus=a.online_gpus,
                                                   online_tokens_per_second=a.online_tokens_per_second)]
    if not rows:
        raise SystemExit("the extract files hold no extraction figures (their runs stopped before the first codec "
                         "finished): rerun bench_extract.py.")
    print(f"GPU-hours per billion tokens: extract once + {a.epochs} epochs of training (train: "
          f"{train.get('shape', '?')}, {train.get('processes', 1)} GPU(s)) vs the online pipeline's {a.epochs} "
          f"recomputations at {a.online_tokens_per_second:,.0f} tokens/s on {a.online_gpus} GPUs")
    print(format_table(rows, a.epochs))


if __name__ == "__main__":
    main()
