"""Remote caches: upload to an S3-compatible server (moto, started on 127.0.0.1 by the tests),
verify it there, and read it through a staging directory: checked, retried, within a budget."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest
import torch
from cache_utils import bits, make_cache
from click.testing import CliRunner

pytest.importorskip("obstore")
moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

from dflash.cache_tools import remote, remote_store, remote_upload  # noqa: E402
from dflash.cache_tools.cache_set import CacheSet  # noqa: E402
from dflash.cache_tools.cli import main as cache_main  # noqa: E402
from dflash.cache_tools.errors import CacheCorruptError  # noqa: E402
from dflash.cache_tools.reader import CacheReader  # noqa: E402
from dflash.cache_tools.staging import disk_usage  # noqa: E402
from dflash.train.data.loader import sample_tensors  # noqa: E402

BUCKET = "dflash-test"
ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}


@pytest.fixture(scope="module")
def s3():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in (*ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(ENV, AWS_ENDPOINT_URL=f"http://{host}:{port}")
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
    client.create_bucket(Bucket=BUCKET)
    yield client
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def uploaded(tmp_path, s3, **kw):
    """A local cache, uploaded to a fresh prefix: (local dir, url, samples)."""
    samples = make_cache(tmp_path / "local", **kw)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    remote_upload.upload_cache(tmp_path / "local", url)
    return tmp_path / "local", url, samples


def assert_same_samples(reader, local_dir):
    local = CacheReader(local_dir)
    assert len(reader) == len(local)
    for i in range(len(local)):
        a, b = sample_tensors(reader.read_sample(i)), sample_tensors(local.read_sample(i))
        np.testing.assert_array_equal(bits(a["hidden"]), bits(b["hidden"]))
        assert a["sample_id"] == b["sample_id"]
        assert np.array_equal(a["input_ids"].numpy(), b["input_ids"].numpy())


def test_upload_verify_and_read_back_through_staging(tmp_path, s3):
    local, url, _ = uploaded(tmp_path, s3, parts=3)
    res = CliRunner().invoke(cache_main, ["verify", url])
    assert res.exit_code == 0 and "OK: 3 parts" in res.output, res.output
    reader = remote.open_reader(url, staging_dir=tmp_path / "stage", prefetch=False)
    stage = reader.stage
    # Open fetched the manifest and the small arrays only: no part's hidden states yet.
    assert not any(stage.is_staged(p.name) for p in reader.parts)
    assert_same_samples(reader, local)
    assert all(stage.is_staged(p.name) for p in reader.parts)
    assert not list(stage.path.rglob(f"*{remote.PARTIAL}*"))


def test_the_upload_command_resumes_and_the_trainer_cache_set_opens_a_url(tmp_path, s3):
    make_cache(tmp_path / "local", parts=2)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    first = CliRunner().invoke(cache_main, ["upload", str(tmp_path / "local"), url])
    assert first.exit_code == 0 and "Uploaded 2 parts" in first.output, first.output
    again = CliRunner().invoke(cache_main, ["upload", str(tmp_path / "local"), url])
    assert "0 files written" in again.output, again.output
    caches = CacheSet([url], max_seq_len=1000, staging_dir=str(tmp_path / "stage"))
    assert caches.sample_ids().tolist() == [0, 1, 10, 11]
    assert caches.read(3)["sample_id"] == 11


def test_a_corrupted_object_is_named_by_verify_and_by_the_reader(tmp_path, s3):
    local, url, _ = uploaded(tmp_path, s3)
    key = f"{url.split('/', 3)[3]}/parts/part-000001/hidden/c/0/0"
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[40] ^= 0xFF
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    res = CliRunner().invoke(cache_main, ["verify", url])
    assert res.exit_code == 1 and "part part-000001" in res.output and "crc32c" in res.output, res.output
    assert CliRunner().invoke(cache_main, ["verify", url, "--fast"]).exit_code == 0  # same size: only crc sees it
    reader = remote.open_reader(url, staging_dir=tmp_path / "stage", prefetch=False)
    reader.stage.retries = 2
    reader.read_sample(0)  # part 0 is sound
    with pytest.raises(CacheCorruptError) as err:
        reader.read_sample(2)
    assert err.value.code == "cache.download-corrupt" and err.value.fields["object"] == f"{url}/parts/part-000001/hidden/c/0/0"
    assert err.value.fields["part"] == "part-000001" and err.value.fields["attempts"] == 2
    assert not reader.stage.is_staged("part-000001")


def test_a_failed_download_is_retried(tmp_path, s3, monkeypatch):
    local, url, _ = uploaded(tmp_path, s3)
    failures = []
    real = remote_store.RemoteStore.stream

    def flaky(self, key):
        if "hidden/c" in key and len(failures) < 2:
            failures.append(key)
            raise remote_store.RemoteCacheError(f"connection reset while fetching {key}")
        return real(self, key)

    monkeypatch.setattr(remote_store.RemoteStore, "stream", flaky)
    reader = remote.open_reader(url, staging_dir=tmp_path / "stage", prefetch=False)
    assert_same_samples(reader, local)
    assert len(failures) == 2


def test_a_download_killed_mid_part_resumes_with_checked_files(tmp_path, s3):
    """A staging process SIGKILLed after some files of a part landed (and one may be half
    written) leaves no staged marker: the next run fetches the rest and reads what was uploaded."""
    local, url, _ = uploaded(tmp_path, s3, parts=1, length=600)  # one part, several shard files
    stage_dir = tmp_path / "stage"
    script = textwrap.dedent(f"""
        import time
        from dflash.cache_tools import remote
        real = remote.StagedCache._fetch_checked
        def slow(self, name, f):
            real(self, name, f)
            if "hidden/c" in f.path:
                time.sleep(0.3)
        remote.StagedCache._fetch_checked = slow
        stage = remote.StagedCache({url!r}, {str(stage_dir)!r}, threads=1).open()
        print("open", flush=True)
        stage.ensure("part-000000")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=os.environ.copy())
    assert proc.stdout.readline().strip() == b"open"
    data = stage_dir / "parts" / "part-000000" / "hidden" / "c"
    deadline = time.monotonic() + 30
    while not (data.exists() and any(p.is_file() and remote.PARTIAL not in p.name for p in data.rglob("*"))):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stage = remote.StagedCache(url, stage_dir)
    assert (stage_dir / "manifest.json").exists() and not stage.is_staged("part-000000")
    stage.open()
    reader = CacheReader(stage.path, stage=stage)
    assert_same_samples(reader, local)
    assert stage.is_staged("part-000000")
    assert not list(stage_dir.rglob(f"*{remote.PARTIAL}*"))


def test_staging_keeps_within_the_disk_budget_plus_one_part(tmp_path, s3):
    local, url, _ = uploaded(tmp_path, s3, parts=6)
    stage = remote.StagedCache(url, tmp_path / "stage").open()
    skeleton = disk_usage(stage.path / "parts")
    part = max(stage.part_bytes(n) for n in stage.index.parts)
    budget = skeleton + int(2.5 * part)
    stage = remote.StagedCache(url, tmp_path / "stage", disk_budget=budget).open()
    reader = CacheReader(stage.path, stage=stage)
    local_reader = CacheReader(local)
    peak = 0
    for _epoch in range(2):
        for i in range(len(reader)):
            a, b = sample_tensors(reader.read_sample(i)), sample_tensors(local_reader.read_sample(i))
            np.testing.assert_array_equal(bits(a["hidden"]), bits(b["hidden"]))
            peak = max(peak, disk_usage(stage.path / "parts"))
            reader.close()  # as a loader moving on to other parts drops its maps
    assert peak <= budget + part, (peak, budget, part)
    staged = [n for n in stage.index.parts if stage.is_staged(n)]
    assert 0 < len(staged) < 6  # parts were evicted to stay within the budget


def test_training_from_an_s3_cache_gives_the_weights_of_training_from_the_local_copy(tiny_world, tmp_path, s3,
                                                                                   monkeypatch):
    from conftest import tiny_train_config
    from dflash.train.run.loop import train
    from safetensors.torch import load_file

    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    remote_upload.upload_cache(tiny_world["cache"], url)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default staging directory
    local = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "local", max_steps=4))
    staged = train(tiny_train_config(url, tiny_world["target"], tmp_path / "s3", max_steps=4))
    assert local.step == staged.step == 4
    a = load_file(tmp_path / "local" / "final" / "model.safetensors")
    b = load_file(tmp_path / "s3" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert list((tmp_path / "xdg" / "dflash" / "staging").iterdir())  # it read through the staging directory


def test_training_with_staging_dir_and_disk_budget_stages_there_within_the_budget_and_resumes_without(
        tiny_world, tmp_path, s3, monkeypatch):
    """dflash-train --staging-dir DIR --disk-budget SIZE: the cache is staged under DIR, holds at most
    the budget plus one part, the weights are those of the local copy's run, and the run resumes
    with no budget (a budget changes where bytes live, not the batches)."""
    from conftest import tiny_train_config
    from dflash.train.run.loop import train
    from safetensors.torch import load_file

    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    remote_upload.upload_cache(tiny_world["cache"], url)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default staging directory
    probe = remote.StagedCache(url, tmp_path / "probe").open()
    skeleton, part = disk_usage(probe.path / "parts"), max(probe.part_bytes(n) for n in probe.index.parts)
    budget = skeleton + int(1.5 * part)
    settings = dict(num_workers=1, shuffle_parts=0)  # a forked worker fetches too (obstore is not fork-safe)
    local = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "local", max_steps=4,
                                    **settings))
    staged = train(tiny_train_config(url, tiny_world["target"], tmp_path / "s3", max_steps=4, **settings,
                                     staging_dir=str(tmp_path / "mine"), disk_budget=str(budget)))
    assert local.step == staged.step == 4
    a = load_file(tmp_path / "local" / "final" / "model.safetensors")
    b = load_file(tmp_path / "s3" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (stage_dir,) = list((tmp_path / "mine").iterdir())  # one directory per URL, under --staging-dir
    assert stage_dir.name == remote.default_staging_dir(url).name
    assert not (tmp_path / "xdg" / "dflash" / "staging").exists()
    assert disk_usage(stage_dir / "parts") <= budget + part
    names = list(probe.index.parts)
    staged = [n for n in names if (stage_dir / remote.STAGED_DIR / n).exists()]
    assert 0 < len(staged) < len(names)  # parts went to stay within the budget
    resumed = train(tiny_train_config(url, tiny_world["target"], tmp_path / "s3", max_steps=6, **settings,
                                      staging_dir=str(tmp_path / "mine")))
    assert resumed.step == 6


def test_a_budget_smaller_than_one_part_still_reads_every_part_one_at_a_time(tmp_path, s3):
    local, url, _ = uploaded(tmp_path, s3, parts=3)
    stage = remote.StagedCache(url, tmp_path / "stage", disk_budget=1).open()
    skeleton = disk_usage(stage.path / "parts")
    reader = CacheReader(stage.path, stage=stage)
    local_reader = CacheReader(local)
    for i in range(len(reader)):
        np.testing.assert_array_equal(bits(reader.read_sample(i)["hidden"]), bits(local_reader.read_sample(i)["hidden"]))
        assert disk_usage(stage.path / "parts") <= skeleton + max(stage.part_bytes(n) for n in stage.index.parts)
        reader.close()


def remote_holds_nothing(s3, url: str) -> bool:
    prefix = url.split("/", 3)[3]
    return s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("KeyCount", 0) == 0


def test_the_upload_of_an_unfinished_cache_is_refused_and_writes_nothing(tmp_path, s3):
    """The extraction plan is not uploaded: a remote copy of 2 of 3 planned parts would train as
    the whole data, where the local cache is refused as unfinished."""
    from dflash.cache_tools.manifest import read_manifest
    from dflash.cache_tools.plan import PlannedPart, write_plan

    local = tmp_path / "local"
    make_cache(local, parts=2, length=20)
    m = read_manifest(local)
    planned = [PlannedPart(p.name, (k * 10, k * 10 + 1), p.lengths) for k, p in enumerate(m.parts)]
    write_plan(local, m.header, [*planned, PlannedPart("part-000002", (20, 21), (20, 20))])
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    res = CliRunner().invoke(cache_main, ["upload", str(local), url])
    assert res.exit_code == 2 and res.output.startswith("Error: ") and "Traceback" not in res.output, res.output
    assert "is not a finished cache (2 of its 3 planned parts are committed" in " ".join(res.output.split())
    assert remote_holds_nothing(s3, url)


def test_the_upload_of_a_cache_with_evicted_parts_is_refused_naming_the_eviction(tmp_path, s3):
    """Parts evicted under a disk budget have no files: the upload said "Uploaded 3 parts" and left
    a remote copy whose evicted parts hold nothing."""
    from dflash.cache_tools.eviction import evict_part
    from dflash.cache_tools.manifest import read_manifest

    local = tmp_path / "local"
    make_cache(local, parts=3, length=20)
    evict_part(local, read_manifest(local).parts[1], 0)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    res = CliRunner().invoke(cache_main, ["upload", str(local), url])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and text.startswith("Error: ") and "Traceback" not in text, res.output
    assert "1 part(s) of" in text and "evicted under a disk budget (part-000001 first" in text, text
    assert "upload reads every part" in text
    assert remote_holds_nothing(s3, url)
