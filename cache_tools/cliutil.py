"""What every dflash command line shares: errors become one paragraph, never a traceback."""

from __future__ import annotations

import textwrap
from typing import Any

import click

from .errors import DflashError

EXIT_ERROR = 2


def paragraph(text: str) -> str:
    """One wrapped paragraph for the terminal."""
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)


class ErrorReportingGroup(click.Group):
    """A click group that prints pipeline errors (and OSErrors) as one paragraph on stderr."""

    os_error_advice = "Check the path, its permissions and the free disk space, then rerun the command."

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DflashError as e:
            click.echo(paragraph(f"Error: {e}"), err=True)
            ctx.exit(EXIT_ERROR)
        except OSError as e:  # disk full, permission denied, ... while reading or writing
            where = f" ({e.filename})" if e.filename else ""
            click.echo(paragraph(f"Error: {e.strerror or e}{where}. {self.os_error_advice}"), err=True)
            ctx.exit(EXIT_ERROR)
