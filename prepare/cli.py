"""`dflash-prepare`: render a chat dataset through the target's chat template, with loss masks.

Its flags, config keys and --help are the fields of `PrepareConfig` (prepare/pipeline.py),
through the one settings path of every command (`dflash.runtime.settings`).
"""

from __future__ import annotations

import click
from dflash.runtime.cli import Command
from dflash.runtime.settings import settings_options

from .pipeline import PrepareConfig, PrepareConfigError

CONTEXT = {"help_option_names": ["-h", "--help"]}


@click.command(cls=Command, name="dflash-prepare", context_settings=CONTEXT,
               stop_note="prepare.stopped")
@settings_options(PrepareConfig, error=PrepareConfigError)
def main(settings: PrepareConfig) -> None:
    """Render a chat dataset with the target's chat template into dflash-extract's input format.

    Writes {"id", "input_ids", "loss_mask"} records (loss on assistant tokens only) and a
    sidecar <output>.meta.json with the template's sha256 and kwargs, which dflash-extract
    copies into the cache manifest. Exit status: 0 done, 2 bad settings or input (one
    paragraph names the file, line and sample), 130/143 stopped by a signal.
    """
    from .pipeline import run_prepare

    summary = run_prepare(settings)
    click.echo(summary.format(), err=True)
    for skip in summary.skips[:20]:
        click.echo(f"  skipped {skip['where']}: {skip['reason']}", err=True)


if __name__ == "__main__":
    main()
