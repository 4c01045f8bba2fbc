"""`dflash-prepare`: render a chat dataset through the target's chat template, with loss masks."""

from __future__ import annotations

import dataclasses
import signal
import sys
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource
from dflash.cache_tools.configfile import read_config_file
from dflash.cache_tools.errors import DflashError

from .pipeline import PrepareConfig, PrepareConfigError

EXIT_ERROR = 1
EXIT_USAGE = 2
CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}


def build_settings(ctx: click.Context, config_file: str | None, flags: dict, cls: type,
                   required: tuple[str, ...]) -> Any:
    """File values, overridden by flags given on the command line; dataclass defaults otherwise."""
    known = [f.name for f in dataclasses.fields(cls)]
    values = read_config_file(config_file, known, PrepareConfigError) if config_file else {}
    for name, value in flags.items():
        if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            values[name] = value
    missing = [k for k in required if not values.get(k)]
    if missing:
        raise PrepareConfigError(
            f"Missing {', '.join('--' + k.replace('_', '-') for k in missing)}: give it on the "
            "command line or in the --config file."
        )
    try:
        return cls(**values)
    except TypeError as e:
        raise PrepareConfigError(f"Invalid settings: {e}.") from e


def run_command(name: str, work: Callable[[], int]) -> None:
    """Run `work`; errors become one paragraph and an exit status (1 error, 2 usage, 128+signal)."""
    try:
        status = work()
    except DflashError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(EXIT_USAGE if isinstance(e, PrepareConfigError) else EXIT_ERROR)
    except KeyboardInterrupt:
        click.echo(f"{name} stopped by SIGINT.", err=True)
        sys.exit(128 + signal.SIGINT)
    sys.exit(status)


def render_options(f: Callable) -> Callable:
    """The rendering flags dflash-prepare and dflash-generate share (same names, same meaning)."""
    options = [
        click.option("--config", "config_file", type=click.Path(dir_okay=False),
                     help="JSON or YAML file with any of these settings (same names); flags override it."),
        click.option("--target-model", help="Local HF model directory: its tokenizer and chat template render the data."),
        click.option("--data", help="Chat dataset: a .jsonl/.jsonl.gz/.parquet file or a directory of them."),
        click.option("--output", help="The JSONL file to write (with its sidecar <output>.meta.json)."),
        click.option("--format", type=click.Choice(["auto", "messages", "sharegpt", "prompt"]), default="auto",
                     help="Record shape: OpenAI messages, ShareGPT conversations, prompt/response pairs."),
        click.option("--chat-template", type=click.Path(dir_okay=False),
                     help="Jinja file (or JSON with chat_template) to use instead of the tokenizer's; "
                          "must be the template the serving engine uses."),
        click.option("--chat-template-kwargs", default="{}", help="JSON object of template variables, e.g. '{\"enable_thinking\": false}'."),
        click.option("--thinking", type=click.Choice(["on", "off"]),
                     help="Sets enable_thinking in the template kwargs; match the serving setting."),
        click.option("--loss-on", type=click.Choice(["all-assistant", "last-assistant"]), default="all-assistant",
                     help="Which assistant turns are supervised."),
        click.option("--supervise-empty-reasoning/--no-supervise-empty-reasoning", default=False,
                     help="Also supervise an empty <think></think> block the template inserts."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@click.command(context_settings=CONTEXT)
@render_options
@click.option("--max-seq-len", type=int, default=8192, help="Longest rendered sample kept.")
@click.option("--long-samples", type=click.Choice(["skip", "truncate"]), default="skip",
              help="What to do with samples longer than --max-seq-len.")
@click.option("--skip-bad/--no-skip-bad", default=False,
              help="Skip (and count) malformed records and refused renderings instead of stopping.")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
@click.pass_context
def main(ctx: click.Context, config_file: str | None, **flags) -> None:
    """Render a chat dataset with the target's chat template into dflash-extract's input format.

    Writes {"id", "input_ids", "loss_mask"} records (loss on assistant tokens only) and a
    sidecar <output>.meta.json with the template's sha256 and kwargs, which dflash-extract
    copies into the cache manifest. Exit status: 0 done, 1 error, 2 usage error.
    """
    def work() -> int:
        config = build_settings(ctx, config_file, flags, PrepareConfig, ("target_model", "data", "output"))
        from .pipeline import run_prepare

        summary = run_prepare(config)
        click.echo(summary.format(), err=True)
        for skip in summary.skips[:20]:
            click.echo(f"  skipped {skip['where']}: {skip['reason']}", err=True)
        return 0

    run_command("dflash-prepare", work)


if __name__ == "__main__":
    main()
