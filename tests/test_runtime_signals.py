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


def test_a_polled_block_records_a_signal_and_raises_it_where_it_asks_or_as_it_ends():
    from dflash.runtime.signals import signals_polled, stop_if_signalled, stop_requested

    with stop_at_once():
        with pytest.raises(Interrupted) as stopped, signals_polled():
            signal.raise_signal(signal.SIGTERM)
            for _ in range(10_000):  # Python code after it: a raising handler would have run here
                pass
            assert stop_requested() == signal.SIGTERM  # what the pool's threads look at
            reached = True
            stop_if_signalled()
            reached = False
        assert reached and stopped.value.signum == signal.SIGTERM
        with pytest.raises(Interrupted), signals_polled():  # not asked in the block: raised as it ends
            signal.raise_signal(signal.SIGINT)
            done = True
        assert done


def test_a_polled_block_leaves_other_handlers_alone():
    from dflash.runtime.signals import signals_polled

    with StopRequest(on_second=None) as stop:  # a unit of work's handler records a signal already
        with signals_polled():
            assert signal.getsignal(signal.SIGTERM) == stop._handle
    before = signal.getsignal(signal.SIGTERM)  # no command's handler at all
    with signals_polled():
        assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_during_the_wait_on_an_upload_pool_is_raised_between_slices_not_inside_the_pools_locks(monkeypatch):
    """An Interrupted raised between two of `concurrent.futures.wait`'s lock acquisitions left a
    future's lock held: the thread finishing that future blocked on it, and the pool's shutdown
    waited for the thread forever (a stopped upload that never exited)."""
    from dflash.cache_tools import remote_store

    real_wait, inside = remote_store.wait, []

    def wait(*args, **kwargs):
        inside.append(True)
        signal.raise_signal(signal.SIGTERM)  # as if it landed inside the pool's own code
        for _ in range(10_000):
            pass
        result = real_wait(*args, **kwargs)
        inside.pop()
        return result

    monkeypatch.setattr(remote_store, "wait", wait)

    def work(item, stop):
        stop.wait(5)  # until the pool is told to stop
        remote_store.check_stop(stop)
        return item

    with stop_at_once(), pytest.raises(Interrupted) as stopped:
        remote_store.run_parallel(work, [1, 2, 3], threads=1)
    assert stopped.value.signum == signal.SIGTERM
    assert inside == []  # every wait returned whole: the stop was raised between two of them
