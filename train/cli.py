"""`dflash-train` command line.

    dflash-train [run] --cache CACHE [--cache CACHE2 ...] --target-model DIR --output-dir RUN_DIR [options]
    dflash-train export CHECKPOINT_DIR OUT_DIR
    dflash-train estimate DRAFTER_DIR --cache CACHE [--cache ...] --target-model DIR [--json]

Every run option is a TrainConfig field (train/config.py) of the same name; `--config FILE`
reads them from JSON or YAML and flags given on the command line override the file. Errors and
exit statuses follow the contract of every dflash command (`dflash.runtime.cli`): 0 done, 2 bad
settings/data (one paragraph), 130 stopped by SIGINT, 143 by SIGTERM (a checkpoint of the last
step was written), 1 an unexpected failure. torch loads when a command starts working, not for
--help.
"""

from __future__ import annotations

import json
import sys
import typing
from dataclasses import MISSING, fields
from typing import Any

import click
from dflash.runtime.cli import Group
from dflash.runtime.devices import DTYPE_NAMES, DtypeChoice, torch_dtype

from .config import CHOICES, TrainConfig, field_help, flag, load_config_file, make_config


class TrainGroup(Group):
    """Runs `run` when the first argument is not a subcommand."""

    stop_note = (" outside a training step; complete checkpoints are kept. Rerun the same command "
                 "to resume.")
    os_error_advice = ("Check the path, its permissions and the free disk space, then rerun the same "
                       "command to resume.")

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


def _option_for(f: Any, hints: dict[str, Any]) -> click.Option:
    """A click option for one TrainConfig field; default None means 'not given'."""
    name, hint = f.name, hints[f.name]
    default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    help_text = field_help().get(name, "")
    if default not in (None, [], "") and not isinstance(default, bool):
        help_text += f"  [default: {default if not isinstance(default, tuple) else ' '.join(map(str, default))}]"
    optional = type(None) in typing.get_args(hint)  # X | None
    kind = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if kind is bool:
        return click.Option([f"--{flag(name)}/--no-{flag(name)}", name], default=None,
                            help=help_text + f"  [default: {'on' if default else 'off'}]")
    if typing.get_origin(kind) is list:
        return click.Option([f"--{flag(name)}", name], multiple=True, default=None, help=help_text)
    if typing.get_origin(kind) is tuple:
        return click.Option([f"--{flag(name)}", name], nargs=2, type=float, default=None, help=help_text)
    if name in CHOICES:
        choice = DtypeChoice(CHOICES[name]) if name == "dtype" else click.Choice(CHOICES[name])
        return click.Option([f"--{flag(name)}", name], type=choice, default=None, help=help_text)
    return click.Option([f"--{flag(name)}", name], type=kind, default=None, help=help_text)


def _run_options(command: Any) -> Any:
    hints = typing.get_type_hints(TrainConfig)
    for f in reversed(fields(TrainConfig)):
        command.params.insert(0, _option_for(f, hints))
    return command


@click.group(cls=TrainGroup, name="dflash-train", context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Train a DFlash drafter from a hidden-state cache (written by dflash-extract).

    \b
    Examples:
      dflash-train --cache runs/cache --target-model /models/Qwen3-8B --output-dir runs/drafter
      dflash-train --config train.yaml --lr 3e-4          # flags override the file
      torchrun --nproc-per-node 8 -m dflash.train.cli --config train.yaml
      dflash-train export runs/drafter/checkpoints/step-001000 runs/drafter-1000
      dflash-train estimate runs/drafter/final --cache runs/heldout-cache --target-model /models/Qwen3-8B

    `run` is the default command: `dflash-train --cache ...` is `dflash-train run --cache ...`.
    Rerunning the same command in the same --output-dir resumes from its latest checkpoint.

    Exit status: 0 done, 2 bad settings or data, 130/143 stopped by SIGINT/SIGTERM after
    writing a checkpoint, 1 unexpected failure.
    """


@main.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="JSON or YAML file of settings (keys as the flags, with - or _); flags override it.")
def run(config_file: str | None, **flags: Any) -> None:
    """Train (or resume) a drafter; see `dflash-train --help` for the overview."""
    file_values = load_config_file(config_file) if config_file else {}
    flags = {k: (list(v) if isinstance(v, tuple) and k in ("cache", "eval_cache") else v) for k, v in flags.items()}
    config = make_config(file_values, flags)

    from .distributed import shutdown_distributed
    from .loop import train  # torch: only once the settings are known to be good

    try:
        result = train(config)
    finally:
        shutdown_distributed()  # a rank that exits without it can break its peers' last collective
    if result.exit_status:
        sys.exit(result.exit_status)


_run_options(run)


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--dtype", type=DtypeChoice(DTYPE_NAMES), default="bf16", show_default=True,
              help="dtype of the exported weights.")
def export(checkpoint_dir: str, out_dir: str, dtype: str) -> None:
    """Export a checkpoint (RUN_DIR/checkpoints/step-N, or a run directory: its latest) as an HF
    drafter directory that z-lab's DFlashDraftModel, SGLang and vLLM load."""
    from .checkpoint import export_checkpoint  # torch

    path = export_checkpoint(checkpoint_dir, out_dir, torch_dtype(dtype))
    click.echo(f"exported drafter to {path}")


ESTIMATE_SETTINGS = ("cache", "target_model", "max_anchors", "token_budget", "max_batch_size", "max_seq_len",
                     "num_workers", "verify_checksums", "device", "dtype")
"""The run settings `estimate` takes: the trainer's flags, with their names, help and defaults."""


@main.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.argument("drafter_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def estimate(drafter_dir: str, as_json: bool, **settings: Any) -> None:
    """The trainer's held-out estimate (docs/train.md, "Estimator") of an exported drafter
    (DRAFTER_DIR: `export`'s output or RUN_DIR/final) over every sample of --cache: the walk
    at the drafter's block and at half of it, the per-block mean, the loss. Given greedy
    completions of the prompts dflash-eval decodes, it estimates that decoding's tau."""
    settings = {k: (list(v) if k == "cache" else v) for k, v in settings.items()
                if v is not None and not (k == "cache" and not v)}
    from .estimate import estimate_drafter, format_estimate  # torch

    result = estimate_drafter(drafter_dir, settings)
    click.echo(json.dumps(result) if as_json else format_estimate(result))


_hints = typing.get_type_hints(TrainConfig)
_fields = {f.name: f for f in fields(TrainConfig)}
for _name in reversed(ESTIMATE_SETTINGS):
    _option = _option_for(_fields[_name], _hints)
    if _name == "max_anchors":  # every eligible position is evaluated; this is only the chunk width
        _option.help = ("Most blocks of a sequence run together (all its eligible positions are evaluated)."
                        f"  [default: {_fields[_name].default}]")
    estimate.params.insert(1, _option)


if __name__ == "__main__":
    main()
