"""A target is its files, not its path: caches of one model read from two directories train
together and merge, a moved model directory resumes, and a different model is still refused."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from conftest import random_records, read_metrics, tiny_train_config, write_jsonl
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.errors import ConfigMismatchError
from dflash.cache_tools.identity import Purpose, target_differences, target_identity, tokenizer_hash
from dflash.cache_tools.manifest import HEADER_FILE, read_manifest
from dflash.cache_tools.reader import CacheReader
from dflash.train.run.loop import train
from extract_utils import assert_same_contents, cache_contents, extract, make_target
from transformers import AutoConfig


@pytest.fixture(scope="module")
def two_copies(tmp_path_factory):
    """One tiny model in two directories (same files), a cache extracted from each (of other data:
    two caches of the same data hold the same samples, and never train or merge together)."""
    root = tmp_path_factory.mktemp("identity")
    first = make_target(root / "mount-a" / "model", "qwen3", layers=4)
    second = root / "mount-b" / "elsewhere"
    shutil.copytree(first, second)
    data = write_jsonl(root / "data.jsonl", random_records(12, seed=4, max_len=40))
    extract(first, data, root / "cache-a")
    extract(second, write_jsonl(root / "data-b.jsonl", random_records(12, seed=5, max_len=40)), root / "cache-b")
    return {"root": root, "first": first, "second": second, "data": data}


def test_the_path_is_provenance_not_identity(two_copies):
    a = read_manifest(two_copies["root"] / "cache-a").header
    b = read_manifest(two_copies["root"] / "cache-b").header
    assert "path" not in a["target"]
    assert a["provenance"]["target_path"] == str(two_copies["first"].resolve())
    assert b["provenance"]["target_path"] == str(two_copies["second"].resolve())
    assert a["target"] == b["target"]


def test_caches_from_two_paths_train_together(two_copies, tmp_path):
    root = two_copies["root"]
    result = train(tiny_train_config([root / "cache-a", root / "cache-b"], two_copies["second"],
                                     tmp_path / "run", max_steps=2, epochs=1))
    assert result.step == 2


def test_caches_from_two_paths_merge(two_copies, tmp_path):
    root = two_copies["root"]
    res = CliRunner().invoke(cache_main, ["merge", str(tmp_path / "merged"), str(root / "cache-a"),
                                          str(root / "cache-b"), "--no-progress"])
    assert res.exit_code == 0, res.output
    merged = CacheReader(tmp_path / "merged")
    assert len(merged) == 2 * len(CacheReader(root / "cache-a"))
    sources = read_manifest(tmp_path / "merged").header["provenance"]["merged_from"]
    assert [s["target_path"] for s in sources] == [str(two_copies["first"].resolve()),
                                                   str(two_copies["second"].resolve())]


def test_extraction_resumes_after_the_model_directory_moved(two_copies, tmp_path):
    root = two_copies["root"]
    model = shutil.copytree(two_copies["first"], tmp_path / "before" / "model")
    out = tmp_path / "cache"
    # A first run does part of the work (rank 0 of 2: every other part), as an interrupted one would.
    first = extract(model, two_copies["data"], out, rank=0, world_size=2)
    assert 1 <= first.parts_written < first.parts_total
    moved = tmp_path / "after" / "renamed"
    moved.parent.mkdir()
    shutil.move(model, moved)
    summary = extract(moved, two_copies["data"], out)
    assert summary.parts_done_before == first.parts_written  # resumed, not started anew
    assert summary.parts_written == first.parts_total - first.parts_written
    assert_same_contents(cache_contents(out), cache_contents(root / "cache-a"))


def test_a_different_model_is_still_refused(two_copies, tmp_path):
    other = make_target(tmp_path / "other", "qwen3", layers=4, seed=0)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5  # same shapes, another model
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigMismatchError) as e:
        extract(other, two_copies["data"], two_copies["root"] / "cache-a")
    assert e.value.code == "cache.settings-differ" and e.value.fields["cache"] == str(two_copies["root"] / "cache-a")
    assert [key for key, _cache, _requested in e.value.fields["differences"]] == ["target.config_hash"]
    assert e.value.fields["target_paths"][1] == str(other)  # the cache's target and this one, named
    res = CliRunner().invoke(cache_main, ["merge", str(tmp_path / "merged"), str(two_copies["root"] / "cache-a"),
                                          str(_cache_of(other, two_copies, tmp_path)), "--no-progress"])
    assert res.exit_code != 0 and "target.config_hash" in res.output
    with pytest.raises(ConfigMismatchError) as e:
        train(tiny_train_config([two_copies["root"] / "cache-a"], other, tmp_path / "run", max_steps=1))
    assert e.value.code == "train.cache-other-target" and e.value.fields["target"] == str(other)
    assert e.value.fields["cache"] == str(two_copies["root"] / "cache-a")
    [[key, in_cache, in_target]] = e.value.fields["differences"]  # [key, the cache's, the target's]
    assert key == "config_hash" and in_cache != in_target
    assert in_cache == repr(read_manifest(two_copies["root"] / "cache-a").header["target"]["config_hash"])
    assert e.value.fields["missing_layers"] is None


def _cache_of(model, two_copies, tmp_path):
    out = tmp_path / "other-cache"
    extract(model, two_copies["data"], out)
    return out


def test_an_older_manifest_with_the_path_in_its_target_still_resumes_and_trains(two_copies, tmp_path):
    """Caches written before the path moved to provenance: `target.path` is set aside and the
    fields both sides record (here: no tokenizer_hash yet) are compared."""
    cache = shutil.copytree(two_copies["root"] / "cache-a", tmp_path / "old-cache")
    header = json.loads((cache / HEADER_FILE).read_text())
    header["target"]["path"] = "/somewhere/else/model"
    header["target"].pop("tokenizer_hash", None)
    header.pop("provenance")
    (cache / HEADER_FILE).write_text(json.dumps(header))
    summary = extract(two_copies["second"], two_copies["data"], cache)
    assert summary.parts_written == 0 and summary.parts_done_before == summary.parts_total
    result = train(tiny_train_config([cache, two_copies["root"] / "cache-b"], two_copies["first"],
                                     tmp_path / "run", max_steps=1, epochs=1))
    assert result.step == 1


def test_the_tokenizer_is_part_of_the_identity(tmp_path):
    model = make_target(tmp_path / "m", "qwen3", layers=4)
    config = AutoConfig.from_pretrained(model)
    assert target_identity(config, model)["tokenizer_hash"] is None  # no tokenizer files
    (model / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ x }}", "eos_token": "a"}')
    first = target_identity(config, model)
    # A new chat template leaves the token ids as they were: same tokenizer.
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ y }}", "eos_token": "a"}')
    assert tokenizer_hash(model) == first["tokenizer_hash"]
    (model / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    second = target_identity(config, model)
    assert [k for k, _a, _b in target_differences(first, second, Purpose.RESUME)] == ["tokenizer_hash"]
    # A side that records no tokenizer hash (an older cache) is compared on the other fields.
    older = {k: v for k, v in first.items() if k != "tokenizer_hash"}
    assert target_differences(older, second, Purpose.MERGE) == []


def test_training_resumes_after_the_model_directory_moved(two_copies, tmp_path):
    """A training run's checkpoint records the target's identity, not its path."""
    root = two_copies["root"]
    model = shutil.copytree(two_copies["first"], tmp_path / "before" / "model")
    settings = dict(epochs=1, save_interval=1, eval_fraction=0.0)
    first = train(tiny_train_config([root / "cache-a"], model, tmp_path / "run", max_steps=1, **settings))
    assert first.step == 1
    moved = shutil.move(model, tmp_path / "renamed")
    resumed = train(tiny_train_config([root / "cache-a"], moved, tmp_path / "run", max_steps=2, resume=True,
                                      **settings))
    assert resumed.step == 2
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert steps == [1, 2]  # step 1 ran once: the second run continued from its checkpoint
