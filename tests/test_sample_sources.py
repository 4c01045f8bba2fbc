"""Every sample source a trainer reads (cache_tools/sources.py) keeps the one protocol: a finished
cache read directly, the same cache followed once its extraction has finished, and the same
cache staged from an S3 server give the same samples, ids, keys, lengths and parts; and train/
never asks which kind of source it reads."""

from __future__ import annotations

import ast
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import write_tiny_cache
from dflash.cache_tools.cache_set import CacheSet
from dflash.cache_tools.eviction import TRAINED_PREFIX
from dflash.cache_tools.followed import FollowCacheSet
from dflash.cache_tools.manifest import read_manifest
from dflash.cache_tools.plan import PlannedPart, write_plan
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.schema import SAMPLE_IDS
from dflash.cache_tools.sources import SampleSource

try:  # the moto S3 server fixture that tests/test_cache_remote.py starts
    from test_cache_remote import BUCKET, s3  # noqa: F401
except pytest.skip.Exception:  # (no obstore or moto here: the remote source is skipped)
    BUCKET = None

ROOT = Path(__file__).resolve().parents[1]
MAX_SEQ_LEN = 40  # below the longest sample: truncation is part of what must agree


def planned_cache(path: Path) -> Path:
    """A finished tiny cache with the extraction plan its extraction would have written."""
    cache = write_tiny_cache(path, samples=12, parts=3)
    manifest, reader = read_manifest(cache), CacheReader(cache)
    write_plan(cache, manifest.header, [
        PlannedPart(p.name, tuple(int(i) for i in reader.part_arrays(k).small_array(SAMPLE_IDS)), p.lengths,
                    None if p.split_keys is None else tuple(p.split_keys))
        for k, p in enumerate(manifest.parts)])
    return cache


def open_source(kind: str, cache: Path, request, tmp_path: Path) -> SampleSource:
    if kind == "finished":
        return CacheSet([str(cache)], max_seq_len=MAX_SEQ_LEN)
    if kind == "followed":
        return FollowCacheSet(str(cache), max_seq_len=MAX_SEQ_LEN, announce=lambda msg: None)
    if BUCKET is None:
        pytest.skip("no obstore or moto: no S3 server to stage a cache from")
    from dflash.cache_tools import remote_upload

    request.getfixturevalue("s3")
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    remote_upload.upload_cache(cache, url)
    return CacheSet([url], max_seq_len=MAX_SEQ_LEN, staging_dir=str(tmp_path / "stage"))


def by_sample_id(source: SampleSource) -> np.ndarray:
    return np.argsort(source.sample_ids(), kind="stable")


@pytest.mark.parametrize("kind", ["finished", "followed", "remote"])
def test_every_source_keeps_the_protocol_and_reads_the_samples_of_the_finished_cache(kind, request, tmp_path):
    cache = planned_cache(tmp_path / "cache")
    reference = CacheSet([str(cache)], max_seq_len=MAX_SEQ_LEN)
    source = open_source(kind, cache, request, tmp_path)
    assert isinstance(source, SampleSource)
    assert source.follows == (kind == "followed")

    mine, theirs = by_sample_id(source), by_sample_id(reference)
    assert len(source) == len(reference) == 12
    assert source.sample_ids()[mine].tolist() == reference.sample_ids()[theirs].tolist()
    assert source.split_keys()[mine].tolist() == reference.split_keys()[theirs].tolist()
    assert source.lengths[mine].tolist() == reference.lengths[theirs].tolist()
    assert source.full_lengths[mine].tolist() == reference.full_lengths[theirs].tolist()
    assert source.truncated_samples == reference.truncated_samples > 0
    assert source.part_numbers()[mine].tolist() == reference.part_numbers()[theirs].tolist()
    names, ref_names = source.part_names(), reference.part_names()
    assert [names[k] for k in source.sample_parts()[mine]] == [ref_names[k] for k in reference.sample_parts()[theirs]]
    assert source.identity() == reference.identity()
    grouped = source.grouped()
    assert grouped is None or grouped.tolist() == reference.grouped().tolist()

    for i, j in zip(mine.tolist(), theirs.tolist()):
        a, b = source.read(i), reference.read(j)
        assert a["sample_id"] == b["sample_id"]
        for name in ("input_ids", "loss_mask", "hidden"):
            assert np.array_equal(a[name], b[name]), name

    progress = source.progress()
    if kind == "followed":
        assert progress.complete and progress.committed == 3
    else:
        assert progress is None
    source.reading_epoch = 0
    source.release(names)  # a released part is read again on demand
    assert source.read(int(mine[0]))["sample_id"] == reference.read(int(theirs[0]))["sample_id"]
    source.report_trained(names, epoch=0, rank=0, world_size=1)
    reported = sorted(p.name for p in cache.glob(f"{TRAINED_PREFIX}*"))
    assert bool(reported) == (kind == "followed")  # only a followed extraction is told what was trained


TRAIN_READERS = ("data/caches.py", "data/loader.py", "data/follow.py", "run/loop.py", "measure/evaluation.py",
                 "data/heldout.py")


def test_the_trainer_never_asks_which_kind_of_source_it_reads():
    found = []
    for name in TRAIN_READERS:
        path = ROOT / "train" / name
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "hasattr", "getattr") and node.args):
                subject = ast.unparse(node.args[0]) + " " + " ".join(ast.unparse(a) for a in node.args[1:])
                if "caches" in subject or "CacheSet" in subject:
                    found.append(f"train/{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
