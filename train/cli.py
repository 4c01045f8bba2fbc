"""`dflash-train` command line (not built yet: see the README's status table)."""

import sys

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Train a DFlash drafter from a hidden-state cache.

    Not implemented yet in this version: this command only says so and exits with status 2.
    """
    click.echo("dflash-train is not implemented yet in this version.", err=True)
    sys.exit(2)
