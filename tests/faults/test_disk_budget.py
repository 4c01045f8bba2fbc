"""dflash-extract --disk-budget with dflash-train --follow: the cache stays within the budget plus
one part, evicting what the trainer consumed and extracting it again, bit for bit, for the next
epoch; the weights are those of an offline run on the whole cache, whichever side is killed."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

from dflash.cache_tools.eviction import EVICTED, RESTORED, EvictionLog
from dflash.cache_tools.maintenance import verify_cache
from dflash.cache_tools.manifest import PARTS_DIR, read_manifest
from dflash.cache_tools.staging import disk_usage
from dflash.cache_tools.summary import cache_info

from .helpers import cache_hash, extract_argv, train_config_file, weights_hash

EPOCHS = 3
# Groups of 4 parts of ~16, a checkpoint every 2 steps (what the trainer reports consumption at).
SETTINGS = dict(shuffle_parts=4, epochs=EPOCHS, save_interval=2, eval_fraction=0.0)


def offline_reference(zygote, world, tmp_path: Path) -> str:
    config = train_config_file(tmp_path / "offline.json", world["cache"], world["target"], **SETTINGS)
    run = zygote.run("train", ["--config", config, "--output-dir", tmp_path / "offline"])
    assert run.wait(timeout=300) == 0, run.output()
    return weights_hash(tmp_path / "offline")


def budget_of(world) -> tuple[int, int, int]:
    """A budget of half the reference cache: (budget, cache bytes, largest part), in the bytes the
    file system allocates (what --disk-budget counts)."""
    cache = world["cache"]
    total = disk_usage(cache, allocated=True)
    largest = max(disk_usage(cache / PARTS_DIR / p.name, allocated=True) for p in read_manifest(cache).parts)
    return total // 2, total, largest


def events(cache: Path) -> list[dict]:
    path = cache / "manifest.evicted.jsonl"
    return [json.loads(line.rsplit(" ", 1)[0]) for line in path.read_text().splitlines()] if path.exists() else []


def check_usage(usage_file: Path, budget: int, largest: int) -> int:
    """The cache's bytes after every commit are within the budget plus one part; returns the peak."""
    peak = 0
    for line in usage_file.read_text().splitlines():
        name, used, _ = line.split()
        assert int(used) <= budget + largest, f"{int(used)} bytes after committing {name}: budget {budget} + {largest}"
        peak = max(peak, int(used))
    return peak


def test_follow_under_a_budget_below_the_cache_gives_the_offline_weights(zygote, world, tmp_path):
    reference = offline_reference(zygote, world, tmp_path)
    budget, total, largest = budget_of(world)
    cache, usage = tmp_path / "cache", tmp_path / "usage.txt"
    # The trainer is told the budget too (its checks: the groups fit, no split of this cache).
    config = train_config_file(tmp_path / "follow.json", cache, world["target"], follow=True,
                               disk_budget=str(budget), **SETTINGS)
    trainer = zygote.run("train", ["--config", config, "--output-dir", tmp_path / "follow"],
                         env={"DFLASH_TEST_SLEEP_PER_BATCH": "0.01"})
    extraction = zygote.run("extract", extract_argv(world["target"], world["data"], cache, "--disk-budget",
                                                    str(budget), "--follow-epochs", str(EPOCHS)),
                            env={"DFLASH_TEST_USAGE_AT_COMMIT": str(usage)})
    assert extraction.wait(timeout=300) == 0, extraction.output()
    assert trainer.wait(timeout=300) == 0, trainer.output()
    assert weights_hash(tmp_path / "follow") == reference

    peak = check_usage(usage, budget, largest)
    assert total > budget + largest and peak <= budget + largest  # the whole cache never fitted
    log = events(cache)
    evicted, restored = sum(e["event"] == EVICTED for e in log), sum(e["event"] == RESTORED for e in log)
    parts = len(read_manifest(cache).parts)
    # Each later epoch extracts again about the half the budget could not keep, not the whole cache.
    assert 0 < restored < (EPOCHS - 1) * parts, (restored, parts)
    assert evicted >= restored
    print(f"budget {budget} of {total} bytes, peak {peak}; {parts} parts, {evicted} evictions, "
          f"{restored} re-extractions ({restored / parts:.2f} caches) over {EPOCHS} epochs")


def test_evicted_parts_come_back_bit_identical(zygote, world, tmp_path):
    """After a budgeted run, verify and info report the evicted parts as evicted; an extraction
    for one more epoch brings them back, each checked against its evicted copy's sha256, and the
    cache is then exactly the reference cache."""
    budget, total, _ = budget_of(world)
    cache = tmp_path / "cache"
    config = train_config_file(tmp_path / "follow.json", cache, world["target"], follow=True, **SETTINGS)
    trainer = zygote.run("train", ["--config", config, "--output-dir", tmp_path / "follow"])
    extraction = zygote.run("extract", extract_argv(world["target"], world["data"], cache, "--disk-budget",
                                                    str(budget), "--follow-epochs", str(EPOCHS)))
    assert extraction.wait(timeout=300) == 0, extraction.output()
    assert trainer.wait(timeout=300) == 0, trainer.output()
    gone = EvictionLog(cache).refresh().evicted()
    assert gone, "nothing was evicted"
    # verify and info stay truthful: evicted is not damage, and info names what is gone.
    report = verify_cache(cache, progress=False)
    assert report.ok, report.problems
    notes = [(n.code, n.fields) for n in report.notes]
    assert ("cache.verify-parts-evicted", len(gone)) in [(c, len(f.get("parts", []))) for c, f in notes], notes
    info = cache_info(cache)
    assert info["evicted_parts"] == sorted(gone)
    assert info["evicted_bytes"] == sum(st.nbytes for st in gone.values())
    # The trainer is done (its reports say epoch EPOCHS): one more pass for epoch EPOCHS - 1 after
    # it brings back what the last epoch evicted, checked against each evicted copy's sha256.
    again = zygote.run("extract", extract_argv(world["target"], world["data"], cache, "--disk-budget",
                                               str(total * 2), "--follow-epochs", str(EPOCHS + 1)))
    assert again.wait(timeout=300) == 0, again.output()
    assert not EvictionLog(cache).refresh().evicted()
    assert cache_hash(cache) == world["cache_hash"]


def test_budgeted_follow_with_either_side_killed_gives_the_offline_weights(zygote, world, tmp_path):
    """A seeded chain of kill -9s of the extractor or the trainer, each restarted at once."""
    reference = offline_reference(zygote, world, tmp_path)
    budget, _, largest = budget_of(world)
    cache, usage = tmp_path / "cache", tmp_path / "usage.txt"
    config = train_config_file(tmp_path / "follow.json", cache, world["target"], follow=True, **SETTINGS)
    rng = random.Random(7)

    def start(kind):
        if kind == "extract":
            return zygote.run("extract", extract_argv(world["target"], world["data"], cache, "--disk-budget",
                                                      str(budget), "--follow-epochs", str(EPOCHS)),
                              env={"DFLASH_TEST_USAGE_AT_COMMIT": str(usage), "DFLASH_TEST_SLEEP_PER_PART": "0.02"})
        return zygote.run("train", ["--config", config, "--output-dir", tmp_path / "follow"],
                          env={"DFLASH_TEST_SLEEP_PER_BATCH": "0.01"})

    runs, killed = {kind: start(kind) for kind in ("extract", "train")}, []
    picks = 0
    while len(killed) < 8 and any(r is not None for r in runs.values()):
        alive = sorted(k for k, r in runs.items() if r is not None)
        # Each side first, then a seeded random side: a fast machine's extractor can end before
        # a random choice comes to it, and a chain without both kills proves less.
        first = ("extract", "train")[picks] if picks < 2 else None
        kind = first if first in alive else rng.choice(alive)
        picks += 1
        if runs[kind].wait(timeout=rng.uniform(0.3, 1.5)) is None:
            runs[kind].signal(signal.SIGKILL)
        status = runs[kind].wait(timeout=10)
        if status == -signal.SIGKILL:
            killed.append(kind)
            assert runs[kind].surviving_children(grace=15) == []
            runs[kind] = start(kind)
            continue
        assert status == 0, runs[kind].output()
        runs[kind] = None
    for run in runs.values():
        if run is not None:
            assert run.wait(timeout=300) == 0, run.output()
    assert weights_hash(tmp_path / "follow") == reference
    check_usage(usage, budget, largest)
    assert "extract" in killed and "train" in killed, killed
