"""How far a small held-out set's tau strays from the whole, with and without the trainer's
correction by prompt lookup (train/measure/evaluation.py, text_adjusted_tau), on decoded prompts.

    python3 bench/quality/lookup_subsets.py EVAL.json [--size 20] [--draws 4000]

EVAL.json is dflash-eval's report of one drafter (its per-prompt figures, prompt lookup's beside
them). Sets of --size prompts are drawn at random, a stand-in for a small held-out split; for
each, the pooled tau of the set over the pooled tau of all prompts, raw and corrected (the set's
prompt lookup against all prompts' lookup, as the trainer sets its held-out text against the
training text). Prints the share of sets within 10 % of the whole and the spread of the log ratio.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from dflash.train.measure.evaluation import text_adjusted_tau


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("eval_json")
    ap.add_argument("--size", type=int, default=20)
    ap.add_argument("--draws", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    report = json.load(open(args.eval_json))
    block = report["settings"]["block_size"]
    for prompt_set in report["prompt_sets"]:
        drafter, lookup = prompt_set["per_prompt"], prompt_set["prompt_lookup"]["per_prompt"]
        rows = np.array([[p["accepted_tokens"], p["cycles"]] for p in drafter], dtype=np.float64)
        looked = np.array([[p["accepted_tokens"], p["cycles"]] for p in lookup], dtype=np.float64)
        whole = rows[:, 0].sum() / rows[:, 1].sum()
        whole_lookup = looked[:, 0].sum() / looked[:, 1].sum()
        rng = np.random.default_rng(args.seed)
        raw, adjusted = [], []
        for _ in range(args.draws):
            pick = rng.choice(len(rows), size=min(args.size, len(rows)), replace=False)
            per_sample = [[1.0, t, c] for t, c in rows[pick]]
            set_lookup = looked[pick, 0].sum() / looked[pick, 1].sum()
            fixed = text_adjusted_tau(per_sample, looked[pick].tolist(), set_lookup, whole_lookup, block)
            raw.append(rows[pick, 0].sum() / rows[pick, 1].sum() / whole)
            adjusted.append((fixed if fixed is not None else raw[-1] * whole) / whole)
        for name, ratios in (("raw", np.array(raw)), ("lookup-adjusted", np.array(adjusted))):
            print(f"{prompt_set['name']}: sets of {args.size} of {len(rows)} prompts, {name}: within 10 % of the whole "
                  f"in {np.mean(np.abs(ratios - 1) < 0.10):.0%} of {args.draws} draws, log-ratio sd "
                  f"{np.log(ratios).std():.3f}, mean ratio {ratios.mean():.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
