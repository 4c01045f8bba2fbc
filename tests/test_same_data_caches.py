"""Caches that hold the same samples under other paths (a copy, a second extraction of the same
data) are refused wherever they would count a sample twice: trained on together, merged, or one
as the --eval-cache of the other."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner
from conftest import tiny_train_config, write_jsonl
from dflash.cache_tools.cache_set import CacheSet, data_digests
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.errors import ConfigMismatchError
from dflash.cache_tools.manifest import read_manifest
from dflash.train.config import TrainConfigError
from dflash.train.data.caches import open_training_data
from extract_utils import make_target, run_cli


def records(seed: int) -> list[dict]:
    return [{"input_ids": [1 + (k * 7 + j * seed) % 90 for j in range(12)], "loss_mask": [0] * 4 + [1] * 8}
            for k in range(16)]


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("same-data")
    target = make_target(root / "model", "qwen3", layers=4)

    def extract(name: str, data) -> str:
        res = run_cli(["--target-model", target, "--data", data, "--output", root / name, "--dtype", "fp32",
                       "--target-layer-ids", "0,2", "--num-writers", "0"])
        assert res.exit_code == 0, res.output
        return str(root / name)

    data = write_jsonl(root / "data.jsonl", records(3))
    a = extract("a", data)
    shutil.copytree(a, root / "a_copy")
    again = extract("again", data)  # a second extraction of the same file
    other = extract("other", write_jsonl(root / "other.jsonl", records(5)))
    return {"root": root, "target": target, "a": a, "copy": str(root / "a_copy"), "again": again, "other": other}


def test_a_copy_or_a_second_extraction_of_the_same_data_does_not_train_beside_it(caches):
    for twin in (caches["copy"], caches["again"]):
        with pytest.raises(ConfigMismatchError) as e:
            CacheSet([caches["a"], twin], max_seq_len=64)
        assert e.value.code == "cache.same-data" and e.value.fields["use"] == "train"
        assert (e.value.fields["first"], e.value.fields["second"]) == (caches["a"], twin)
    both = CacheSet([caches["a"], caches["other"]], max_seq_len=64)  # other data trains together
    assert len(both) == 32


def test_a_copy_of_the_training_cache_is_no_eval_cache(caches, tmp_path):
    cfg = tiny_train_config(caches["a"], caches["target"], tmp_path / "run", eval_cache=[caches["copy"]])
    with pytest.raises(TrainConfigError) as e:
        open_training_data(cfg, rank=0, world_size=1, pin_memory=False)
    assert e.value.code == "train.eval-cache-same-data"
    assert (e.value.fields["eval_cache"], e.value.fields["cache"]) == (str(caches["copy"]), str(caches["a"]))
    cfg = tiny_train_config(caches["a"], caches["target"], tmp_path / "run", eval_cache=[caches["other"]])
    assert open_training_data(cfg, rank=0, world_size=1, pin_memory=False).heldout_count == 16


def test_merging_a_cache_with_a_copy_is_refused_and_a_merged_cache_keeps_its_sources_digests(caches, tmp_path):
    res = CliRunner().invoke(cache_main, ["merge", str(tmp_path / "m"), caches["a"], caches["copy"]])
    assert res.exit_code == 2 and "hold the same samples" in res.output
    res = CliRunner().invoke(cache_main, ["merge", str(tmp_path / "m2"), caches["a"], caches["other"]])
    assert res.exit_code == 0, res.output
    merged = read_manifest(tmp_path / "m2").header
    assert data_digests(merged) == data_digests(read_manifest(caches["a"]).header) | data_digests(
        read_manifest(caches["other"]).header)
    # the merged cache holds a's samples: it does not train beside a copy of a
    with pytest.raises(ConfigMismatchError) as e:
        CacheSet([str(tmp_path / "m2"), caches["copy"]], max_seq_len=64)
    assert e.value.code == "cache.same-data"


def test_recompress_merge_and_stats_of_a_cache_with_evicted_parts_name_the_eviction(caches, tmp_path):
    from dflash.cache_tools.eviction import evict_part

    cache = shutil.copytree(caches["other"], tmp_path / "budgeted")
    evict_part(cache, read_manifest(cache).parts[0], trained_epoch=1, reextract=False)
    for args in (["recompress", str(cache), str(tmp_path / "r"), "--codec", "fp8"],
                 ["merge", str(tmp_path / "m"), caches["a"], str(cache)], ["stats", str(cache)]):
        res = CliRunner().invoke(cache_main, args)
        assert res.exit_code == 2, res.output
        assert "evicted under a disk budget" in res.output and "damaged" not in res.output, res.output


def test_training_offline_on_a_cache_with_evicted_parts_names_the_eviction_not_damage(caches, tmp_path):
    """dflash-train (and estimate) without --follow read every part: an evicted one was reported as
    "zarr.json is missing. The part is damaged", where verify calls the cache sound."""
    from dflash.cache_tools.eviction import evict_part
    from dflash.train.cli import main as train_main

    cache = shutil.copytree(caches["other"], tmp_path / "budgeted")
    evict_part(cache, read_manifest(cache).parts[0], trained_epoch=0)
    res = CliRunner().invoke(train_main, ["--cache", str(cache), "--target-model", caches["target"], "--output-dir",
                                          str(tmp_path / "run"), "--num-draft-layers", "1", "--block-size", "4",
                                          "--eval-fraction", "0", "--no-progress", "--no-tensorboard"])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and text.startswith("Error: ") and "Traceback" not in text, res.output
    assert "evicted under a disk budget (part-000000 first" in text and "damaged" not in text, text
    assert "resumes with --follow" in text
    assert not (tmp_path / "run" / "checkpoints").exists()
