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
EPOCHS = 6


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


def main(argv: list[str] | None = None) -> None:
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
