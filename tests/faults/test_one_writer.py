"""One writer per directory (issue #33, bugs 2 and 6): `--force` refuses while another
extraction writes the cache, and a second dflash-train on one --output-dir is refused; each
names the live holder's pid, and the first run ends as if alone."""

from __future__ import annotations

from dflash.cache_tools.maintenance import verify_cache

from .helpers import (
    cache_hash,
    committed_parts,
    extract_argv,
    logged_steps,
    train_config_file,
    wait_until,
    weights_hash,
)


def test_force_with_other_settings_refuses_while_another_extraction_writes_the_cache(zygote, world, tmp_path):
    out = tmp_path / "cache"
    first = zygote.run("extract", extract_argv(world["target"], world["data"], out),
                       env={"DFLASH_TEST_SLEEP_PER_PART": "0.15"})
    wait_until(lambda: len(committed_parts(out)) >= 2, what="the first run's second commit")
    forced = zygote.run("extract", extract_argv(world["target"], world["data"], out, "--codec", "fp8", "--force"))
    assert forced.wait(timeout=120) == 2, forced.output()
    text = forced.output()
    assert f"being written by another process (pid {first.pid} on " in text and "--force deletes the cache" in text
    assert "Traceback" not in text
    assert first.wait(timeout=120) == 0, first.output()
    assert not verify_cache(out).problems
    assert cache_hash(out) == world["cache_hash"]  # the first run's cache, whole and unmixed


def test_a_second_training_run_on_one_output_dir_is_refused_and_the_first_ends_as_alone(zygote, world, tmp_path):
    out = tmp_path / "run"
    config = train_config_file(tmp_path / "train.json", world["cache"], world["target"])
    first = zygote.run("train", ["--config", config, "--output-dir", out], env={"DFLASH_TEST_SLEEP_PER_BATCH": "0.05"})
    wait_until(lambda: len(logged_steps(out)) >= 2, what="the first run's step 2")
    second = zygote.run("train", ["--config", config, "--output-dir", out])
    assert second.wait(timeout=120) == 2, second.output()
    assert f"The run directory {out} is being written by another process (pid {first.pid} on " in second.output()
    assert first.wait(timeout=300) == 0, first.output()
    assert logged_steps(out) == list(range(1, world["steps"] + 1))  # one run's log, not two interleaved
    assert weights_hash(out) == weights_hash(world["run"])
