"""The two loss weightings at two vocabulary sizes, on the demo's pipeline (CPU, minutes).

Acceptance weighting gives each block slot the drafter's own probability of reaching it, so at
the start of training, when the drafter's probabilities are near 1/vocabulary, the later slots
weigh little. This bench asks whether a large vocabulary makes that start costly on a short run:
for the demo's character vocabulary and for the same alphabet padded with ids no text uses
(a target trained anew with that vocabulary: training drives the unused logits down, as for a
real target's rare tokens), it trains the demo's drafter with each weighting (same data, seed
and steps) and decodes held-out prompts with `dflash-eval`:

    python bench/bench_vocab_weighting.py --workdir /tmp/vocab-weighting --vocab-sizes 0,8192

`0` is the demo's own vocabulary (its shipped target). Prints one row per (vocabulary,
weighting): tau, cycles, speedup, prompt lookup's tau, lossless.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

from dflash.demo import pipeline as demo
from dflash.eval.config import EvalConfig
from dflash.eval.run import run_eval


def run_vocabulary(workdir: Path, vocab: int, sizes: demo.DemoSizes, seed: int) -> list[dict]:
    """The demo with its target's vocabulary padded to `vocab` (0: as shipped), then its drafter
    trained again with the decay weighting; both drafters decoded on the demo's held-out prompts."""
    sizes = dataclasses.replace(sizes, vocab_size=vocab)  # a padded one trains a target anew
    start = time.perf_counter()
    report = demo.run_demo(workdir, sizes, seed, log=lambda *_: None)
    prepared = time.perf_counter() - start
    shown = vocab or demo.vocab_size()
    rows = [row(shown, "acceptance (default)", report["eval"], report["timings_s"]["train"])]
    run_dir = workdir / "run-decay"
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    demo.run_stage("dflash-train", "dflash.train.cli",
                   [*demo.drafter_train_args(workdir / "cache", workdir / "target", run_dir, sizes, seed),
                    "--loss-weighting", "decay"], workdir / "train-decay.log")
    trained = time.perf_counter() - start
    evaluated = run_eval(EvalConfig(target_model=str(workdir / "target"), drafter=str(run_dir / "final"),
                                    prompts=[str(workdir / "heldout_prompts.jsonl")],
                                    max_new_tokens=sizes.eval_new_tokens, batch_size=1, device="cpu", dtype="fp32"))
    rows.append(row(shown, "decay", evaluated, trained))
    print(f"  vocabulary {shown}: demo {prepared:.0f} s (target loss {report['target_final_loss']:.3f}), "
          f"decay drafter {trained:.0f} s", flush=True)
    return rows


def row(vocab: int, weighting: str, report: dict, train_seconds: float) -> dict:
    [r] = report["prompt_sets"]
    lookup = r["prompt_lookup"]
    return {"vocab_size": vocab, "loss_weighting": weighting, "tau": r["tau"], "cycles": r["cycles"],
            "speedup": r["speedup"], "lossless": r["lossless"]["identical"], "lookup_tau": lookup["tau"],
            "lookup_lossless": lookup["lossless"]["identical"], "train_seconds": train_seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True, help="Scratch directory (one subdirectory per size).")
    ap.add_argument("--vocab-sizes", default="0,8192", help="Comma-separated; 0 is the demo's own vocabulary.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="Also write the rows here.")
    args = ap.parse_args()
    sizes = demo.DemoSizes()
    rows = []
    for vocab in (int(v) for v in args.vocab_sizes.split(",")):
        rows += run_vocabulary(args.workdir / f"vocab-{vocab}", vocab, sizes, args.seed)
    print("| vocabulary | loss weighting | tau (block 8) | cycles | speedup | prompt lookup tau | lossless | train s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['vocab_size']} | {r['loss_weighting']} | {r['tau']:.2f} | {r['cycles']} | {r['speedup']:.2f}x | "
              f"{r['lookup_tau']:.2f} | {'yes' if r['lossless'] and r['lookup_lossless'] else 'NO'} | "
              f"{r['train_seconds']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
