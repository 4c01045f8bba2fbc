"""Extraction and training at once on one GPU (two processes) against each alone.

A follow run (`dflash-train --follow`) on one GPU shares it with the extraction it follows.
This measures what that costs each side, on the 8B shapes of bench_extract.py and
bench_train.py (random init; --small: the CPU smoke sizes):
  1. extraction alone (bench_extract.py, --codec), its tokens/s
  2. training alone (bench_train.py, --compile), its context tokens/s over the measured steps
  3. both at once: the trainer is started first; once it logs its first step after warm-up the
     extraction starts; the trainer's steps logged while the extraction runs are its rate
     together, the extraction's own figure its rate together; the trainer is then stopped
Printed: each rate together as a fraction of alone, and their sum (the GPU's combined work
against running the two one after the other: above 1.0 sharing the GPU gains).

    python bench/bench_colocate.py --workdir /dev/shm/colocate --json /tmp/colocate.json   # one H200, ~4 min
    python bench/bench_colocate.py --small --workdir /tmp/colocate-small                    # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def extract_cmd(args, out: Path, result: Path) -> list[str]:
    cmd = [sys.executable, str(HERE / "bench_extract.py"), "--output", str(out), "--codecs", args.codec,
           "--json", str(result), "--check-samples", "1"]
    if args.small:
        cmd.append("--small")
    if args.extract_tokens:
        cmd += ["--tokens", str(args.extract_tokens)]
    return cmd


def train_cmd(args, work: Path, steps: int, result: Path | None) -> list[str]:
    cmd = [sys.executable, str(HERE / "bench_train.py"), "--workdir", str(work), "--steps", str(steps),
           "--warmup-steps", str(args.warmup_steps), "--keep"]
    cmd += ["--small"] if args.small else ["--samples", "96", "--compile"]
    if result is not None:
        cmd += ["--json", str(result)]
    return cmd


def train_records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--json", help="Also write the figures to this file.")
    p.add_argument("--small", action="store_true", help="CPU smoke sizes")
    p.add_argument("--codec", default="fp8")
    p.add_argument("--extract-tokens", type=int, default=None, help="[bench_extract's default: 1M; small 16K]")
    p.add_argument("--train-steps", type=int, default=60, help="measured steps of the training alone")
    p.add_argument("--warmup-steps", type=int, default=8)
    args = p.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    result: dict = {"codec": args.codec, "small": args.small}

    subprocess.run(extract_cmd(args, work / "x-alone", work / "extract-alone.json"), check=True)
    alone_x = json.loads((work / "extract-alone.json").read_text())["extract"][args.codec]["tokens_per_second"]
    shutil.rmtree(work / "x-alone", ignore_errors=True)
    subprocess.run(train_cmd(args, work / "t-alone", args.train_steps, work / "train-alone.json"), check=True)
    alone_t = json.loads((work / "train-alone.json").read_text())["context_tokens_per_second"]

    # Together: a trainer with steps to spare (on the target and cache the alone run wrote), the
    # extraction once the trainer is past its warm-up.
    trainer = subprocess.Popen(train_cmd(args, work / "t-alone", 100_000, None), start_new_session=True)
    run = work / "t-alone" / "run"
    try:
        while not any(r.get("kind") == "train" and r["step"] > args.warmup_steps for r in train_records(run)):
            if trainer.poll() is not None:
                raise SystemExit(f"the trainer ended (exit {trainer.returncode}) before its warm-up was over")
            time.sleep(0.2)
        before = len(train_records(run))
        extraction = subprocess.Popen(extract_cmd(args, work / "x-both", work / "extract-both.json"))
        seen, during = before, []
        while extraction.poll() is None:  # the trainer's records logged while the extraction runs
            records = train_records(run)
            during += [r for r in records[seen:] if r.get("kind") == "train"]
            seen = len(records)
            time.sleep(0.2)
        if extraction.returncode:
            raise SystemExit(f"the extraction failed (exit {extraction.returncode})")
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGTERM)
            trainer.wait()
    both_x = json.loads((work / "extract-both.json").read_text())["extract"][args.codec]["tokens_per_second"]
    if not during:
        raise SystemExit("no training step was logged while the extraction ran: lengthen the extraction")
    seconds = sum(r["seconds_per_step"] for r in during)
    both_t = sum(r["context_tokens_per_second"] * r["seconds_per_step"] for r in during) / seconds
    result.update(extract_alone=alone_x, extract_together=both_x, train_alone=alone_t, train_together=both_t,
                  train_records_together=len(during))
    ex, tr = both_x / alone_x, both_t / alone_t
    result.update(extract_fraction=ex, train_fraction=tr, combined=ex + tr)
    print(f"extraction ({args.codec}) alone {alone_x:,.0f} tok/s, with training {both_x:,.0f} tok/s = {ex:.3f}x")
    print(f"training alone {alone_t:,.0f} context tok/s, with extraction {both_t:,.0f} = {tr:.3f}x "
          f"({len(during)} logged intervals)")
    print(f"combined: {ex + tr:.3f} (1.0 = the GPU does the same work as running them one after the other)")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
