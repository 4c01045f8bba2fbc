"""One command-line contract for every dflash command.

Exit status, the same in every command:

=====  ===================================================================================
0      done
1      a check the command ran found a problem (`dflash-cache verify`, `dflash-eval
       --strict`), or an unexpected error: a bug, printed with its traceback
2      an error of one of the kinds of `dflash.runtime.errors`: bad usage (a flag or
       setting), bad input, corrupt data, a mismatch, or the environment (no device, no
       space, a read-only location, an OSError); one paragraph says what was wrong, where,
       and what to do
130    interrupted: stopped by SIGINT (Ctrl-C); 143 by SIGTERM (what was committed is kept)
=====  ===================================================================================

The environment shares status 2 with the user's mistakes: a full disk or a read-only mount is
fixed by the user like a wrong path is, the OSErrors of both look alike, and a rerun resumes
either way. `EXIT_STATUS` holds the table by kind.

`Command` and `Group` are click's classes with that contract: declare a command with
`@click.command(cls=Command, name="dflash-x")` and every error class is reported the same way,
in one paragraph on stderr that starts with "Error: ", never with a traceback.
"""

from __future__ import annotations

import signal
import sys
import traceback
from typing import Any

import click

from .errors import (
    CorruptDataError,
    DflashError,
    EnvironmentFault,
    InputError,
    Interrupted,
    MismatchError,
    UsageError,
    kind_of,
)
from .findings import Finding, emit, paragraph
from .signals import StopWaiting, exit_status, signal_name, stop_at_once, stop_requested

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# The exit status of each kind of error (interrupted: `signals.exit_status`, 130 / 143).
EXIT_STATUS: dict[type[DflashError], int] = {
    UsageError: EXIT_USAGE, InputError: EXIT_USAGE, CorruptDataError: EXIT_USAGE,
    MismatchError: EXIT_USAGE, EnvironmentFault: EXIT_USAGE,
}

def echo_error(text: str) -> None:
    """The one error shape: "Error: ..." as one paragraph on stderr."""
    click.echo(paragraph(f"Error: {text}"), err=True)


def os_error_finding(e: OSError, code: str = "runtime.os-error") -> Finding:
    """An OSError (disk full, permission denied, missing file): its reason and its path, for the
    command's renderer `code`."""
    return Finding(code, error=str(e.strerror or e), file=str(e.filename) if e.filename else None)


def device_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is torch's out-of-memory error of a device (told by its class, so that a
    command that never imported torch does not import it here)."""
    return any(c.__name__ == "OutOfMemoryError" and c.__module__.startswith("torch") for c in type(e).__mro__)


def out_of_memory_finding(name: str, e: BaseException, code: str = "runtime.out-of-memory") -> Finding:
    """torch's out-of-memory error of command `name`: what ran out (its first sentence, with the
    sizes), for the command's renderer `code` (which says what to lower)."""
    return Finding(code, command=name, error=str(e).split(". ", 1)[0].strip().rstrip("."))


def compile_failed(e: BaseException) -> bool:
    """Whether `e` is torch.compile's failure to build kernels (dynamo or inductor, told by the
    class, so that a command that never imported torch does not import it here)."""
    return any(c.__name__ in ("TorchDynamoException", "InductorError") and c.__module__.startswith("torch")
               for c in type(e).__mro__)


def compile_failed_finding(name: str, e: BaseException, code: str = "runtime.compile-failed") -> Finding:
    """torch.compile's failure in command `name`: its first line, for the command's renderer `code`
    (which says how to run without compiling)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return Finding(code, command=name, error=first[:300])


class _Contract:
    """Runs a click command under the exit-status table (mixed into Command and Group).

    Four finding codes, each rendered by the command's package (its messages module), say what
    is the command's own: `stop_note` the stop ("<command> stopped by SIGINT" and what was kept
    and how to go on; fields `command`, `signal`), `os_error_advice` an OSError (`error`, `file`:
    `os_error_finding`), `oom_advice` an out-of-memory error of the device (`command`, `error`:
    `out_of_memory_finding`; an environment fault: no traceback), `compile_advice` torch.compile's
    failure to build kernels (`command`, `error`: `compile_failed_finding`; after its traceback,
    which a report of it needs, how to run without compiling).
    """

    stop_note = "runtime.stopped"
    os_error_advice = "runtime.os-error"
    oom_advice = "runtime.out-of-memory"
    compile_advice = "runtime.compile-failed"

    def __init__(self, *args: Any, stop_note: str | None = None, os_error_advice: str | None = None,
                 oom_advice: str | None = None, compile_advice: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if stop_note is not None:
            self.stop_note = stop_note
        if os_error_advice is not None:
            self.os_error_advice = os_error_advice
        if oom_advice is not None:
            self.oom_advice = oom_advice
        if compile_advice is not None:
            self.compile_advice = compile_advice

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        parent = super()
        if not standalone_mode:  # the caller handles errors itself
            return parent.main(args, prog_name, complete_var, standalone_mode=False, **extra)  # type: ignore[misc]
        def invoke() -> Any:
            # (inside run_reporting_errors: a signal that lands while the handlers are being set
            # is reported as any other stop, not as a traceback)
            with stop_at_once():
                return parent.main(args, prog_name, complete_var, standalone_mode=False, **extra)  # type: ignore[misc]

        sys.exit(self.run_reporting_errors(invoke))

    def run_reporting_errors(self, invoke: Any) -> int:
        """Call `invoke` and map what it raises to the exit-status table (SystemExit passes)."""
        name = self.name  # type: ignore[attr-defined]
        try:
            returned = invoke()
        except click.UsageError as e:
            hint = f" See '{e.ctx.command_path} --help'." if e.ctx is not None else ""
            echo_error(f"{e.format_message()}{hint}")
            return EXIT_USAGE
        except click.ClickException as e:  # e.g. a file click could not open
            echo_error(e.format_message())
            return EXIT_USAGE
        except DflashError as e:
            echo_error(str(e))
            return EXIT_STATUS.get(kind_of(e), EXIT_USAGE)
        except (Interrupted, StopWaiting, KeyboardInterrupt, click.Abort) as e:
            # (StopWaiting: a wait given up for a stop that no loop of this command turned into its own)
            signum = (e.signum if isinstance(e, Interrupted) else
                      stop_requested() or signal.SIGTERM if isinstance(e, StopWaiting) else signal.SIGINT)  # Ctrl-C
            emit(Finding(self.stop_note, command=name, signal=signal_name(signum)), prefix="")
            return exit_status(signum)
        except OSError as e:  # disk full, permission denied, a file that vanished, ...
            emit(os_error_finding(e, self.os_error_advice), prefix="Error: ")
            return EXIT_STATUS[EnvironmentFault]
        except Exception as e:  # a bug: keep the traceback, it is what a report needs
            if device_out_of_memory(e):  # not a bug: the batch does not fit beside what else is there
                emit(out_of_memory_finding(name, e, self.oom_advice), prefix="Error: ")
                return EXIT_STATUS[EnvironmentFault]
            traceback.print_exc()
            if compile_failed(e):  # torch's compiler or its toolchain: say how to go on without it
                emit(compile_failed_finding(name, e, self.compile_advice), prefix="Error: ")
                return EXIT_FAILED
            echo_error(f"unexpected {type(e).__name__} in {name}: {e}. This is a bug, not a problem "
                       "with your input: please report it with the traceback above.")
            return EXIT_FAILED
        # click returns the status of --help (0) or ctx.exit(n); a command may return its own.
        return returned if isinstance(returned, int) and not isinstance(returned, bool) else EXIT_OK


class Command(_Contract, click.Command):
    """A click command under the dflash exit-status and error-message contract."""


class Group(_Contract, click.Group):
    """A click group under the dflash exit-status and error-message contract."""
