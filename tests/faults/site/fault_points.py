"""Slow points for the fault campaign, installed from the tests into the CLI runs they start.

A fault test needs a run to linger at a known point (inside a forward, between a part's files
and its commit, mid-checkpoint, ...) so that it can signal or kill it there. The product has
no hooks for that: `install()` wraps the product function at that point so that it sleeps
before or after calling the real one. It reads one environment variable per point (seconds,
or for DFLASH_TEST_HOLD_AT "checkpoint-saved:STEP"), and changes nothing when none is set.

It runs in every process of a run: the zygote's forked run calls `install()` once its
environment is set (faults/zygote.py), and a process started afresh from it (the extraction
writers' fork server) imports this directory's sitecustomize.py, which the zygote puts on
PYTHONPATH. Forked children (DataLoader workers, writers) inherit the wrapped functions.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import os
import sys
import time
from collections.abc import Mapping

SLEEP_PER_PART = "DFLASH_TEST_SLEEP_PER_PART"  # after each part is handed to the writers
SLEEP_PER_FORWARD = "DFLASH_TEST_SLEEP_PER_FORWARD"  # before every target forward is launched
SLEEP_BEFORE_COMMIT = "DFLASH_TEST_SLEEP_BEFORE_COMMIT"  # between a part's files and its commit
SLEEP_PER_BATCH = "DFLASH_TEST_SLEEP_PER_BATCH"  # before every batch read (in the worker if any)
SLEEP_IN_WORKER_INIT = "DFLASH_TEST_SLEEP_IN_WORKER_INIT"  # at the end of a DataLoader worker's init
SLEEP_IN_CHECKPOINT = "DFLASH_TEST_SLEEP_IN_CHECKPOINT"  # a checkpoint staged, before its rename
HOLD_AT = "DFLASH_TEST_HOLD_AT"  # "checkpoint-saved:STEP": asleep for good once STEP is saved
USAGE_AT_COMMIT = "DFLASH_TEST_USAGE_AT_COMMIT"  # a file: each commit appends the parts' bytes on disk
POINTS = (SLEEP_PER_PART, SLEEP_PER_FORWARD, SLEEP_BEFORE_COMMIT, SLEEP_PER_BATCH, SLEEP_IN_WORKER_INIT,
          SLEEP_IN_CHECKPOINT, HOLD_AT, USAGE_AT_COMMIT)



def _seconds(value: str) -> float:
    return float(value or 0)


def _sleep_before(owner, name: str, seconds: float) -> None:
    real = getattr(owner, name)

    @functools.wraps(real)
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    slow.fault_point = True
    setattr(owner, name, slow)


def _sleep_after(owner, name: str, seconds: float) -> None:
    real = getattr(owner, name)

    @functools.wraps(real)
    def slow(*args, **kwargs):
        result = real(*args, **kwargs)
        time.sleep(seconds)
        return result

    slow.fault_point = True
    setattr(owner, name, slow)


# point -> (the module it patches, how)
PATCHES = {
    SLEEP_PER_PART: ("dflash.extract.loop", lambda m, v: _sleep_after(m.ExtractionLoop, "_submit", _seconds(v))),
    SLEEP_PER_FORWARD: ("dflash.extract.engine",
                        lambda m, v: _sleep_before(m.ExtractionEngine, "launch", _seconds(v))),
    # PartWriter writes a part's files with write_part_group, then fsyncs and commits them
    SLEEP_BEFORE_COMMIT: ("dflash.cache_tools.writer",
                          lambda m, v: _sleep_after(m, "write_part_group", _seconds(v))),
    SLEEP_PER_BATCH: ("dflash.train.data.loader", lambda m, v: _sleep_before(m, "read_batch", _seconds(v))),
    SLEEP_IN_WORKER_INIT: ("dflash.train.data.loader", lambda m, v: _sleep_after(m, "worker_init", _seconds(v))),
    SLEEP_IN_CHECKPOINT: ("dflash.train.run.checkpoint",
                          lambda m, v: setattr(m, "staged_dir", _slow_stage(m.staged_dir, _seconds(v)))),
    HOLD_AT: ("dflash.train.run.checkpoint",
              lambda m, v: setattr(m.Checkpointer, "save", _hold_after_save(m.Checkpointer.save, v))),
    USAGE_AT_COMMIT: ("dflash.cache_tools.writer",
                      lambda m, v: setattr(m.CacheWriter, "commit", _usage_after_commit(m.CacheWriter.commit, v))),
}
_installed: set[str] = set()
_pending: dict[str, list[tuple[str, str]]] = {}  # module not imported yet -> [(point, value)]


def install(env: Mapping[str, str] | None = None) -> None:
    """Wrap the product functions at the points `env` (default: os.environ) names, once per
    process: at once where the module is imported, else when it is (no import here: a helper
    process that never loads the module, such as multiprocessing's resource tracker, starts as
    fast as without this)."""
    env = os.environ if env is None else env
    for point, (module, _) in PATCHES.items():
        if not env.get(point) or point in _installed:
            continue
        _installed.add(point)
        if module in sys.modules:
            PATCHES[point][1](sys.modules[module], env[point])
        else:
            _pending.setdefault(module, []).append((point, env[point]))
    if _pending and not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds a pending module through the other finders and patches it right after it runs."""

    def find_spec(self, name, path, target=None):
        if name not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            for point, value in _pending.pop(name, []):
                PATCHES[point][1](module, value)

        spec.loader.exec_module = exec_module
        return spec


def _slow_stage(real, seconds: float):
    """staged_dir that sleeps once the stage is filled, before it is renamed into place."""

    @contextlib.contextmanager
    @functools.wraps(real)
    def slow(*args, **kwargs):
        with real(*args, **kwargs) as stage:
            yield stage
            time.sleep(seconds)

    slow.fault_point = True
    return slow


def _hold_after_save(real, hold_at: str):
    """Checkpointer.save that, once the checkpoint of the step in `hold_at` is in place and the
    old ones pruned, prints "test hold: checkpoint-saved STEP" and sleeps until killed."""

    @functools.wraps(real)
    def save(self, step: int, *args, **kwargs):
        final = real(self, step, *args, **kwargs)
        if hold_at == f"checkpoint-saved:{step}":
            sys.stderr.write(f"test hold: checkpoint-saved {step}\n")
            sys.stderr.flush()
            while True:
                time.sleep(3600)
        return final

    save.fault_point = True
    return save


def _usage_after_commit(real, path: str):
    """CacheWriter.commit that appends "<part> <bytes the cache allocates> <bytes of the committed
    part>" to `path` right after each commit, under the cache lock (no eviction can run meanwhile):
    the blocks of the whole cache directory, what --disk-budget counts."""
    from dflash.cache_tools.manifest import LOCK_FILE
    from dflash.cache_tools.staging import disk_usage
    from dflash.runtime.fsio import file_lock

    @functools.wraps(real)
    def commit(self, tmp_dir, record):
        done = real(self, tmp_dir, record)
        with file_lock(self.cache_dir / LOCK_FILE), open(path, "a") as f:
            f.write(f"{record.name} {disk_usage(self.cache_dir, allocated=True)} {record.nbytes}\n")
        return done

    commit.fault_point = True
    return commit
