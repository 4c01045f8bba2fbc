"""No process hangs after an error (issue #33, bug 1): a full file system under 1, 2 and 0
writer processes ends the extraction with one clear error and exit 2 within seconds, and no
writer outlives it (with one writer it used to print the error and never exit: the main
thread joined the task queue's feeder thread, blocked writing into a pipe only it held: a task
larger than the pipe's buffer, which the killed writer never read)."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from .helpers import extract_argv, make_records, wait_until, write_jsonl
from .test_storage import tmpfs


@pytest.mark.parametrize("writers", [1, 2, 0])
def test_a_full_disk_ends_the_extraction_and_its_writers_within_seconds(zygote, world, tmp_path, writers):
    # Parts of 20,000 tokens: a task's input_ids (80 KB) outgrow the pipe's buffer, and the
    # first part does not fit in 2 MB.
    data = write_jsonl(tmp_path / "data.jsonl", make_records(2000, seed=2))
    with tmpfs(tmp_path / "small", "2m") as mnt:
        run = zygote.run("extract", extract_argv(world["target"], data, mnt / "cache", "--part-tokens", "20000",
                                                 "--sort-window-tokens", "0",
                                                 "--num-writers", str(writers)))
        if writers:
            wait_until(lambda: len(run.watch_children()) >= 1, timeout=60, what="the writer processes")
        start = time.monotonic()
        status = run.wait(timeout=60)
        text = run.output()
        assert status == 2, f"status {status} after {time.monotonic() - start:.0f} s: {text[-2000:]}"
        assert "No space left on device" in text and "Traceback" not in text
        assert run.surviving_children(grace=5.0) == []


def test_a_full_disk_ends_a_fresh_interpreter_without_leaked_resource_warnings(world, tmp_path):
    """The console script in a fresh interpreter (the zygote's runs share its resource tracker,
    which never reported): after the error paragraph came the resource tracker's "leaked
    semaphore" (numcodecs' lock in a writer killed instead of stopped) and "leaked shared_memory"
    (the segment of a part the loop was filling) warnings."""
    data = write_jsonl(tmp_path / "data.jsonl", make_records(2000, seed=2))
    with tmpfs(tmp_path / "small", "2m") as mnt:
        run = subprocess.run([shutil.which("dflash-extract"), *extract_argv(
            world["target"], data, mnt / "cache", "--part-tokens", "20000", "--sort-window-tokens", "0",
            "--num-writers", "1")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    error = run.stderr[run.stderr.index("Error: "):]
    assert "No space left on device" in error and "leaked" not in error and "Warning" not in error, error
