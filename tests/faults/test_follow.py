"""dflash-train --follow: training on a cache while dflash-extract fills it gives the weights of
an offline run on the finished cache, however the parts arrive and whichever side is killed."""

from __future__ import annotations

import json
import random
import signal

from dflash.cache_tools.manifest import read_header
from dflash.cache_tools.plan import read_plan

from .helpers import cache_hash, extract_argv, train_config_file, weights_hash

FOLLOW = dict(shuffle_parts=4)  # groups of 4 parts of ~16: training trails the extraction


def offline_reference(zygote, world, tmp_path):
    config = train_config_file(tmp_path / "offline.json", world["cache"], world["target"], **FOLLOW)
    run = zygote.run("train", ["--config", config, "--output-dir", tmp_path / "offline"])
    assert run.wait(timeout=300) == 0, run.output()
    return weights_hash(tmp_path / "offline")


def test_extraction_writes_its_plan_before_the_parts(world):
    plan = read_plan(world["cache"], read_header(world["cache"]))
    assert plan is not None
    committed = {}
    for line in (world["cache"] / "manifest.parts.jsonl").read_text().splitlines():
        record = json.loads(line.rsplit(" ", 1)[0])
        committed[record["part"]] = tuple(record["lengths"])
    assert {p.name: p.lengths for p in plan.parts} == committed


def test_follow_run_on_a_cache_being_extracted_by_two_ranks_gives_the_offline_weights(zygote, world, tmp_path):
    reference = offline_reference(zygote, world, tmp_path)
    cache = tmp_path / "cache"
    config = train_config_file(tmp_path / "follow.json", cache, world["target"], follow=True, **FOLLOW)
    # The trainer starts first and waits for the plan; the ranks commit parts in an order of their
    # own timing (rank 1 slower), which the training order must not depend on.
    trainer = zygote.run("train", ["--config", config, "--output-dir", tmp_path / "follow"])
    ranks = [zygote.run("extract", extract_argv(world["target"], world["data"], cache, "--rank", str(r),
                                                "--world-size", "2"),
                        env={"DFLASH_TEST_SLEEP_PER_PART": str(0.05 + 0.1 * r)}) for r in (0, 1)]
    for run in ranks:
        assert run.wait(timeout=300) == 0, run.output()
    assert trainer.wait(timeout=300) == 0, trainer.output()
    assert cache_hash(cache) == world["cache_hash"]
    assert weights_hash(tmp_path / "follow") == reference
    records = [json.loads(line) for line in (tmp_path / "follow" / "metrics.jsonl").read_text().splitlines()]
    progress = [r for r in records if "parts_extracted" in r]
    assert progress and progress[-1]["parts_extracted"] == progress[-1]["parts_planned"]
    assert "parts_trained" in progress[-1] and "data_wait_s" in progress[-1]


def test_follow_with_both_sides_killed_20_times_gives_the_offline_weights(zygote, world, tmp_path):
    """A seeded chain of kill -9s, each of the extractor or the trainer (whichever the draw picks
    and is still running), each killed side restarted at once; a chain whose two sides both end
    is checked and a new one starts, until 20 kills hit a live process."""
    reference = offline_reference(zygote, world, tmp_path)
    configs = {w: train_config_file(tmp_path / f"follow-{w}.json", tmp_path / "cache-{}", world["target"],
                                    follow=True, num_workers=w, **FOLLOW) for w in (0, 1)}
    rng, starts = random.Random(5), []

    def start(kind, chain):
        starts.append(kind)
        if kind == "extract":
            return zygote.run("extract", extract_argv(world["target"], world["data"], tmp_path / f"cache-{chain}"),
                              env={"DFLASH_TEST_SLEEP_PER_PART": "0.05"})
        # Every third trainer reads through a DataLoader worker (which waits for parts itself).
        config = json.loads(configs[1 if len(starts) % 3 == 0 else 0].read_text())
        config["cache"] = [str(tmp_path / f"cache-{chain}")]
        path = tmp_path / f"follow-{chain}-{len(starts)}.json"
        path.write_text(json.dumps(config))
        return zygote.run("train", ["--config", path, "--output-dir", tmp_path / f"run-{chain}"],
                          env={"DFLASH_TEST_SLEEP_PER_BATCH": "0.01"})

    def check(chain):
        assert cache_hash(tmp_path / f"cache-{chain}") == world["cache_hash"], f"chain {chain}: cache differs"
        assert weights_hash(tmp_path / f"run-{chain}") == reference, f"chain {chain}: weights differ"

    chain, killed = 0, []
    runs = {kind: start(kind, chain) for kind in ("extract", "train")}
    while len(killed) < 20:
        kind = rng.choice(sorted(k for k, r in runs.items() if r is not None))
        if runs[kind].wait(timeout=rng.uniform(0.05, 0.7)) is None:
            runs[kind].signal(signal.SIGKILL)
        status = runs[kind].wait(timeout=10)
        if status == -signal.SIGKILL:
            killed.append(kind)
            # A killed trainer's DataLoader worker (it may be waiting for a part) ends within
            # seconds; until then it holds the run directory, as it would for a user's rerun.
            assert runs[kind].surviving_children(grace=15) == []
            runs[kind] = start(kind, chain)
            continue
        assert status == 0, runs[kind].output()  # it ended first (possibly just before the kill)
        runs[kind] = None
        if all(r is None for r in runs.values()):
            check(chain)
            chain += 1
            runs = {kind: start(kind, chain) for kind in ("extract", "train")}
    for run in runs.values():
        if run is not None:
            assert run.wait(timeout=300) == 0, run.output()
    check(chain)
    assert killed.count("extract") >= 3 and killed.count("train") >= 3, killed
