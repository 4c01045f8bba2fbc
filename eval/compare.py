"""`dflash-compare`: let measurement choose the drafter head (docs/train.md, "Choosing the head").

The candidates train, are measured on the held-out split, tabulated and picked in
train/measure/compare.py; given --prompts, each candidate's export is also decoded against the target by
dflash-eval's measurement (`run.run_eval`), here. The command drives both training and decoding,
so it lives in the layer above both (eval may import train, never the reverse).

Nothing here imports torch until a candidate trains or decodes: `dflash-compare --help` stays
quick. Errors, signals and exit statuses follow the contract of every dflash command
(`dflash.runtime.cli`), with the trainer's notes on a stop, an OSError and out of memory.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from dflash.runtime.cli import Command
from dflash.runtime.findings import Finding
from dflash.runtime.fsio import atomic_write_json
from dflash.runtime.settings import settings_options
from dflash.train.cli import TrainGroup
from dflash.train.config import TrainConfig, TrainConfigError
from dflash.train.measure.compare import CompareConfig, Decoder, compare_heads, parse_heads

from .config import EvalConfig, EvalError

DECODED_FILE = "decoded.json"
"""In a candidate's run directory: its decoded prompts' tokens and cycles, and what was decoded."""


@dataclass(kw_only=True)
class DecodeOptions:
    """What each candidate is decoded on (dflash-eval's settings of the same names)."""

    prompts: tuple[str, ...] = ()
    """JSONL prompt files to decode each candidate on; empty: the held-out estimate only."""
    max_new_tokens: int = 128
    """New tokens a decoded prompt generates."""
    max_prompts: int | None = None
    """Decode only the first N prompts of each file."""

    def __post_init__(self) -> None:
        self.prompts = tuple(str(p) for p in self.prompts)
        for flag, value in (("--max-new-tokens", self.max_new_tokens), ("--max-prompts", self.max_prompts)):
            if value is not None and value < 1:
                raise EvalError(Finding("eval.flag-below-one", flag=flag, value=value))


def _read_record(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when it is missing or unreadable (then it is decoded again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def decode_candidate(record: dict[str, Any], options: DecodeOptions, log: Callable[[str], None]) -> dict[str, Any]:
    """The candidate's export decoded on --prompts against the target (`run_eval`, greedy, without
    the prompt-lookup baseline): each prompt's accepted tokens and cycles, read from decoded.json
    when these prompts were decoded with this candidate already."""
    from dflash.train.run.loop import FINAL_DIR  # torch

    from .run import run_eval  # torch, transformers

    settings = record["settings"]
    run_dir = Path(settings["output_dir"])
    what = {"prompts": [str(Path(p).resolve()) for p in options.prompts], "max_new_tokens": options.max_new_tokens,
            "max_prompts": options.max_prompts, "settings": settings, "steps": record["steps"]}
    decoded = _read_record(run_dir / DECODED_FILE)
    if decoded and decoded.get("decoded") == what:
        return decoded
    log(f"compare: decoding {record['head']} on {', '.join(options.prompts)}")
    report = run_eval(EvalConfig(target_model=settings["target_model"], drafter=str(run_dir / FINAL_DIR),
                                 prompts=list(options.prompts), max_new_tokens=options.max_new_tokens,
                                 max_prompts=options.max_prompts, device=settings.get("device") or "auto",
                                 baseline=False))
    prompts = [p for s in report["prompt_sets"] for p in s["per_prompt"]]
    decoded = {"decoded": what, "tokens": [p["accepted_tokens"] for p in prompts],
               "cycles": [p["cycles"] for p in prompts],
               "lossless": all(s["lossless"].get("identical", True) or not s["lossless"].get("checked", True)
                               for s in report["prompt_sets"])}
    atomic_write_json(run_dir / DECODED_FILE, decoded)
    return decoded


def candidate_decoder(options: DecodeOptions, log: Callable[[str], None] = print) -> Decoder | None:
    """The `decode` of `compare_heads`: each candidate decoded on --prompts (None without prompts)."""
    if not options.prompts:
        return None
    return lambda record: decode_candidate(record, options, log)


COMPARE_HELP = {"drafter_type": "Not taken here: --heads names the candidates, and the best is trained."}


@click.command(cls=Command, name="dflash-compare",
               context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
               stop_note=TrainGroup.stop_note, os_error_advice=TrainGroup.os_error_advice,
               oom_advice=TrainGroup.oom_advice, compile_advice=TrainGroup.compile_advice)
@click.option("--heads", default=None, metavar="NAMES",
              help="Comma-separated candidate heads, e.g. dflash2,dspark  [default: every registered head an "
                   "engine serves]")
@click.option("--fraction", type=float, default=0.25, show_default=True,
              help="Share of the training samples each candidate trains on (a nested hash subset: "
                   "--max-train-samples), for --epochs of it.")
@click.option("--prompts", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="JSONL prompts (as dflash-eval's) to decode each candidate on against --target-model; repeat for "
                   "several files. Without it the heads are compared by the held-out estimate.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="New tokens a decoded prompt generates.")
@click.option("--max-prompts", type=int, default=None, help="Decode only the first N prompts of each file.")
@click.option("--train-best/--no-train-best", default=True, show_default=True,
              help="Then train the best head on the whole data in --output-dir (off: print that command).")
@settings_options(TrainConfig, build=False, help_overrides=COMPARE_HELP, error=TrainConfigError)
def main(heads: str | None, fraction: float, prompts: tuple[str, ...], max_new_tokens: int,
         max_prompts: int | None, train_best: bool, settings: dict[str, Any]) -> None:
    """Let measurement choose the drafter head (docs/train.md, "Choosing the head"): train each
    candidate on --fraction of the training samples for the same steps, in RUN_DIR/compare/HEAD/,
    measure it on the held-out split (and, with --prompts, by speculative decoding), print a table
    and the best with its margin, then train the best on the whole data in RUN_DIR. It takes
    dflash-train's run options. It prints at startup what the candidates cost in training steps
    against one full run. Rerunning the same command reads the finished candidates and resumes a
    stopped one.

    \b
    Example:
      dflash-compare --cache runs/cache --target-model /models/Qwen3-8B --output-dir runs/drafter \\
          --heads dflash2,dspark,lilicorr --fraction 0.25 --prompts eval/prompts.jsonl

    Exit status: 0 done, 2 bad settings or data, 130/143 stopped by SIGINT/SIGTERM after
    writing a checkpoint, 1 unexpected failure.
    """
    options = CompareConfig(heads=parse_heads(heads), fraction=fraction, train_best=train_best)
    decoding = DecodeOptions(prompts=prompts, max_new_tokens=max_new_tokens, max_prompts=max_prompts)
    result = compare_heads(settings, options, log=click.echo, decode=candidate_decoder(decoding, click.echo))
    if result.exit_status:
        sys.exit(result.exit_status)


if __name__ == "__main__":
    main()
