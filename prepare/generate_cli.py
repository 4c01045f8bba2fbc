"""`dflash-generate`: regenerate a chat dataset's assistant turns with the target itself.

Its flags, config keys and --help are the fields of `GenerateConfig` (prepare/driver.py),
through the one settings path of every command (`dflash.runtime.settings`).
"""

from __future__ import annotations

import click
from dflash.runtime.cli import Command
from dflash.runtime.findings import Finding, emit
from dflash.runtime.settings import settings_options

from .cli import CONTEXT
from .driver import GenerateConfig
from .pipeline import PrepareConfigError

EXIT_INCOMPLETE = 1


@click.command(cls=Command, name="dflash-generate", context_settings=CONTEXT,
               stop_note="prepare.generate-stopped")
@settings_options(GenerateConfig, error=PrepareConfigError)
def main(settings: GenerateConfig) -> int:
    """Regenerate the assistant turns of a chat dataset with the target, in dflash-extract's format.

    Output is append-only and keyed by source id and sample (--samples-per-prompt N: N records
    per conversation): rerunning the same command skips finished records and never duplicates
    one, and a larger N adds only the missing samples; Ctrl-C stops within seconds. Under torchrun (in-process
    backend) each rank takes every WORLD_SIZE-th conversation and appends to the same file.
    Exit status: 0 done, 1 some requests failed after their retries (rerun to retry them),
    2 bad settings or input, 130/143 stopped by a signal.
    """
    if settings.loss_on == "all-assistant" and settings.regenerate == "last":
        emit(Finding("prepare.loss-on-dataset-answers", flag="--loss-on", value="all-assistant"))
    from .driver import run_generate

    summary = run_generate(settings)
    click.echo(summary.format(), err=True)
    if summary.stopped_by:
        return 128 + summary.stopped_by
    return EXIT_INCOMPLETE if summary.failed else 0


if __name__ == "__main__":
    main()
