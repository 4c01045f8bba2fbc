"""`dflash-prepare`: render a chat dataset through the target's chat template, with loss masks."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click
from dflash.runtime.cli import Command
from dflash.runtime.config import config_file_option

from .pipeline import PrepareConfig, PrepareConfigError

CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}


def build_settings(flags: dict[str, Any], cls: type, required: tuple[str, ...]) -> Any:
    """The command's settings (flags over the --config file over defaults) as `cls`."""
    missing = [k for k in required if not flags.get(k)]
    if missing:
        raise PrepareConfigError(
            f"Missing {', '.join('--' + k.replace('_', '-') for k in missing)}: give it on the "
            "command line or in the --config file."
        )
    return cls(**flags)


class JsonObject(click.ParamType):
    """A JSON object given as text on the command line, or as a mapping in a --config file."""

    name = "JSON"

    def convert(self, value: Any, param: Any, ctx: Any) -> dict:
        if isinstance(value, dict):
            return value
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            self.fail(f"{value!r} is not valid JSON ({e.msg}); write e.g. '{{\"enable_thinking\": false}}'.", param, ctx)
        if not isinstance(obj, dict):
            self.fail(f"{value!r} is not a JSON object; write e.g. '{{\"enable_thinking\": false}}'.", param, ctx)
        return obj


def render_options(loss_on_default: str = "all-assistant") -> Callable[[Callable], Callable]:
    """The rendering flags dflash-prepare and dflash-generate share (same names, same meaning)."""
    options = [
        config_file_option(),
        click.option("--target-model", help="Local HF model directory: its tokenizer and chat template render the data."),
        click.option("--data", help="Chat dataset: a .jsonl/.jsonl.gz/.parquet file or a directory of them."),
        click.option("--output", help="The JSONL file to write (with its sidecar <output>.meta.json)."),
        click.option("--format", type=click.Choice(["auto", "messages", "sharegpt", "prompt"]), default="auto",
                     help="Record shape: OpenAI messages, ShareGPT conversations, prompt/response pairs."),
        click.option("--chat-template", type=click.Path(dir_okay=False),
                     help="Jinja file (or JSON with chat_template) to use instead of the tokenizer's; "
                          "must be the template the serving engine uses."),
        click.option("--chat-template-kwargs", type=JsonObject(), default="{}", help="JSON object of template variables, e.g. '{\"enable_thinking\": false}'."),
        click.option("--thinking", type=click.Choice(["on", "off"]),
                     help="Sets enable_thinking in the template kwargs; match the serving setting."),
        click.option("--loss-on", type=click.Choice(["all-assistant", "last-assistant"]), default=loss_on_default,
                     help="Which assistant turns are supervised."),
        click.option("--supervise-empty-reasoning/--no-supervise-empty-reasoning", default=False,
                     help="Also supervise an empty <think></think> block the template inserts."),
    ]

    def decorate(f: Callable) -> Callable:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


@click.command(cls=Command, name="dflash-prepare", context_settings=CONTEXT,
               stop_note="; nothing was written (the output appears only when complete).")
@render_options()
@click.option("--max-seq-len", type=int, default=8192, help="Longest rendered sample kept.")
@click.option("--long-samples", type=click.Choice(["skip", "truncate"]), default="skip",
              help="What to do with samples longer than --max-seq-len.")
@click.option("--skip-bad/--no-skip-bad", default=False,
              help="Skip (and count) malformed records and refused renderings instead of stopping.")
@click.option("--num-workers", type=int, default=0,
              help="Processes rendering in parallel (0: in this process); the output is the same.")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
def main(**flags: Any) -> None:
    """Render a chat dataset with the target's chat template into dflash-extract's input format.

    Writes {"id", "input_ids", "loss_mask"} records (loss on assistant tokens only) and a
    sidecar <output>.meta.json with the template's sha256 and kwargs, which dflash-extract
    copies into the cache manifest. Exit status: 0 done, 2 bad settings or input (one
    paragraph names the file, line and sample), 130/143 stopped by a signal.
    """
    config = build_settings(flags, PrepareConfig, ("target_model", "data", "output"))
    from .pipeline import run_prepare

    summary = run_prepare(config)
    click.echo(summary.format(), err=True)
    for skip in summary.skips[:20]:
        click.echo(f"  skipped {skip['where']}: {skip['reason']}", err=True)


if __name__ == "__main__":
    main()
