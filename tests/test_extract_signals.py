"""kill -9 and Ctrl-C: committed work survives, the rerun finishes, nothing is duplicated."""

from __future__ import annotations

import signal
import time

import pytest
from conftest import random_records, write_jsonl
from dflash.cache_tools.manifest import read_manifest
from dflash.cache_tools.reader import CacheReader
from dflash.extract.config import ExtractConfig
from dflash.extract.pipeline import run_extraction
from extract_utils import (
    LAYER_IDS,
    assert_same_contents,
    cache_contents,
    committed_parts,
    make_target,
    start,
    wait_for,
)

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    target = make_target(root / "model", "qwen3", layers=4)
    data = write_jsonl(root / "data.jsonl", random_records(40, seed=9, max_len=60))
    clean = root / "clean"
    run_extraction(ExtractConfig(target_model=str(target), data=str(data), output=str(clean),
                                 dtype="fp32", target_layer_ids=LAYER_IDS, part_tokens=120, token_budget=128,
                                 sort_window_tokens=0, progress=False))
    return target, data, clean


def test_kill9_of_one_rank_then_single_rank_resume_equals_clean_run(setup, zygote, tmp_path):
    target, data, clean = setup
    out = tmp_path / "cache"
    rank0 = start(zygote, target, data, out, "--rank", "0", "--world-size", "2", sleep=0.0)
    rank1 = start(zygote, target, data, out, "--rank", "1", "--world-size", "2", sleep=0.7)
    # Kill rank 1 once it has committed a part of its own: it is midway through its share.
    wait_for(lambda: any(int(p[-6:]) % 2 == 1 for p in committed_parts(out)))
    rank1.signal(signal.SIGKILL)
    assert rank1.wait(timeout=10) == -signal.SIGKILL
    assert rank0.wait(timeout=60) == 0, rank0.output()
    total = len(read_manifest(clean).parts)
    assert len(committed_parts(out)) < total  # rank 1's share is unfinished
    run_extraction(ExtractConfig(target_model=str(target), data=str(data), output=str(out),
                                 dtype="fp32", target_layer_ids=LAYER_IDS, part_tokens=120, token_budget=128,
                                 sort_window_tokens=0, progress=False))
    assert len(committed_parts(out)) == total
    assert_same_contents(cache_contents(out), cache_contents(clean))
    assert not [p for p in (out / "parts").iterdir() if p.name.startswith(".tmp-")]


def test_sigint_exits_130_within_seconds_and_rerun_completes(setup, zygote, tmp_path):
    target, data, clean = setup
    out = tmp_path / "cache"
    proc = start(zygote, target, data, out, sleep=0.5)
    wait_for(lambda: len(committed_parts(out)) >= 1)
    sent = proc.signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 130
    assert time.monotonic() - sent < 10
    output = proc.output()
    assert "SIGINT" in output and "Traceback" not in output
    reader = CacheReader(out)  # every committed part reads back clean (checksums verified)
    assert 0 < len(reader.manifest.parts) < len(read_manifest(clean).parts)
    for i in range(len(reader)):
        reader.read_sample(i)
    run_extraction(ExtractConfig(target_model=str(target), data=str(data), output=str(out),
                                 dtype="fp32", target_layer_ids=LAYER_IDS, part_tokens=120, token_budget=128,
                                 sort_window_tokens=0, progress=False))
    assert_same_contents(cache_contents(out), cache_contents(clean))



def test_a_stopped_runs_summary_sets_the_parts_it_reached_beside_the_plan():
    from dflash.extract.pipeline import ExtractSummary

    stopped = ExtractSummary(interrupted_by=signal.SIGINT, parts_total=36, parts_this_rank=36, parts_planned=46,
                             parts_done_before=3, parts_written=2)
    # What it committed, not what it reached ("36 of 36" read as finished, also with nothing committed).
    assert "committed 5 of the 36 parts it reached before the stop, of the 46 the extraction plans" in stopped.format()
    done = ExtractSummary(parts_total=46, parts_this_rank=46, parts_planned=46)
    assert "this rank's parts: 46 of 46." in done.format()
