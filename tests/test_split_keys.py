"""The held-out split groups the samples of one prompt (issue #34, point 2): dflash-extract
records a split key per sample, the hash of its prompt, and everything the split decides (the
held-out set, the evaluation cap, --max-train-samples, --top1-share's selection) scores that key;
a cache extracted before keys existed keeps splitting by sample id, exactly as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_train_config, write_jsonl
from dflash.cache_tools.cache_set import CacheSet
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.errors import CacheCorruptError
from dflash.cache_tools.manifest import (
    LOG_FILE,
    PartRecord,
    decode_log_line,
    encode_log_line,
    read_manifest,
)
from dflash.cache_tools.plan import read_plan
from dflash.cache_tools.reader import CacheReader
from dflash.train.data.caches import open_training_data
from dflash.train.data.heldout import eval_split
from extract_utils import run_cli
from test_cache_old_format import CODECS, FIXTURES
from test_target_families import FAMILIES, VOCAB, save_target
from test_top1_share import MASK64, prompt_key, splitmix64_unit

PROMPTS, ANSWERS = 24, 3


def answered_records() -> list[dict]:
    """PROMPTS prompts of 4-9 tokens with ANSWERS different completions each, the answers of a
    prompt on consecutive lines (as dflash-generate --samples-per-prompt writes them)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for p in range(PROMPTS):
        prompt = torch.randint(0, VOCAB, (4 + p % 6,), generator=g).tolist()
        for a in range(ANSWERS):
            answer = torch.randint(0, VOCAB, (6 + (p + a) % 5,), generator=g).tolist()
            out.append({"id": f"p{p}" + (f"#{a}" if a else ""), "input_ids": prompt + answer,
                        "loss_mask": [0] * len(prompt) + [1] * len(answer)})
    return out


def extract_records(tmp: Path, records: list[dict], *args: str) -> dict:
    """`records` written to tmp/data.jsonl and extracted by a tiny Qwen3 into small parts."""
    target, _ = save_target(tmp / "target", FAMILIES["qwen3"][0]())
    data = write_jsonl(tmp / "data.jsonl", records)
    cache = tmp / "cache"
    result = run_cli(["--target-model", target, "--data", data, "--output", cache, "--dtype", "fp32",
                      "--target-layer-ids", "1,3", "--part-tokens", "150", "--token-budget", "256",
                      "--num-writers", "0", *args])
    assert result.exit_code == 0, result.output
    return {"target": target, "records": records, "data": data, "cache": cache, "tmp": tmp}


@pytest.fixture(scope="module")
def answered(tmp_path_factory) -> dict:
    return extract_records(tmp_path_factory.mktemp("answered"), answered_records(), "--top1-share", "0.4")


def prompt_of(sample_id: int) -> int:
    return sample_id // ANSWERS  # records are written prompt by prompt


def test_every_sample_records_its_prompts_hash_and_the_plan_promised_the_same_keys(answered):
    manifest = read_manifest(answered["cache"])
    want = {i: prompt_key(r["input_ids"], r["loss_mask"]) for i, r in enumerate(answered["records"])}
    got = {i: k for p in manifest.parts for i, k in zip(p.sample_ids, p.split_keys, strict=True)}
    assert got == want
    assert len(set(want.values())) == PROMPTS  # one key per prompt, shared by its answers
    plan = read_plan(answered["cache"], manifest.header)
    assert {p.name: p.split_keys for p in plan.parts} == {p.name: p.split_keys for p in manifest.parts}


@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_the_answers_of_one_prompt_always_land_on_the_same_side(answered, fraction):
    caches = CacheSet([str(answered["cache"])], max_seq_len=64)
    train, held = eval_split(caches, fraction)
    ids = caches.sample_ids()
    held_prompts = {prompt_of(i) for i in ids[held]}
    train_prompts = {prompt_of(i) for i in ids[train]}
    assert held_prompts and train_prompts and not held_prompts & train_prompts
    assert len(held) == ANSWERS * len(held_prompts)  # every answer of a held-out prompt is held out


def test_the_caps_take_or_leave_whole_prompts(answered):
    cfg = tiny_train_config(answered["cache"], answered["target"], answered["tmp"] / "run", eval_fraction=0.5,
                            eval_max_samples=2 * ANSWERS, max_train_samples=3 * ANSWERS)
    data = open_training_data(cfg, rank=0, world_size=1, pin_memory=False)
    data.loader.close()
    ids = data.caches.sample_ids()
    for chosen in (data.eval_indices, data.train_indices):
        prompts, counts = np.unique([prompt_of(i) for i in ids[chosen]], return_counts=True)
        assert (counts == ANSWERS).all(), chosen
    assert len(data.eval_indices) == 2 * ANSWERS and len(data.train_indices) == 3 * ANSWERS


def test_every_heldout_sample_has_its_top1_when_the_share_covers_the_fraction(answered):
    cfg = tiny_train_config(answered["cache"], answered["target"], answered["tmp"] / "run2", eval_fraction=0.4,
                            eval_max_samples=0)
    data = open_training_data(cfg, rank=0, world_size=1, pin_memory=False)
    data.loader.close()
    assert len(data.eval_indices) > 0 and data.eval_without_top1 == 0
    reader = CacheReader(answered["cache"])
    known = [reader.read_sample(i)["top1_known"] for i in range(len(reader))]
    held = set(data.eval_indices.tolist())
    assert all(known[i] for i in held) and not all(known)  # the others outside the share have none
    for i in list(held)[:4]:
        assert reader.read_sample(i)["top1_ids"].any()
    reader.close()


@pytest.mark.parametrize("codec", CODECS)
def test_an_old_cache_without_keys_splits_by_sample_id_exactly_as_before(tmp_path, codec):
    cache = Path(shutil.copytree(FIXTURES / codec, tmp_path / codec))
    assert all(p.split_keys is None for p in read_manifest(cache).parts)
    caches = CacheSet([str(cache)], max_seq_len=64)
    ids = caches.sample_ids()
    assert np.array_equal(caches.split_keys(), ids)
    for fraction in (0.3, 0.6):
        before = np.array([splitmix64_unit(int(i) & MASK64) < fraction for i in ids])  # the split of before
        train, held = eval_split(caches, fraction)
        assert np.array_equal(np.sort(held), np.flatnonzero(before))
        assert np.array_equal(np.sort(train), np.flatnonzero(~before))


def test_recompress_keeps_the_keys_and_verify_checks_them(answered, tmp_path):
    dst = tmp_path / "fp8"
    result = CliRunner().invoke(cache_main, ["recompress", str(answered["cache"]), str(dst), "--codec", "fp8",
                                             "--no-progress"])
    assert result.exit_code == 0, result.output
    keys = lambda c: {i: k for p in read_manifest(c).parts for i, k in zip(p.sample_ids, p.split_keys)}  # noqa: E731
    assert keys(dst) == keys(answered["cache"])
    verify = CliRunner().invoke(cache_main, ["verify", str(dst), "--no-progress"])
    assert verify.exit_code == 0, verify.output


def rewrite_record(cache: Path, line: int, change) -> None:
    """Edit commit record `line` (0-based) and write it back with a valid checksum (a careful hand edit)."""
    lines = (cache / LOG_FILE).read_bytes().splitlines(keepends=True)
    record = decode_log_line(lines[line], "log")
    lines[line] = encode_log_line(PartRecord(**{**record.__dict__, **change(record)}))
    (cache / LOG_FILE).write_bytes(b"".join(lines))


def test_a_hand_edited_key_is_named_by_verify_and_a_wrong_count_as_a_damaged_record(answered, tmp_path):
    cache = Path(shutil.copytree(answered["cache"], tmp_path / "edited"))
    rewrite_record(cache, 1, lambda r: {"split_keys": (r.split_keys[0] ^ 1, *r.split_keys[1:])})
    verify = CliRunner().invoke(cache_main, ["verify", str(cache), "--no-progress"])
    name = read_manifest(cache).parts[1].name
    assert verify.exit_code == 1 and f"{name} split_keys" in verify.output, verify.output
    assert "sample 0" in verify.output and "not the hashes of their prompts" in verify.output
    rewrite_record(cache, 1, lambda r: {"split_keys": r.split_keys[1:]})
    with pytest.raises(CacheCorruptError) as damaged:
        CacheReader(cache)
    assert damaged.value.code == "cache.commit-record-split-keys" and damaged.value.fields["part"] == name
    assert damaged.value.fields["where"] == f"{cache / LOG_FILE}, line 2"
    assert damaged.value.fields["keys"] == damaged.value.fields["samples"] - 1
    verify = CliRunner().invoke(cache_main, ["verify", str(cache), "--no-progress"])
    assert verify.exit_code == 1 and "split keys for its" in verify.output and "Traceback" not in verify.output


def test_a_follow_run_sees_the_keys_of_the_plan(answered):
    from dflash.train.data.follow import FollowCacheSet

    follow = FollowCacheSet(str(answered["cache"]), max_seq_len=64, announce=lambda s: None)
    offline = CacheSet([str(answered["cache"])], max_seq_len=64)
    order = np.argsort(offline.sample_ids(), kind="stable")
    assert np.array_equal(follow.sample_ids(), offline.sample_ids()[order])
    assert np.array_equal(follow.split_keys(), offline.split_keys()[order])
    held = set(follow.sample_ids()[eval_split(follow, 0.4)[1]].tolist())
    assert held == set(offline.sample_ids()[eval_split(offline, 0.4)[1]].tolist())
