"""kill -9 at random moments: a seeded chain of at least 20 kills of the same resumable job, per
stage. After every kill, everything committed reads back clean and nothing half-written is
visible; the final rerun's result is bit-identical to the uninterrupted run's."""

from __future__ import annotations

import random
import signal

from dflash.cache_tools.reader import CacheReader
from dflash.train.run.checkpoint import Checkpointer

from .helpers import (
    cache_hash,
    committed_parts,
    complete_checkpoints,
    extract_argv,
    train_config_file,
    wait_until,
    weights_hash,
)

KILLS = 20


def kill_chain(zygote, start, check, *, kills: int, delays: tuple[float, float], seed: int):
    """Start the job, kill -9 it after a random delay, check, repeat until `kills` kills hit a
    live process; a run that finishes before its kill closes the chain (start() gets a new one).
    Returns the runs killed and the chains completed."""
    rng = random.Random(seed)
    killed, completed, chain = [], 0, 0
    while len(killed) < kills:
        run = start(chain)
        # Until the kill moment, or less where the run ends before it (no kill then: the same
        # runs are killed at the same moments as by a plain sleep, without idling after the end).
        if run.wait(timeout=rng.uniform(*delays)) is None:
            run.signal(signal.SIGKILL)  # (it notes the run's children first)
        status = run.wait(timeout=10)
        if status == -signal.SIGKILL:
            killed.append(run)
            check(chain)
        else:  # it finished first (possibly just before the kill)
            assert status == 0, run.output()
            completed += 1
            chain += 1
    return killed, completed, chain


def test_extraction_killed_20_times_at_random_moments_ends_identical(zygote, world, tmp_path):
    env = {"DFLASH_TEST_SLEEP_PER_PART": "0.08", "DFLASH_TEST_SLEEP_BEFORE_COMMIT": "0.02"}

    def out(chain):
        return tmp_path / f"cache-{chain}"

    def start(chain):
        return zygote.run("extract", extract_argv(world["target"], world["data"], out(chain)), env=env)

    def check(chain):
        if committed_parts(out(chain)):  # what is committed reads back clean
            reader = CacheReader(out(chain))
            for i in range(len(reader)):
                reader.read_sample(i)

    killed, completed, last = kill_chain(zygote, start, check, kills=KILLS, delays=(0.05, 0.9), seed=7)
    assert len(killed) == KILLS
    final = start(last)
    assert final.wait() == 0, final.output()
    for chain in range(last + 1):
        assert cache_hash(out(chain)) == world["cache_hash"], f"chain {chain} differs"
        assert not [p for p in (out(chain) / "parts").iterdir() if p.name.startswith(".tmp-")]


def test_training_killed_20_times_at_random_moments_ends_with_identical_weights(zygote, world, tmp_path):
    def out(chain):
        return tmp_path / f"run-{chain}"

    configs = {w: train_config_file(tmp_path / f"train-{w}.json", world["cache"], world["target"], num_workers=w)
               for w in (0, 1)}
    runs = []

    def start(chain):
        # Every third run reads through a DataLoader worker, which must die with its trainer.
        config = configs[1 if len(runs) % 3 == 2 else 0]
        runs.append(zygote.run("train", ["--config", config, "--output-dir", out(chain)],
                               env={"DFLASH_TEST_SLEEP_PER_BATCH": "0.01"}))
        return runs[-1]

    def check(chain):
        checkpoints = Checkpointer(out(chain))
        for name in complete_checkpoints(out(chain)):  # a step-N directory is always complete
            checkpoints.load(out(chain) / "checkpoints" / name)

    killed, completed, last = kill_chain(zygote, start, check, kills=KILLS, delays=(0.05, 0.8), seed=11)
    assert len(killed) == KILLS
    final = start(last)
    assert final.wait() == 0, final.output()
    for chain in range(last + 1):
        assert weights_hash(out(chain)) == world["weights_hash"], f"chain {chain} differs"
    # No writer or DataLoader worker outlives its killed trainer (workers notice within seconds).
    orphans = {p for run in killed for p in run.seen_children}
    wait_until(lambda: not [p for run in killed for p in run.surviving_children()], timeout=15,
               what=f"the end of the killed runs' children {sorted(orphans)}")


def test_kill9_of_extraction_leaves_no_writer_process_behind(zygote, world, tmp_path):
    out = tmp_path / "cache"
    run = zygote.run("extract", extract_argv(world["target"], world["data"], out, "--num-writers", "1"),
                     env={"DFLASH_TEST_SLEEP_BEFORE_COMMIT": "0.5"})
    wait_until(lambda: [p for p in (out / "parts").glob(".tmp-part-*") if p.is_dir()] if (out / "parts").is_dir()
               else False, what="a writer process writing a part")
    assert run.watch_children()
    run.signal(signal.SIGKILL)
    assert run.wait(timeout=10) == -signal.SIGKILL
    # The writer notices its parent's death within about a second (it may first finish the
    # part it holds: a complete part, committed by the protocol, is not damage).
    assert run.surviving_children(grace=10) == []
    final = zygote.run("extract", extract_argv(world["target"], world["data"], out))
    assert final.wait() == 0, final.output()
    assert cache_hash(out) == world["cache_hash"]
