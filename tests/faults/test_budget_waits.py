"""dflash-extract --disk-budget: every wait can end and every wait can be stopped. A budget that
cannot hold the parts of one forward batch is refused at startup (it waited forever before its
first commit); the second epoch of a budgeted follow run keeps only what fits (it kept every part
on disk at once and both sides waited); a stop ends an extraction waiting for room; the summary's
counts are those on disk, and a rerun without a budget restores the evicted parts."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

from dflash.cache_tools.eviction import EvictionLog, recorded_batch_bytes
from dflash.cache_tools.staging import disk_usage, parse_size

from .helpers import (
    cache_hash,
    committed_parts,
    extract_argv,
    train_config_file,
    wait_until,
    weights_hash,
)

# One sort window over the whole data (~1450 tokens, ~18 parts): what the default window is to a
# real cache's first 16 parts. Later flags override those of extract_argv.
ONE_WINDOW = ("--sort-window-tokens", "2000")
SETTINGS = dict(shuffle_parts=4, epochs=2, save_interval=2, eval_fraction=0.0)


def extract(zygote, world, out: Path, *extra: str, env: dict | None = None):
    return zygote.run("extract", extract_argv(world["target"], world["data"], out, *ONE_WINDOW, *extra), env=env)


def summary_of(run) -> str:
    return " ".join(run.output().split())


def test_a_budget_below_one_batchs_parts_is_refused_at_startup_with_what_fits(zygote, world, tmp_path):
    """A batch of --token-budget 4096 spans every part; half the cache's bytes cannot hold them."""
    budget = disk_usage(world["cache"], allocated=True) // 2
    run = extract(zygote, world, tmp_path / "cache", "--token-budget", "4096", "--disk-budget", str(budget),
                  "--follow-epochs", "2")
    assert run.wait(timeout=60) == 2, run.output()  # it waited for room for ever
    text = summary_of(run)
    assert "Traceback" not in text and "--disk-budget" in text, text
    smallest = parse_size(re.search(r"Raise --disk-budget to at least (\S+)", text).group(1))
    fitting = int(re.search(r"lower --token-budget to (\d+)", text).group(1))
    assert budget < smallest and 0 < fitting < 4096
    assert committed_parts(tmp_path / "cache") == []
    # Either way out starts: the named budget, or the named token budget under this budget (each
    # runs until it waits for a trainer that does not come, then is stopped).
    for extra in (("--token-budget", "4096", "--disk-budget", str(smallest)),
                  ("--token-budget", str(fitting), "--disk-budget", str(budget))):
        out = tmp_path / f"cache-{len(list(tmp_path.iterdir()))}"
        run = extract(zygote, world, out, *extra)
        wait_until(lambda out=out, run=run: committed_parts(out) or run.wait(timeout=0) is not None, timeout=60,
                   what="a commit")
        run.signal(signal.SIGINT)
        assert run.wait(timeout=30) == 130, run.output()
        # What a following trainer adds its group to: the largest batch's parts, within the budget.
        assert 0 < recorded_batch_bytes(out) <= parse_size(extra[-1])


def test_a_stop_ends_an_extraction_waiting_for_room_and_its_summary_counts_what_is_on_disk(zygote, world, tmp_path):
    cache = tmp_path / "cache"
    budget = disk_usage(world["cache"], allocated=True) // 3
    run = extract(zygote, world, cache, "--disk-budget", str(budget))

    def settled() -> bool:  # no commit for a while: waiting for a trainer that does not come
        before = len(committed_parts(cache))
        time.sleep(1.5)
        return before > 0 and len(committed_parts(cache)) == before

    wait_until(settled, timeout=60, what="the extraction waiting for room")
    sent = run.signal(signal.SIGTERM)
    assert run.wait(timeout=10) == 143, run.output()
    assert time.monotonic() - sent < 10
    text = summary_of(run)
    on_disk = len(committed_parts(cache))
    # It said "this rank's parts: 18 of 18" whatever it had committed.
    assert int(re.search(r"this rank committed (\d+) of the", text).group(1)) == on_disk, text
    assert 0 < on_disk < len(committed_parts(world["cache"]))


def test_follow_epochs_without_eviction_extract_each_part_once(zygote, world, tmp_path):
    """Parts still being written when the second epoch's pass began were extracted again (the
    summary counted twice the samples)."""
    cache = tmp_path / "cache"
    budget = 4 * disk_usage(world["cache"], allocated=True)
    run = extract(zygote, world, tmp_path / "cache", "--disk-budget", str(budget), "--follow-epochs", "2")
    assert run.wait(timeout=120) == 0, run.output()
    text = summary_of(run)
    parts = len(committed_parts(cache))
    assert re.search(rf"done: 60 samples, \d+ tokens in {parts} parts \(", text), text
    states = EvictionLog(cache).refresh().states
    assert all(not st.evicted and st.epoch == 1 for st in states.values())  # each part kept for epoch 1


def test_a_budgeted_follow_run_over_two_epochs_ends_with_the_offline_weights(zygote, world, tmp_path):
    """The issue's scenario on tiny data: one sort window, a budget of half the cache, two epochs.
    At the second epoch's start the extraction kept every part still on disk at once; they filled
    the budget, and it waited for room for part 0 while the trainer waited for part 0. Then a rerun
    without --disk-budget restores the evicted parts (it said 'done' and restored nothing)."""
    full = tmp_path / "full"
    run = extract(zygote, world, full)
    assert run.wait(timeout=120) == 0, run.output()
    offline = train_config_file(tmp_path / "offline.json", full, world["target"], **SETTINGS)
    reference = zygote.run("train", ["--config", offline, "--output-dir", tmp_path / "offline"])

    cache = tmp_path / "cache"
    budget = disk_usage(full, allocated=True) // 2
    follow = train_config_file(tmp_path / "follow.json", cache, world["target"], follow=True, **SETTINGS)
    trainer = zygote.run("train", ["--config", follow, "--output-dir", tmp_path / "follow"])
    extraction = extract(zygote, world, cache, "--disk-budget", str(budget), "--follow-epochs", "2")
    assert extraction.wait(timeout=180) == 0, extraction.output()
    assert trainer.wait(timeout=60) == 0, trainer.output()
    assert reference.wait(timeout=180) == 0, reference.output()
    assert weights_hash(tmp_path / "follow") == weights_hash(tmp_path / "offline")
    evicted = EvictionLog(cache).refresh().evicted()
    assert evicted, "nothing was evicted: the budget did not bind"
    text = summary_of(extraction)
    assert f"{len(evicted)} are evicted under --disk-budget" in text, text

    again = extract(zygote, world, cache)
    assert again.wait(timeout=120) == 0, again.output()
    assert f"and {len(evicted)} evicted parts again" in summary_of(again), again.output()
    assert not EvictionLog(cache).refresh().evicted()
    assert cache_hash(cache) == cache_hash(full)


def test_the_wait_notice_names_what_holds_the_room_and_what_ends_the_wait(tmp_path):
    """It advised --shuffle-parts / --save-interval also when the extraction's own open parts of one
    batch filled the budget (the batch against the part size was the cause)."""
    from conftest import write_tiny_cache
    from dflash.cache_tools.manifest import read_manifest
    from dflash.cache_tools.schema import PartSchema
    from dflash.extract.budget import ExtractionBudget

    cache = write_tiny_cache(tmp_path / "cache", samples=8, parts=2)
    header = read_manifest(cache).header
    used = disk_usage(cache, allocated=True)
    budget = ExtractionBudget(cache, header, used + 4096, schema=PartSchema.from_header(header),
                              announce=lambda _: None)
    budget.refresh()
    since = time.monotonic() - 31
    # Committed parts no trainer has reported: the trainer's report ends the wait.
    notice = budget._wait_notice([("part-000002", 10)], used, 8192, since)
    assert notice.code == "extract.budget-wait-untrained" and notice.fields["untrained"] == 2, notice
    assert notice.fields["trainer_epochs"] is None and notice.fields["waited"] >= 31, notice
    # This extraction's own open parts fill it: only a smaller batch (or a larger budget) ends it.
    budget.reserved = {"part-000002": 3 * used, "part-000003": 3 * used}
    notice = budget._wait_notice([("part-000004", 10)], used, 8192, since)
    assert notice.code == "extract.budget-wait-own-batch" and notice.fields["open_parts"] == 2, notice
    assert notice.fields["part"] == "part-000004" and notice.fields["reserved"] == 6 * used, notice
