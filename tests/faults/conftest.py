"""The fault and bad-input campaign (docs/RELIABILITY.md): every test here carries the `faults`
marker, so `pytest -m faults` runs the campaign alone. The uninterrupted reference runs (one
extraction, one training run) are built once per session, as forked runs like those they are
compared with."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import (
    Zygote,
    cache_hash,
    extract_argv,
    logged_steps,
    make_records,
    make_tiny_target,
    train_config_file,
    weights_hash,
    write_jsonl,
)

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="session")
def world(tmp_path_factory, zygote) -> dict:
    """A tiny target, 60 records, and the cache and drafter of uninterrupted runs (`zygote`, the
    session's forked CLI runs, is a fixture of tests/conftest.py)."""
    root = tmp_path_factory.mktemp("fault-world")
    target = make_tiny_target(root / "target")
    data = write_jsonl(root / "data.jsonl", make_records(60, seed=1))
    cache, run_dir = reference_runs(zygote, root, target, data)
    return {"root": root, "target": target, "data": data, "cache": cache, "cache_hash": cache_hash(cache),
            "run": run_dir, "steps": logged_steps(run_dir)[-1], "weights_hash": weights_hash(run_dir)}


def reference_runs(zygote: Zygote, root: Path, target: Path, data: Path) -> tuple[Path, Path]:
    """The uninterrupted extraction and training, run as every run they are compared with: forked
    CLI runs of `zygote`. Not in this process, whose compute settings other tests may change
    (e.g. `torch.set_num_threads(1)` at import): with another thread count the CPU kernels sum
    in another order and the weights differ in their last bits (docs/RELIABILITY.md)."""
    cache, run_dir = root / "reference-cache", root / "reference-run"
    extraction = zygote.run("extract", extract_argv(target, data, cache))
    assert extraction.wait(timeout=300) == 0, extraction.output()
    config = train_config_file(root / "reference-train.json", cache, target)
    training = zygote.run("train", ["--config", config, "--output-dir", run_dir])
    assert training.wait(timeout=300) == 0, training.output()
    return cache, run_dir
