"""dflash-train --disk-budget and --staging-dir: settings of the data section. With --follow on a
cache an extraction fills under a budget they refuse what cannot work within it (no
--shuffle-parts, a held-out split of the followed cache) and warn of a --shuffle-parts group
larger than the budget; on finished local caches, where they would do nothing, they are refused.
(Remote caches: tests/test_cache_remote.py.)"""

from __future__ import annotations

import signal
import time

import pytest
from click.testing import CliRunner
from conftest import tiny_train_config, write_tiny_cache
from dflash.cache_tools.manifest import read_manifest
from dflash.cache_tools.plan import PlannedPart, write_plan
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.schema import SAMPLE_IDS
from dflash.runtime.findings import Finding
from dflash.train.cli import main
from dflash.train.config import TrainConfigError
from dflash.train.data.caches import open_training_data


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, " ".join(result.output.split())


def base_args(world, out, *extra: str) -> list[str]:
    return ["--cache", str(world["cache"]), "--target-model", str(world["target"]), "--output-dir", str(out),
            "--num-draft-layers", "1", "--block-size", "4", "--no-progress", "--no-tensorboard", *extra]


def assert_refused(code: int, text: str, *fragments: str) -> None:
    assert code == 2 and text.startswith("Error: ") and "Traceback" not in text, text
    for fragment in fragments:
        assert fragment in text, text


def test_follow_under_a_budget_without_shuffle_parts_is_refused_saying_why_and_what_to_pass(tiny_world, tmp_path):
    code, text = run_cli(*base_args(tiny_world, tmp_path / "run", "--follow", "--disk-budget", "2T", "--eval-fraction", "0"))
    assert_refused(code, text, "--follow with --disk-budget 2T needs --shuffle-parts N",
                   "first batches read samples of every part", "Pass --shuffle-parts 8")
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_follow_under_a_budget_with_a_heldout_split_of_the_followed_cache_is_refused(tiny_world, tmp_path):
    code, text = run_cli(*base_args(tiny_world, tmp_path / "run", "--follow", "--disk-budget", "2T", "--shuffle-parts", "4"))
    assert_refused(code, text, "held-out split of the followed cache (--eval-fraction 0.02)",
                   "each evaluation would read every part", "--eval-cache", "--eval-fraction 0")
    # Either way out is accepted: no split, or a separate held-out cache.
    base = dict(follow=True, disk_budget="2T", shuffle_parts=4)
    assert tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "a", eval_fraction=0,
                             **base).data.disk_budget_bytes() == 2 << 40
    tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "b",
                      eval_cache=[str(tmp_path / "heldout")], **base)
    # Without a budget the split is allowed (evaluation waits for its parts, nothing is evicted).
    tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "c", follow=True, shuffle_parts=4)


@pytest.mark.parametrize("flags,fragments", [
    (("--disk-budget", "2T"), ("bounds the local disk", "local and finished, read in place", "add --follow")),
    (("--staging-dir", "/somewhere"), ("--staging-dir /somewhere is where an s3:// cache is staged",
                                       "a local cache is read in place")),
    (("--follow", "--shuffle-parts", "2", "--eval-fraction", "0", "--disk-budget", "lots"),
     ("--disk-budget", "'lots'", "500G")),
    (("--follow", "--shuffle-parts", "2", "--eval-fraction", "0", "--disk-budget", "0"),
     ("--disk-budget must be a positive size",)),
])
def test_disk_settings_that_would_do_nothing_or_are_not_sizes_are_refused(tiny_world, tmp_path, flags, fragments):
    assert_refused(*run_cli(*base_args(tiny_world, tmp_path / "run", *flags)), *fragments)


def planned_cache(tmp_path, parts: int = 8):
    """A finished cache with the extraction plan a --follow run reads (its parts in plan order)."""
    cache = write_tiny_cache(tmp_path / "cache", samples=4 * parts, parts=parts)
    manifest = read_manifest(cache)
    reader = CacheReader(cache)
    planned = [PlannedPart(p.name, tuple(int(i) for i in reader.part_arrays(k).small_array(SAMPLE_IDS)), p.lengths)
               for k, p in enumerate(manifest.parts)]
    write_plan(cache, manifest.header, planned)
    return cache, max(p.nbytes for p in manifest.parts)


def test_a_shuffle_parts_group_larger_than_the_budget_is_refused_naming_a_group_that_fits(tiny_world, tmp_path):
    """Such a run would wait for ever beside its extraction (issue #52): it was only warned."""
    cache, part = planned_cache(tmp_path)
    budget = int(2.5 * part)

    def summary(shuffle_parts: int) -> str:
        config = tiny_train_config(cache, tiny_world["target"], tmp_path / "run", follow=True, eval_fraction=0,
                                   disk_budget=str(budget), shuffle_parts=shuffle_parts, epochs=1)
        data = open_training_data(config, rank=0, world_size=1, pin_memory=False)
        data.loader.close()
        return data.summary()

    with pytest.raises(TrainConfigError) as refused:
        summary(4)
    found = refused.value.fields
    assert refused.value.code == "train.disk-budget-group" and found["budget"] == budget
    assert found["shuffle_parts"] == 4 and found["measured_parts"] == 8
    fits = found["fits"]  # the group that fits
    assert 1 <= fits < 4
    summary(fits)  # the group it proposes fits the budget: no refusal


def test_the_group_refusal_counts_the_parts_one_extraction_batch_spans(tiny_world, tmp_path):
    from dflash.cache_tools.eviction import record_budget

    cache, part = planned_cache(tmp_path)
    budget = int(3.5 * part)
    config = tiny_train_config(cache, tiny_world["target"], tmp_path / "run", follow=True, eval_fraction=0,
                               disk_budget=str(budget), shuffle_parts=2, epochs=1)
    open_training_data(config, rank=0, world_size=1, pin_memory=False).loader.close()  # a group of 2 fits
    record_budget(cache, budget, batch_bytes=2 * part)  # as an extraction under this budget records it
    with pytest.raises(TrainConfigError):  # beside two parts of the extraction's batch it does not
        open_training_data(config, rank=0, world_size=1, pin_memory=False)


def test_the_budget_does_not_change_the_batches(tiny_world, tmp_path):
    cache, part = planned_cache(tmp_path)

    def batches(**budget) -> list[list[int]]:
        config = tiny_train_config(cache, tiny_world["target"], tmp_path / "run", follow=True, eval_fraction=0,
                                   shuffle_parts=2, epochs=2, **budget)
        data = open_training_data(config, rank=0, world_size=1, pin_memory=False)
        data.loader.close()
        return [[b.tolist() for b in data.loader.epoch_batches(e)] for e in range(2)]

    assert batches(disk_budget=str(3 * part)) == batches()



def test_a_part_evicted_for_another_training_run_is_refused_at_once_instead_of_waited_for(tiny_world, tmp_path):
    """Another run's consumption reports let the extraction evict part-000000 after its epoch 1; a
    new run reads it for epoch 0. It waited forever ("the extraction that evicted it does not extract
    it again: rerun dflash-extract ... --follow-epochs of at least this run's --epochs", which brought
    nothing back); two runs following one budgeted cache left the slower one waiting so."""
    from dflash.cache_tools.eviction import evict_part
    from dflash.runtime.errors import DflashError

    cache, _ = planned_cache(tmp_path)
    evict_part(cache, read_manifest(cache).parts[0], trained_epoch=1, reextract=False)
    config = tiny_train_config(cache, tiny_world["target"], tmp_path / "run", follow=True, eval_fraction=0,
                               shuffle_parts=2, epochs=2)
    data = open_training_data(config, rank=0, world_size=1, pin_memory=False)

    def waited_too_long(*_):
        raise TimeoutError("the run waited for a part that no extraction brings back for it")

    previous = signal.signal(signal.SIGALRM, waited_too_long)
    signal.alarm(20)
    start = time.monotonic()
    try:
        with pytest.raises(DflashError) as e:
            for _ in range(data.loader.total_steps):
                data.loader.next_batch()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        data.loader.close()
    assert time.monotonic() - start < 10
    assert e.value.code == "cache.follow-evicted-for-another-run", e.value
    assert {k: e.value.fields[k] for k in ("part", "epoch", "reading")} == {"part": "part-000000", "epoch": 1,
                                                                             "reading": 0}


def test_a_run_without_disk_budget_following_a_budgeted_extraction_gets_the_budgets_refusals(tiny_world, tmp_path):
    """The trainer's --disk-budget was only a check, and a run without it beside dflash-extract
    --disk-budget kept the default held-out split: its first evaluation waited for parts the
    extraction had no room for, while the extraction waited for the trainer to report (both hung)."""
    from dflash.cache_tools.eviction import record_budget
    from dflash.train.config import TrainConfigError

    cache, part = planned_cache(tmp_path)
    record_budget(cache, 3 * part)  # what an extraction under --disk-budget writes before its plan

    def opened(**settings):
        config = tiny_train_config(cache, tiny_world["target"], tmp_path / "run", follow=True, epochs=1, **settings)
        data = open_training_data(config, rank=0, world_size=1, pin_memory=False)
        data.loader.close()
        return data

    for settings, refusal in ((dict(shuffle_parts=2), Finding("train.follow-budget-held-out", value=str(3 * part),
                                                              eval_fraction=0.02)),
                              (dict(eval_fraction=0), Finding("train.follow-budget-shuffle-parts", value=str(3 * part)))):
        with pytest.raises(TrainConfigError) as e:
            opened(**settings)
        assert e.value.code == "train.follow-extraction-budget" and e.value.fields["budget"] == 3 * part
        assert e.value.fields["cache"] == str(cache) and e.value.fields["refusal"] == refusal, e.value.fields
    opened(shuffle_parts=2, eval_fraction=0)  # what the budget needs: it trains
    record_budget(cache, None)  # an extraction without a budget removes the record
    opened(shuffle_parts=2)


def test_an_extraction_records_its_disk_budget_before_its_plan_and_a_rerun_without_one_removes_it(tmp_path):
    from conftest import write_jsonl
    from dflash.cache_tools.eviction import recorded_budget
    from extract_utils import extract, make_target

    target = make_target(tmp_path / "target", layers=4)
    data = write_jsonl(tmp_path / "data.jsonl", [{"input_ids": [1 + (k + j) % 90 for j in range(12)],
                                                  "loss_mask": [0] * 4 + [1] * 8} for k in range(12)])
    cache = tmp_path / "cache"
    extract(target, data, cache, disk_budget="1G")
    assert recorded_budget(cache) == 1 << 30
    extract(target, data, cache)
    assert recorded_budget(cache) is None
