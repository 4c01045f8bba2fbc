"""Inputs that worked but misled (issue #33, weak spots): booleans taken as token ids, a UTF-8
byte order mark refused by extraction though dflash-prepare reads it, the same cache given twice
or as its own held-out set, an exported model.safetensors not readable like its config.json."""

from __future__ import annotations

import json
import stat

import pytest
from conftest import random_records, tiny_train_config, write_jsonl
from dflash.runtime.records import BadRecord, parse_record
from dflash.train.config import TrainConfigError
from dflash.train.data.caches import refuse_repeated_caches
from extract_utils import assert_same_contents, cache_contents, extract, make_target


@pytest.mark.parametrize("record", [
    {"input_ids": [1, True, 3], "loss_mask": [0, 1, 1]},
    {"input_ids": [True, False], "prompt_len": 1},
    {"input_ids": [1, 2], "loss_mask": [False, True]},
    {"input_ids": [1, 2], "labels": [-100, True]},
])
def test_booleans_are_not_token_ids_or_mask_values(record):
    with pytest.raises(BadRecord) as err:
        parse_record(json.dumps(record).encode(), 64)
    assert err.value.code == "runtime.record-booleans" and err.value.fields["key"] in record


def test_a_byte_order_mark_is_read_past_by_extraction_as_by_prepare(tmp_path):
    target = make_target(tmp_path / "t", layers=4)
    records = random_records(6, seed=2, max_len=30)
    plain = write_jsonl(tmp_path / "plain" / "d.jsonl", records)
    marked = tmp_path / "bom" / "d.jsonl"
    marked.parent.mkdir()
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    extract(target, plain, tmp_path / "c1")
    summary = extract(target, marked, tmp_path / "c2", skip_bad=True)
    assert summary.skipped_bad == 0 and summary.samples == 6  # the first record is not dropped
    assert_same_contents(cache_contents(tmp_path / "c1"), cache_contents(tmp_path / "c2"))


def test_the_same_cache_twice_or_as_its_own_eval_cache_is_refused(tiny_world, tmp_path):
    cache = tiny_world["cache"]
    link = tmp_path / "link"
    link.symlink_to(cache)
    with pytest.raises(TrainConfigError) as twice:
        refuse_repeated_caches([str(cache), str(link)], [])
    assert twice.value.code == "train.cache-given-twice"
    assert twice.value.fields == dict(flag="--cache", cache=str(link), other=str(cache))
    with pytest.raises(TrainConfigError) as both:
        refuse_repeated_caches([str(cache)], [str(cache)])
    assert both.value.code == "train.eval-cache-is-cache" and both.value.fields["eval_cache"] == str(cache)
    refuse_repeated_caches([str(cache)], [str(tmp_path / "another")])  # distinct caches pass
    from dflash.train.run.loop import train

    with pytest.raises(TrainConfigError) as e:
        train(tiny_train_config(cache, tiny_world["target"], tmp_path / "run", max_steps=1,
                                eval_cache=[str(cache)]))
    assert e.value.code == "train.eval-cache-is-cache"


def test_an_exported_model_is_readable_like_its_config(tiny_world, tmp_path):
    import torch
    from dflash.train.exports.export import export_drafter
    from dflash.train.model.drafter import DFlashDrafter

    drafter = DFlashDrafter.from_target(tiny_world["target"], num_hidden_layers=1, target_layer_ids=[1, 2],
                                        block_size=4, mask_token_id=0, attention_backend="sdpa")
    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] and modes["config.json"] & 0o044 == 0o044
