"""Every wait of a training run honours a stop, and every wait can end (issue #52).

A `dflash-train --follow` run waits for what dflash-extract has not written yet: a part (in the
trainer itself, or in its DataLoader workers while the trainer waits for their batch), or the
extraction plan. The first SIGINT/SIGTERM ends each such wait within 10 s with 130/143, after a
checkpoint of the last completed step where one is due. A follow run that could only wait
forever (a remote URL, a path that is no cache and where no extraction can begin, a cache whose
plan will never come) is refused at startup, exit 2, naming what it was given.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from conftest import free_port

from .helpers import complete_checkpoints, logged_steps, train_config_file, wait_until, weights_hash

STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}
FOLLOW = dict(follow=True, shuffle_parts=4, eval_fraction=0)


def partial_cache(world, dest: Path, committed: int, *, plan: bool = True) -> Path:
    """A copy of the reference cache whose commit log holds its first `committed` parts: what a
    follower sees of an extraction that has committed those (and, with `plan`, has its plan)."""
    shutil.copytree(world["cache"], dest)
    log = dest / "manifest.parts.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:committed]))
    if not plan:
        (dest / "manifest.plan.json").unlink()
    return dest


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def said(run, text: str) -> bool:
    return run.log.is_file() and text in run.output()


def waiting(run, *, started: str) -> bool:
    """The run has printed `started` and then used (almost) no CPU for a second: it waits. (A wrong
    guess only signals a run still training, which must stop cleanly as well.)"""
    if not said(run, started):
        return False
    before = cpu_ticks(run.pid)
    time.sleep(1.0)
    return cpu_ticks(run.pid) - before <= 2


def assert_stopped(run, signum, sent: float) -> str:
    status = run.wait(timeout=20)
    took = time.monotonic() - sent
    out = run.output()
    assert status == STATUS[signum], f"status {status} after {took:.1f} s, output:\n{out}"
    assert took < 10, f"took {took:.1f} s to stop"
    assert "Traceback" not in out, out
    assert run.surviving_children(grace=0.5) == [], "a DataLoader worker outlived the trainer"
    return out


@pytest.mark.parametrize("workers, signum", [(0, signal.SIGTERM), (1, signal.SIGINT)], ids=["in-trainer-TERM",
                                                                                          "in-worker-INT"])
def test_a_follow_run_waiting_for_a_part_stops_at_the_first_signal_with_a_checkpoint_of_its_last_step(
        zygote, world, tmp_path, workers, signum):
    """It printed "finishing this step, writing a checkpoint" and waited on (issue #52: 400 s)."""
    cache = partial_cache(world, tmp_path / "cache", committed=8)  # two --shuffle-parts groups of ~16 parts
    out = tmp_path / "run"
    config = train_config_file(tmp_path / "follow.json", cache, world["target"], num_workers=workers,
                               save_interval=1000, **FOLLOW)
    run = zygote.run("train", ["--config", config, "--output-dir", out])
    wait_until(lambda: logged_steps(out) and waiting(run, started="drafter:"), timeout=120,
               what="the run to train on the committed parts, then wait for the next one")
    if workers:
        assert run.watch_children(), "no DataLoader worker"
    sent = run.signal(signum)
    assert_stopped(run, signum, sent)
    # The last completed step is saved (no periodic checkpoint was due before it).
    assert complete_checkpoints(out) == [f"step-{logged_steps(out)[-1]:06d}"]

    # Once the extraction has committed the rest, the same command resumes and ends with the
    # weights of a run that was never stopped.
    shutil.copy(world["cache"] / "manifest.parts.jsonl", cache / "manifest.parts.jsonl")
    rerun = zygote.run("train", ["--config", config, "--output-dir", out])
    assert rerun.wait(timeout=300) == 0, rerun.output()
    reference = zygote.run("train", ["--config", config, "--output-dir", tmp_path / "reference"])
    assert reference.wait(timeout=300) == 0, reference.output()
    assert weights_hash(out) == weights_hash(tmp_path / "reference")


def test_a_follow_run_waiting_for_its_first_part_stops_at_the_first_signal_with_nothing_to_save(
        zygote, world, tmp_path):
    cache = partial_cache(world, tmp_path / "cache", committed=0)
    out = tmp_path / "run"
    config = train_config_file(tmp_path / "follow.json", cache, world["target"], num_workers=1, **FOLLOW)
    run = zygote.run("train", ["--config", config, "--output-dir", out])
    wait_until(lambda: waiting(run, started="drafter:"), timeout=120, what="the run to wait for part 0")
    sent = run.signal(signal.SIGTERM)
    assert_stopped(run, signal.SIGTERM, sent)
    assert complete_checkpoints(out) == []  # no step was completed: nothing to save


@pytest.mark.parametrize("where", ["planless-cache", "no-such-directory"])
def test_a_follow_run_waiting_for_the_plan_stops_at_the_first_signal(zygote, world, tmp_path, where):
    """Waits at startup: for the plan of a cache whose extraction wrote its header only, or for an
    extraction to begin at a path where none has yet (both may come: an extraction is starting)."""
    cache = tmp_path / "cache"
    if where == "planless-cache":
        partial_cache(world, cache, committed=0, plan=False)
    config = train_config_file(tmp_path / "follow.json", cache, world["target"], **FOLLOW)
    run = zygote.run("train", ["--config", config, "--output-dir", tmp_path / "run"])
    wait_until(lambda: said(run, "--follow: waiting for the extraction plan"), timeout=60, what="the wait")
    assert str(cache) in run.output()
    sent = run.signal(signal.SIGINT)
    assert_stopped(run, signal.SIGINT, sent)
    assert complete_checkpoints(tmp_path / "run") == []



def test_two_ranks_one_waiting_for_a_part_both_stop_at_the_first_signal(zygote, world, tmp_path):
    """Both ranks of `torchrun --nproc-per-node 2` train on the committed parts, then wait for the
    next one: each stops within 10 s of one SIGTERM, with 143, their checkpoints intact."""
    cache = partial_cache(world, tmp_path / "cache", committed=8)
    out = tmp_path / "run"
    config = train_config_file(tmp_path / "follow.json", cache, world["target"], save_interval=1,
                               keep_checkpoints=100, **FOLLOW)
    port = free_port()
    ranks = [zygote.run("train", ["--config", config, "--output-dir", out], env={
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "held"}) for rank in (0, 1)]
    wait_until(lambda: logged_steps(out) and all(waiting(r, started=text) for r, text in zip(ranks, ("drafter:", ""))),
               timeout=120, what="both ranks to train on the committed parts, then wait")  # (rank 1 prints nothing)
    saved = complete_checkpoints(out)
    assert saved, "no checkpoint of a completed step"
    sent = [r.signal(signal.SIGTERM) for r in ranks]
    for r, t in zip(ranks, sent):
        assert_stopped(r, signal.SIGTERM, t)
    # Every checkpoint of a completed step is whole: the run resumes from the last one.
    assert complete_checkpoints(out)[:len(saved)] == saved
    last = out / "checkpoints" / complete_checkpoints(out)[-1]
    assert {"model.safetensors", "meta.json"} <= {p.name for p in last.iterdir()}



def _rank(rank: int, store: Path, point: str, ready: int) -> None:
    """One rank of a two-rank gloo group: rank 1 never comes to the agreement point (held: e.g.
    waiting for a part, or frozen); rank 0 waits there under a StopRequest, as the trainer does."""
    import datetime

    import torch.distributed as dist
    from dflash.runtime.signals import StopRequest, StopWaiting
    from dflash.train.run.distributed import DistInfo, any_rank, barrier

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(minutes=30))
    info = DistInfo(rank=rank, world_size=2, control_group=dist.group.WORLD)
    with StopRequest() as stop:
        os.write(ready, b"x")
        if rank == 1:
            time.sleep(3600)
        try:
            any_rank(1, info) if point == "any_rank" else barrier(info)
        except StopWaiting:
            os._exit(STATUS[stop.signum])
    os._exit(0)


@pytest.mark.parametrize("point", ["any_rank", "barrier"])
def test_a_rank_whose_peer_never_comes_to_an_agreement_point_stops_at_the_first_signal(tmp_path, point):
    """The CPU agreement points (train/run/distributed.py `any_rank`, `barrier`: each step's stop flag,
    the checkpoint's barrier) waited inside gloo, where no signal handler runs: a rank whose peer
    waits for a part or is gone ignored SIGTERM until the group's 30-minute timeout."""
    read, write = os.pipe()
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read)
                _rank(rank, tmp_path / "store", point, write)
            finally:
                os._exit(99)
        pids.append(pid)
    os.close(write)
    try:
        assert len(os.read(read, 1) + os.read(read, 1)) == 2, "a rank did not start"
        time.sleep(1.0)  # rank 0 is inside the collective
        os.kill(pids[0], signal.SIGTERM)
        sent = time.monotonic()
        status = None
        while status is None and time.monotonic() - sent < 10:
            done, raw = os.waitpid(pids[0], os.WNOHANG)
            status = os.waitstatus_to_exitcode(raw) if done else None
            time.sleep(0.05)
        assert status == STATUS[signal.SIGTERM], f"rank 0: status {status} 10 s after SIGTERM (None: still waiting)"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


# -- waits that can never end are refused (bug 5) -----------------------------------------------


def refused(zygote, tmp_path, world, cache: str) -> str:
    config = train_config_file(tmp_path / "follow.json", Path("unused"), world["target"], **FOLLOW)
    body = json.loads(config.read_text())
    body["cache"] = [cache]
    config.write_text(json.dumps(body))
    run = zygote.run("train", ["--config", config, "--output-dir", tmp_path / "run"])
    status = run.wait(timeout=60)
    if status is None:
        run.signal(signal.SIGKILL)
    out = " ".join(run.output().split())
    assert status == 2, f"status {status} (None: still waiting after 60 s), output:\n{out}"
    assert "Traceback" not in out
    assert cache in out, out
    return out


def test_following_a_remote_url_is_refused_at_startup_naming_it(zygote, world, tmp_path):
    """It waited forever for "s3:/b/c4/manifest.plan.json": the URL read as a local path."""
    out = refused(zygote, tmp_path, world, "s3://bucket/c4")
    assert "without --follow" in out


@pytest.mark.parametrize("what", ["a-file", "another-directory", "a-cache-without-a-plan"])
def test_following_a_path_where_no_plan_can_come_is_refused_at_startup_naming_it(zygote, world, tmp_path, what):
    if what == "a-file":
        path = world["data"]
    elif what == "another-directory":  # e.g. a mistyped --cache that names the data's directory
        path = world["data"].parent
    else:  # committed parts, no plan, no extraction writing it: an earlier version's cache
        path = partial_cache(world, tmp_path / "cache", committed=5, plan=False)
    refused(zygote, tmp_path, world, str(path))


def test_a_path_where_no_extraction_begins_is_refused_once_the_start_wait_is_over(tmp_path):
    from dflash.cache_tools.errors import CacheError
    from dflash.train.data.follow import wait_for_plan

    notes: list = []
    typo = tmp_path / "cahce"
    with pytest.raises(CacheError) as e:
        wait_for_plan(typo, notes.append, start_seconds=0.6)
    assert e.value.code == "cache.follow-no-extraction"
    assert e.value.fields["cache"] == str(typo) and e.value.fields["missing"] is None  # no such directory
    # said at once what it waits for, and until when
    assert notes and notes[0].code == "cache.follow-waiting-for-plan" and notes[0].fields["cache"] == str(typo)


def test_a_wait_sees_the_stop_of_the_process_that_forked_it(tmp_path):
    """check_stop: the trainer's StopRequest is seen by the waits of the workers it forks."""
    from dflash.runtime.signals import StopRequest, StopWaiting, check_stop

    with StopRequest() as stop:
        check_stop("nothing")  # no stop yet: goes on
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a worker: waits until its trainer is asked to stop
            os.close(write)
            os.read(read, 1)
            try:
                check_stop("a part")
            except StopWaiting:
                os._exit(7)
            os._exit(0)
        os.close(read)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        os.write(write, b"x")
        assert os.waitpid(pid, 0)[1] >> 8 == 7
        with pytest.raises(StopWaiting):
            check_stop("a part")
    check_stop("nothing")  # the request ended with its block
