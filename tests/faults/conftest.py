"""The fault and bad-input campaign (docs/RELIABILITY.md): every test here carries the `faults`
marker, so `pytest -m faults` runs the campaign alone. The uninterrupted reference runs (one
extraction, one training run) are built once per session, in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import (
    TRAIN_SETTINGS,
    Zygote,
    cache_hash,
    make_records,
    make_tiny_target,
    weights_hash,
    write_jsonl,
)

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="session")
def zygote(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("fault-runs"))
    yield z
    z.close()


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> dict:
    """A tiny target, 60 records, and the caches and drafter of uninterrupted runs."""
    from dflash.extract.config import ExtractConfig
    from dflash.extract.pipeline import run_extraction
    from dflash.train.config import TrainConfig
    from dflash.train.loop import train

    root = tmp_path_factory.mktemp("fault-world")
    target = make_tiny_target(root / "target")
    data = write_jsonl(root / "data.jsonl", make_records(60, seed=1))
    cache = root / "reference-cache"
    run_extraction(ExtractConfig(target_model=str(target), data=str(data), output=str(cache), dtype="fp32",
                                 target_layer_ids=[1, 2], part_tokens=100, sort_window_tokens=200,
                                 token_budget=128, num_writers=0,
                                 progress=False))
    run_dir = root / "reference-run"
    result = train(TrainConfig(cache=[str(cache)], target_model=str(target), output_dir=str(run_dir),
                               **TRAIN_SETTINGS))
    assert result.exit_status == 0
    return {"root": root, "target": target, "data": data, "cache": cache, "cache_hash": cache_hash(cache),
            "run": run_dir, "steps": result.step, "weights_hash": weights_hash(run_dir)}
