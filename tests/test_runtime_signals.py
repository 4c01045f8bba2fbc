"""runtime/signals.py in-process: a stop signal outside a unit of work is never lost."""

from __future__ import annotations

import gc
import os
import signal
import sys

import pytest
from dflash.runtime.errors import Interrupted
from dflash.runtime.signals import StopRequest, stop_at_once


class SignalInFinalizer:
    """Collected, it takes `signum` while its finalizer runs: the handler's exception is raised
    inside `__del__`, where Python prints "Exception ignored" and goes on."""

    def __init__(self, signum: int):
        self.signum = signum

    def __del__(self):
        signal.raise_signal(self.signum)
        for _ in range(10_000):  # Python code after it: the handler runs here, inside __del__
            pass


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_signal_whose_interruption_a_finalizer_swallowed_stops_before_the_next_unit_of_work(signum, monkeypatch):
    reported = []  # what Python would print as "Exception ignored in ... Traceback"
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    started = []
    with pytest.raises(Interrupted) as stopped:
        with stop_at_once():
            SignalInFinalizer(signum)  # no name holds it: collected at once
            gc.collect()
            with StopRequest():  # (extraction's parts, training's steps) must not begin
                started.append(True)
    assert stopped.value.signum == signum and not started
    assert reported == []  # no traceback of the swallowed one on the console
    assert sys.unraisablehook == reported.append  # put back


def test_other_unraisable_exceptions_are_still_reported(monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)

    class Broken:
        def __del__(self):
            raise ValueError("a finalizer's own bug")

    with stop_at_once():
        Broken()
        gc.collect()
    assert [type(r.exc_value) for r in reported] == [ValueError]


def test_a_signal_that_stopped_a_command_does_not_stop_the_next_one_in_the_same_process():
    with pytest.raises(Interrupted):
        with stop_at_once():
            signal.raise_signal(signal.SIGTERM)
            for _ in range(10_000):
                pass
    with stop_at_once():
        with StopRequest() as stop:
            pass
    assert not stop.requested


def test_dflash_eval_stops_at_its_next_batch_after_a_swallowed_signal():
    from dflash.eval.run import _timed_batches

    decoded = []

    def decode(batch, config):
        decoded.append(batch)
        if len(decoded) == 1:
            SignalInFinalizer(signal.SIGINT)  # the first batch's garbage takes the Ctrl-C
            gc.collect()
        return batch

    with pytest.raises(Interrupted):
        with stop_at_once():
            _timed_batches(decode, [[1], [2], [3]], None, 1, __import__("torch").device("cpu"))
    assert decoded == [[[1]]]  # the batches after the signal were not decoded


def test_a_signal_that_lands_while_the_handlers_are_set_is_a_stop_not_a_traceback(monkeypatch, capsys):
    import click
    from dflash.runtime import signals
    from dflash.runtime.cli import Command

    before = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    real = signal.signal
    calls = []

    def lands_after_the_first(signum, handler):  # SIGTERM arrives just after the first handler is set
        previous = real(signum, handler)
        calls.append(signum)
        if len(calls) == 1:
            raise Interrupted(signal.SIGTERM)
        return previous

    @click.command(cls=Command)
    def tool():
        raise AssertionError("the command does not start")

    monkeypatch.setattr(signals.signal, "signal", lands_after_the_first)
    with pytest.raises(SystemExit) as ended:
        tool.main([], prog_name="tool")
    monkeypatch.setattr(signals.signal, "signal", real)
    assert ended.value.code == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    assert {s: signal.getsignal(s) for s in signals.STOP_SIGNALS} == before  # the one set is put back


def test_a_wait_given_up_for_a_stop_that_no_loop_handled_exits_with_the_signals_status():
    """A StopWaiting no loop of the command turned into its own stop (a remote fetch's wait in a
    command other than training) is a stop at the CLI boundary, not an unexpected failure."""
    import click
    from click.testing import CliRunner
    from dflash.runtime.cli import Command
    from dflash.runtime.signals import StopRequest, check_stop

    @click.command(cls=Command, name="waiter")
    def waiter() -> None:
        with StopRequest():
            os.kill(os.getpid(), signal.SIGTERM)
            check_stop("an object")

    result = CliRunner().invoke(waiter, [], standalone_mode=True)
    assert result.exit_code == 143, result.output
    assert "Traceback" not in result.output and "unexpected" not in result.output
