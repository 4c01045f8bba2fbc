"""A cache whose extraction stopped before its end (or lost a rank) is said to be unfinished by
`dflash-cache info` and `verify`, refused by `merge` and by `dflash-train` unless
--allow-incomplete: it holds only a part of the data, and nothing else says so."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from conftest import tiny_train_config, write_jsonl
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.manifest import LOG_FILE, read_manifest
from dflash.train.config import TrainConfigError
from dflash.train.data.caches import open_training_data
from extract_utils import make_target, run_cli


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict:
    """A cache whose last two committed parts are taken back, as if its extraction had stopped
    before them (the plan still promises them), beside its finished copy."""
    root = tmp_path_factory.mktemp("unfinished")
    target = make_target(root / "model", "qwen3", layers=4)
    records = [{"input_ids": [1 + (k * 7 + j) % 90 for j in range(12)], "loss_mask": [0] * 4 + [1] * 8}
               for k in range(24)]
    data = write_jsonl(root / "data.jsonl", records)
    whole = root / "whole"
    res = run_cli(["--target-model", target, "--data", data, "--output", whole, "--dtype", "fp32",
                   "--target-layer-ids", "0,2", "--part-tokens", "60", "--num-writers", "0"])
    assert res.exit_code == 0, res.output
    cache = root / "cache"
    shutil.copytree(whole, cache)
    lines = (cache / LOG_FILE).read_text().splitlines(keepends=True)
    assert len(lines) > 3
    for line in lines[-2:]:
        shutil.rmtree(cache / "parts" / json.loads(line.rsplit(" ", 1)[0])["part"])  # JSON, then its crc
    (cache / LOG_FILE).write_text("".join(lines[:-2]))
    return {"root": root, "target": target, "whole": whole, "cache": cache, "parts": len(lines)}


def cache_cli(*args):
    return CliRunner().invoke(cache_main, [str(a) for a in args])


def test_info_and_verify_say_how_many_of_the_planned_parts_are_there(stopped):
    parts = stopped["parts"]
    info = cache_cli("info", stopped["cache"])
    assert info.exit_code == 0, info.output
    assert f"parts            {parts - 2} of {parts} planned" in info.output and "has not finished" in info.output
    verify = cache_cli("verify", stopped["cache"], "--no-progress")
    assert verify.exit_code == 0, verify.output  # nothing is damaged
    assert f"{parts - 2} of its {parts} planned parts are committed" in verify.output
    assert f"OK: {parts - 2} parts (of {parts} planned: unfinished)" in verify.output
    # the finished cache says none of it
    assert "planned" not in cache_cli("info", stopped["whole"]).output
    assert "planned" not in cache_cli("verify", stopped["whole"], "--no-progress").output


def test_training_refuses_it_unless_allowed_and_then_trains_on_the_committed_samples(stopped, tmp_path):
    def data(cache, **kw):
        cfg = tiny_train_config(cache, stopped["target"], tmp_path / "run", **kw)
        return open_training_data(cfg, rank=0, world_size=1, pin_memory=False)

    parts = stopped["parts"]
    with pytest.raises(TrainConfigError) as e:
        data(stopped["cache"])
    assert e.value.code == "train.cache-unfinished" and e.value.fields["cache"] == str(stopped["cache"])
    assert (e.value.fields["committed"], e.value.fields["planned"]) == (parts - 2, parts)
    assert e.value.fields["writer"] == "dflash-extract"  # the command that finishes it
    allowed = data(stopped["cache"], allow_incomplete=True)
    assert len(allowed.caches) == read_manifest(stopped["cache"]).num_samples < len(data(stopped["whole"]).caches)
    # as the held-out cache too
    with pytest.raises(TrainConfigError) as e:
        data(stopped["whole"], eval_cache=[str(stopped["cache"])])
    assert e.value.code == "train.cache-unfinished" and e.value.fields["cache"] == str(stopped["cache"])


def test_merge_refuses_an_unfinished_source(stopped, tmp_path):
    res = cache_cli("merge", tmp_path / "merged", stopped["whole"], stopped["cache"])
    assert res.exit_code != 0 and "not a finished cache" in res.output and "dflash-extract" in res.output
    assert not (tmp_path / "merged" / "manifest.json").exists()
