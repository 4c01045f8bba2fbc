"""runtime.locks: one writer per directory, refused with the holder's pid, gone with its process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from dflash.runtime.findings import Finding, render
from dflash.runtime.locks import PURPOSES, LockedError, WriterLock, inside, same_path
from dflash.runtime.messages import LOCK_WORDS

HOLDER = textwrap.dedent("""
    import sys, time
    from dflash.runtime.locks import WriterLock
    lock = WriterLock(sys.argv[1], purpose="run", output="runs/a", shared=sys.argv[2] == "shared")
    print("held", flush=True)
    time.sleep(60)
""")


def hold_in_child(path, kind: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), kind], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_exclusive_writer_is_refused_with_the_holders_pid_and_kill9_frees_the_lock(tmp_path):
    path = tmp_path / ".lock"
    child = hold_in_child(path, "exclusive")
    try:
        with pytest.raises(LockedError) as e:
            WriterLock(path, purpose="run", output=tmp_path)
        assert e.value.code == "runtime.locked" and e.value.fields["lock_file"] == str(path)
        assert (e.value.fields["purpose"], e.value.fields["output"]) == ("run", str(tmp_path))
        assert e.value.fields["holder"].startswith(f"pid {child.pid} on ")
        with pytest.raises(LockedError) as e:
            WriterLock(path, purpose="run", output=tmp_path, shared=True)
        assert e.value.fields["holder"].startswith(f"pid {child.pid} ")
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    with WriterLock(path, purpose="run", output=tmp_path):  # nothing stale after kill -9
        assert f"pid {os.getpid()} " in path.read_text()


def test_shared_holders_coexist_but_keep_an_exclusive_writer_out(tmp_path):
    path = tmp_path / ".lock"
    child = hold_in_child(path, "shared")
    try:
        with WriterLock(path, purpose="extract", output=tmp_path, shared=True) as mine:
            holders = path.read_text().splitlines()
            assert len(holders) == 2 and holders[0].startswith(f"pid {child.pid} ")
            with pytest.raises(LockedError) as e:
                mine.exclusive(purpose="extract-force")
            assert e.value.code == "runtime.locked" and e.value.fields["holder"].startswith(f"pid {child.pid} ")
            assert (e.value.fields["purpose"], e.value.fields["output"]) == ("extract-force", str(tmp_path))
        with pytest.raises(LockedError):
            WriterLock(path, purpose="extract-force", output=tmp_path)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    WriterLock(path, purpose="extract-force", output=tmp_path).release()


def test_paths_through_links_are_the_same(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "d")
    assert same_path(tmp_path / "link" / "f", tmp_path / "d" / "f")
    assert same_path(tmp_path / "link" / "new", tmp_path / "d" / "new")  # not there yet
    assert not same_path(tmp_path / "d" / "f", tmp_path / "d" / "g")
    assert inside(tmp_path / "link" / "cache", tmp_path / "d") and not inside(tmp_path, tmp_path / "d")



CONVERTER = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what a shared taker does for an instant when it is alone
    print("alone", flush=True)
    time.sleep(0.3)
    fcntl.flock(fd, fcntl.LOCK_SH)
    time.sleep(60)
""")


def test_a_shared_taker_is_not_refused_by_another_taker_of_the_run_converting_to_shared(tmp_path):
    path = tmp_path / ".lock"
    child = subprocess.Popen([sys.executable, "-c", CONVERTER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "alone"
        with WriterLock(path, purpose="extract", output=tmp_path, shared=True) as lock:  # waits out the instant
            assert lock.shared
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


FORKING_HOLDER = textwrap.dedent("""
    import os, sys, time
    from dflash.runtime.locks import WriterLock
    lock = WriterLock(sys.argv[1], purpose="run", output="runs/a")
    worker = os.fork()
    if worker == 0:  # a worker process (a DataLoader's), alive after its parent dies
        os.write(1, b"worker\\n")  # running: past the fork and its handlers
        time.sleep(30)
        os._exit(0)
    # one write a line: with PYTHONUNBUFFERED=1, print's text and newline are two writes, which
    # the two processes interleave on the shared pipe
    os.write(1, f"held {worker}\\n".encode())
    time.sleep(60)
""")


def test_a_killed_holders_forked_workers_do_not_keep_its_lock(tmp_path):
    path = tmp_path / ".lock"
    holder = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    lines = sorted(holder.stdout.readline().split() for _ in range(2))  # the two in either order
    assert lines[0][0] == "held" and lines[1] == ["worker"]
    worker = lines[0][1]
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    try:
        with WriterLock(path, purpose="run", output=tmp_path):  # the orphaned worker holds nothing
            pass
    finally:
        os.kill(int(worker), signal.SIGKILL)


@pytest.mark.parametrize("purpose", PURPOSES)
def test_each_lock_purpose_renders_the_thing_written_the_holder_and_a_fix(purpose):
    # The caller states what writes (a purpose), the renderer says what the refused user can do.
    text = render(Finding("runtime.locked", purpose=purpose, output="runs/x", holder="pid 7 on h",
                          lock_file="runs/x/.writer.lock"))
    assert "runs/x is being written by another process (pid 7 on h; lock file runs/x/.writer.lock)" in text
    assert text.split("). ", 1)[1].strip()  # a fix follows


def test_a_lock_of_no_known_purpose_is_a_bug(tmp_path):
    with pytest.raises(ValueError):
        WriterLock(tmp_path / ".lock", purpose="the thing", output=tmp_path)


def test_every_lock_purpose_has_its_words():
    assert set(LOCK_WORDS) == set(PURPOSES)


def test_a_lock_a_stop_signal_interrupted_before_its_init_ran_is_dropped_quietly():
    # A stop signal's exception can come before __init__'s first line, and __del__ then runs on the
    # half-made object: it must not print a traceback beside the run's stop message.
    import gc

    seen = []
    hook, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        half = WriterLock.__new__(WriterLock)
        del half
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert seen == []
