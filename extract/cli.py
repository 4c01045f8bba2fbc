"""`dflash-extract`: run the frozen target over tokenized completions and fill the cache.

Its flags, config-file keys and --help are the fields of `ExtractConfig` (extract/config.py),
through the one settings path of every command (`dflash.runtime.settings`). Errors, signals and
exit statuses follow the contract of every dflash command (`dflash.runtime.cli`); torch and
transformers load when the settings are known to be good.
"""

from __future__ import annotations

import sys

import click
from dflash.runtime.cli import Command
from dflash.runtime.settings import settings_options
from dflash.runtime.signals import exit_status

from .config import DEPRECATED_KEYS, ExtractConfig


@click.command(cls=Command, name="dflash-extract", context_settings={"help_option_names": ["-h", "--help"]},
               stop_note="extract.stopped", oom_advice="extract.out-of-memory")
@settings_options(ExtractConfig, deprecated=DEPRECATED_KEYS,
                  config_help="JSON or YAML file with any of these settings (same names); flags override it.")
def main(settings: ExtractConfig) -> None:
    """Run the frozen target model over tokenized completions and write the hidden-state cache.

    Rerunning the same command resumes: committed parts are skipped. Several processes
    (torchrun, or --rank/--world-size) can fill one cache. Exit status: 0 done, 2 bad settings
    or input (one paragraph says what and where), 130/143 stopped by SIGINT/SIGTERM (committed
    parts are kept), 1 an unexpected failure.
    """
    from .pipeline import run_extraction  # torch/transformers: only once the settings are good

    summary = run_extraction(settings)
    click.echo(summary.format(), err=True)
    for skip in summary.skips[:20]:
        click.echo(f"  skipped {skip['where']}: {skip['reason']}", err=True)
    if summary.interrupted_by:
        sys.exit(exit_status(summary.interrupted_by))


if __name__ == "__main__":
    main()
