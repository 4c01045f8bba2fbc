"""The error family, sorted by what went wrong.

Every error raised on purpose derives from `DflashError` through exactly one kind:

  UsageError        a flag, a config-file key or a combination of settings is wrong
  InputError        a file or record the user gave (data, model, cache, run directory) is
                    missing, malformed or unusable as it is
  CorruptDataError  stored bytes are damaged: a checksum mismatch, a truncated or unreadable file
  MismatchError     two things that must agree do not: a cache and the settings, a checkpoint
                    and the run, a target and the cache it was extracted from
  EnvironmentFault  the machine lacks what the command needs: a device, memory, a writable
                    disk with free space, a package, a reachable server
  Interrupted       SIGINT or SIGTERM (a BaseException, so that no `except Exception` swallows it)

A stage's own errors (`CacheCorruptError`, `TrainConfigError`, `RenderError`, ...) derive
from the kind that describes them; the CLIs catch the family once and print the message as one
paragraph with the kind's exit status (`dflash.runtime.cli`). A message says what was wrong,
where (file, line, sample, part, chunk) and what to do.
"""

from __future__ import annotations

from .findings import Finding, render


class DflashError(Exception):
    """Base of every error the pipeline raises on purpose; raise one of its kinds.

    Built from a `Finding` (`raise InputError(Finding("x.y", file=...))`), the error carries it
    (`finding`, `code`, `fields`) and reads as its rendered paragraph; built from text, `finding`
    is None."""

    def __init__(self, *args: object):
        self.finding = args[0] if len(args) == 1 and isinstance(args[0], Finding) else None
        super().__init__(*args)

    @property
    def code(self) -> str | None:
        return self.finding.code if self.finding is not None else None

    @property
    def fields(self) -> dict:
        return dict(self.finding.fields) if self.finding is not None else {}

    def __str__(self) -> str:
        return render(self.finding) if self.finding is not None else super().__str__()


class UsageError(DflashError):
    """Bad usage: a flag, a config-file setting or a combination of them is wrong."""


class InputError(DflashError):
    """Bad input: a user-supplied file or record is missing, malformed or unusable as it is."""


class CorruptDataError(DflashError):
    """Corrupt data: stored bytes do not match their checksum, or a file is truncated or unreadable."""


class MismatchError(DflashError):
    """A mismatch: two things that must agree (cache and settings, checkpoint and run, target
    and cache, server and chat template) do not."""


class EnvironmentFault(DflashError):
    """The environment: the machine lacks a device, memory, disk space or a writable location,
    a package, or a server that answers."""


KINDS: tuple[type[DflashError], ...] = (UsageError, InputError, CorruptDataError, MismatchError,
                                         EnvironmentFault)


def kind_of(error: DflashError) -> type[DflashError]:
    """The kind `error` belongs to (the first in its MRO; DflashError itself for none, which
    tests/test_errors.py refuses in the source)."""
    return next((cls for cls in type(error).__mro__ if cls in KINDS), DflashError)


class SettingError(UsageError, ValueError):
    """A flag or config-file setting is missing, unknown, out of range or inconsistent."""


class Interrupted(BaseException):
    """SIGINT/SIGTERM where there is no unit of work to finish: the command stops at once."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
