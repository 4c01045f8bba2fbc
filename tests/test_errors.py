"""One error family by what went wrong: every error of every stage is of exactly one kind, and
the kind decides the exit status."""

from __future__ import annotations

import importlib
import pkgutil
import signal

import click
import pytest
from click.testing import CliRunner
from dflash.runtime.cli import EXIT_STATUS, Command
from dflash.runtime.errors import KINDS, DflashError, Interrupted, kind_of

PACKAGES = ("dflash.runtime", "dflash.cache_tools", "dflash.prepare", "dflash.extract", "dflash.train",
            "dflash.eval", "dflash.demo")


def project_error_classes() -> set[type]:
    for name in PACKAGES:
        package = importlib.import_module(name)
        for module in pkgutil.walk_packages(package.__path__, f"{name}."):
            importlib.import_module(module.name)
    found, todo = set(), [DflashError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found and sub.__module__.startswith("dflash."):
                found.add(sub)
                todo.append(sub)
    return found


def test_every_error_of_the_project_is_of_exactly_one_kind():
    classes = project_error_classes() - set(KINDS)
    assert len(classes) > 15  # the stages' errors were found (cache, train, prepare, extract, eval, demo)
    wrong = {cls.__qualname__: [k.__name__ for k in KINDS if issubclass(cls, k)] for cls in classes}
    wrong = {name: kinds for name, kinds in wrong.items() if len(kinds) != 1}
    assert not wrong, f"errors of none or several kinds: {wrong}"


def test_the_kinds_are_what_the_misfiled_errors_now_derive_from():
    from dflash.cache_tools.errors import CacheCorruptError, ConfigMismatchError
    from dflash.prepare.render import RenderError
    from dflash.runtime.errors import CorruptDataError, InputError, MismatchError
    from dflash.train.run.checkpoint import CheckpointCorruptError

    assert issubclass(CheckpointCorruptError, CorruptDataError)  # an unreadable checkpoint
    assert issubclass(ConfigMismatchError, MismatchError)  # e.g. a target the cache was not extracted from
    assert issubclass(CacheCorruptError, CorruptDataError)
    assert issubclass(RenderError, InputError)


def test_an_interruption_is_no_exception_that_a_handler_could_swallow():
    assert not issubclass(Interrupted, Exception)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_each_kind_exits_with_its_status_in_one_paragraph(kind):
    @click.command(cls=Command, name="dflash-x")
    def main() -> None:
        raise kind("part-000003 of /c: what went wrong.\nWhat to do.")

    result = CliRunner().invoke(main, [])
    assert result.exit_code == EXIT_STATUS[kind] == EXIT_STATUS[kind_of(kind("x"))]
    assert "Error: part-000003 of /c: what went wrong. What to do." in result.output
    assert "Traceback" not in result.output


def test_an_interruption_exits_with_the_signal_status():
    @click.command(cls=Command, name="dflash-x")
    def main() -> None:
        raise Interrupted(signal.SIGTERM)

    assert CliRunner().invoke(main, []).exit_code == 143
