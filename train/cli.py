"""`dflash-train` command line.

    dflash-train [run] --cache CACHE [--cache CACHE2 ...] --target-model DIR --output-dir RUN_DIR [options]
    dflash-train export CHECKPOINT_DIR OUT_DIR
    dflash-train estimate DRAFTER_DIR --cache CACHE [--cache ...] --target-model DIR [--json]

Every run option is a TrainConfig field (train/config.py) of the same name, through the one
settings path of every command (`dflash.runtime.settings`); `--config FILE` reads them from JSON
or YAML, each value converted and checked as its flag's, and flags given override the file. Errors and
exit statuses follow the contract of every dflash command (`dflash.runtime.cli`): 0 done, 2 bad
settings/data (one paragraph), 130 stopped by SIGINT, 143 by SIGTERM (a checkpoint of the last
step was written), 1 an unexpected failure. torch loads when a command starts working, not for
--help.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from dflash.runtime.cli import Group
from dflash.runtime.devices import DTYPE_NAMES, DtypeChoice, torch_dtype
from dflash.runtime.errors import UsageError
from dflash.runtime.findings import Finding
from dflash.runtime.settings import setting, settings_options
from dflash.train.config import TrainConfig, TrainConfigError
from dflash.train.exports import messages as _messages  # noqa: F401  (the renderers of this module's findings)


class TrainGroup(Group):
    """Runs `run` when the first argument is not a subcommand."""

    stop_note = "train.stopped"  # (the words: train/exports/messages.py)
    os_error_advice = "train.os-error"
    oom_advice = "train.out-of-memory"
    compile_advice = "train.compile-failed"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # `run` is the default command, its help too: `dflash-train --help` lists the training
        # options (the other commands are named at the top of that help).
        if args and args[0] == "compare":
            raise UsageError(Finding("train.compare-moved", command="dflash-compare"))
        if not args or args[0] not in self.commands:
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(cls=TrainGroup, name="dflash-train", context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Train a DFlash drafter from a hidden-state cache (`dflash-train --help` for the options)."""


@main.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@settings_options(TrainConfig, error=TrainConfigError)
def run(settings: TrainConfig) -> None:
    """Train a DFlash2 drafter (or, with --drafter-type dflash, a plain DFlash one) from a
    hidden-state cache written by dflash-extract.

    \b
    Examples:
      dflash-train --cache runs/cache --target-model /models/Qwen3-8B --output-dir runs/drafter
      dflash-train --config train.yaml --lr 3e-4          # flags override the file
      torchrun --nproc-per-node 8 -m dflash.train.cli --config train.yaml
      dflash-train export runs/drafter/checkpoints/step-001000 runs/drafter-1000
      dflash-train estimate runs/drafter/final --cache runs/heldout-cache --target-model /models/Qwen3-8B

    `run` is the default command: `dflash-train --cache ...` is `dflash-train run --cache ...`.
    Rerunning the same command in the same --output-dir resumes from its latest checkpoint.

    Other commands: `dflash-train export --help`, `dflash-train estimate --help`; `dflash-compare --help`
    trains the candidate heads on a fraction of the data and keeps the best.

    Exit status: 0 done, 2 bad settings or data, 130/143 stopped by SIGINT/SIGTERM after
    writing a checkpoint, 1 unexpected failure.
    """
    from dflash.train.run.distributed import shutdown_distributed
    from dflash.train.run.loop import train  # torch: only once the settings are known to be good

    finished = False
    try:
        result = train(settings)
        finished = result.exit_status == 0
    finally:
        # a rank that exits without the last barrier can break its peers' last collective; a stopped
        # or failed run does not wait for peers that may never come
        shutdown_distributed(wait=finished)
    if result.exit_status:
        sys.exit(result.exit_status)


@dataclass(kw_only=True)
class ExportConfig:
    """The settings of `dflash-train export`."""

    dtype: str = setting("bf16", type=DtypeChoice(DTYPE_NAMES))
    """dtype of the exported weights."""


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@settings_options(ExportConfig, error=TrainConfigError)
def export(checkpoint_dir: str, out_dir: str, settings: ExportConfig) -> None:
    """Export a checkpoint (RUN_DIR/checkpoints/step-N, or a run directory: its latest) as an HF
    drafter directory that z-lab's DFlashDraftModel, SGLang and vLLM load."""
    from dflash.runtime.cli import paragraph
    from dflash.runtime.errors import Interrupted
    from dflash.runtime.signals import exit_status, signal_name

    started = time.time()
    try:
        from dflash.train.run.checkpoint import export_checkpoint  # torch

        path = export_checkpoint(checkpoint_dir, out_dir, torch_dtype(settings.dtype))
    except Interrupted as e:  # the export is staged beside OUT_DIR and renamed into place whole
        config = Path(out_dir) / "config.json"
        done = config.is_file() and config.stat().st_mtime >= started
        click.echo(paragraph(
            f"dflash-train export stopped by {signal_name(e.signum)}: "
            + (f"the export to {out_dir} was complete before it stopped." if done else
               f"nothing was written to {out_dir} (an export there before is kept as it was). Rerun the "
               "same command to export.")), err=True)
        sys.exit(exit_status(e.signum))
    click.echo(f"exported drafter to {path}")


ESTIMATE_SETTINGS = ("cache", "target_model", "max_anchors", "token_budget", "max_batch_size", "max_seq_len",
                     "num_workers", "verify_checksums", "device", "dtype")
"""The run settings `estimate` takes: the trainer's flags, with their names, help and defaults."""


ESTIMATE_HELP = {"max_anchors": "Most blocks of a sequence run together (all its eligible positions are "
                                "evaluated).  [default: 512]"}


@main.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.argument("drafter_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@settings_options(TrainConfig, only=ESTIMATE_SETTINGS, build=False, help_overrides=ESTIMATE_HELP,
                  error=TrainConfigError)
def estimate(drafter_dir: str, as_json: bool, settings: dict[str, Any]) -> None:
    """The trainer's held-out estimate (docs/train.md, "Estimator") of an exported drafter
    (DRAFTER_DIR: `export`'s output or RUN_DIR/final) over every sample of --cache: the walk
    at the drafter's block and at half of it, the per-block mean, the loss. Given greedy
    completions of the prompts dflash-eval decodes, it estimates that decoding's tau."""
    from dflash.train.measure.estimate import estimate_drafter, format_estimate  # torch

    result = estimate_drafter(drafter_dir, settings)
    click.echo(json.dumps(result) if as_json else format_estimate(result))


if __name__ == "__main__":
    main()
