"""Two drafters decoded on the same prompts, compared with a paired bootstrap interval.

dflash-eval's --json report holds each prompt's accepted tokens and verification cycles
(`per_prompt`). Given a base report and one or more others of the same prompts, this prints each
one's pooled tau (tokens over cycles) and per-prompt mean, and its pooled tau over the base's with
a 95 % interval: the prompts are resampled with replacement, the same draw for both reports, so the
interval says how sure the difference is on these prompts (a ratio whose interval holds 1 is not
told apart from the base):

    python3 bench/quality/paired.py WORK/eval-e10-b16.json WORK/eval-e10-drafter-type-dflash2-b16.json

The benchmark's tables quote these intervals ("paired") with the defaults below.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from dflash.eval.run import bootstrap_draw, percentile_interval, resampled_tau

RESAMPLES = 4000


class PairingError(ValueError):
    """Reports that cannot be paired: not dflash-eval's, or not decoded on the same prompts."""


def read_prompts(path: Path, prompt_set: int = 0) -> dict[str, np.ndarray]:
    """The per-prompt accepted tokens, cycles and lengths of one prompt set of a dflash-eval report."""
    try:
        report = json.loads(path.read_text())
        rows = report["prompt_sets"][prompt_set]["per_prompt"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise PairingError(f"{path}: not a dflash-eval --json report with per-prompt figures for prompt set "
                           f"{prompt_set} ({type(e).__name__}: {e}); decode with `dflash-eval ... --json`.") from e
    return {key: np.array([r[key] for r in rows], dtype=np.float64)
            for key in ("accepted_tokens", "cycles", "prompt_tokens", "new_tokens")}


def compare(base: dict[str, np.ndarray], other: dict[str, np.ndarray], *, resamples: int = RESAMPLES,
            seed: int = 0) -> dict[str, float | list[float]]:
    """`other` against `base` on the same prompts: pooled taus, per-prompt means and the pooled
    ratio with its paired 95 % bootstrap interval."""
    if len(base["cycles"]) != len(other["cycles"]) or not np.array_equal(base["prompt_tokens"], other["prompt_tokens"]):
        raise PairingError(f"the two reports hold other prompts ({len(base['cycles'])} and {len(other['cycles'])} "
                           "prompts, or other prompt lengths): a paired interval needs the same prompts in the "
                           "same order; decode both with the same --prompts file.")
    draw = bootstrap_draw(len(base["cycles"]), resamples, seed)
    ratios = (resampled_tau(other["accepted_tokens"], other["cycles"], draw)
              / resampled_tau(base["accepted_tokens"], base["cycles"], draw))

    def pooled(r: dict[str, np.ndarray]) -> float:
        return float(r["accepted_tokens"].sum() / r["cycles"].sum())

    def mean(r: dict[str, np.ndarray]) -> float:
        keep = r["cycles"] > 0
        return float((r["accepted_tokens"][keep] / r["cycles"][keep]).mean())

    return {"base_tau": pooled(base), "tau": pooled(other), "ratio": pooled(other) / pooled(base),
            "interval": percentile_interval(ratios), "base_per_prompt_mean": mean(base),
            "per_prompt_mean": mean(other), "per_prompt_ratio": mean(other) / mean(base)}


def line(name: str, c: dict) -> str:
    lo, hi = c["interval"]
    return (f"{name}: pooled {c['base_tau']:.3f} -> {c['tau']:.3f} = {100 * (c['ratio'] - 1):+.1f} % "
            f"(paired 95 %: {100 * (lo - 1):+.1f} to {100 * (hi - 1):+.1f} %); per-prompt mean "
            f"{c['base_per_prompt_mean']:.2f} -> {c['per_prompt_mean']:.2f} = {100 * (c['per_prompt_ratio'] - 1):+.1f} %")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path, help="dflash-eval --json report of the drafter to compare against")
    ap.add_argument("others", type=Path, nargs="+", help="reports of other drafters on the same prompts")
    ap.add_argument("--resamples", type=int, default=RESAMPLES, help=f"bootstrap resamples (default {RESAMPLES})")
    ap.add_argument("--seed", type=int, default=0, help="the draw's seed (default 0)")
    ap.add_argument("--prompt-set", type=int, default=0, help="which prompt set of the reports (default the first)")
    args = ap.parse_args(argv)
    try:
        base = read_prompts(args.base, args.prompt_set)
        for path in args.others:
            print(line(f"{path.name} against {args.base.name}",
                       compare(base, read_prompts(path, args.prompt_set), resamples=args.resamples, seed=args.seed)))
    except PairingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
