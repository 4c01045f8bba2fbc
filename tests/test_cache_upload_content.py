"""`dflash-cache upload` compares objects by content (crc32c and cache identity written with each
object), refuses a prefix that holds another cache unless --replace, and remote failures are one
paragraph that tells the network, the credentials and the local disk apart (issue 52)."""

from __future__ import annotations

import errno
import http.server
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest
from cache_utils import make_cache
from click.testing import CliRunner

pytest.importorskip("obstore")
pytest.importorskip("moto.server")

import test_cache_remote  # noqa: E402
from dflash.cache_tools import remote, remote_store, remote_upload  # noqa: E402
from dflash.cache_tools.cli import main as cache_main  # noqa: E402
from dflash.cache_tools.manifest import read_header  # noqa: E402
from dflash.runtime.signals import StopRequest, StopWaiting, stop_requested  # noqa: E402

BUCKET = test_cache_remote.BUCKET
s3 = test_cache_remote.s3  # the moto server fixture (one server for this module)

CHUNK = "parts/part-000001/hidden/c/0/0"


def fresh_url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


def remote_objects(s3, url: str) -> dict[str, bytes]:
    prefix = url.split("/", 3)[3] + "/"
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", [])]
    return {k[len(prefix):]: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys}


def flip_a_byte(s3, url: str, key: str) -> None:
    """Rewrite an object with one byte changed (as any tool does: its upload metadata is gone)."""
    full = f"{url.split('/', 3)[3]}/{key}"
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=full)["Body"].read())
    body[40] ^= 0xFF
    s3.put_object(Bucket=BUCKET, Key=full, Body=bytes(body))


def test_a_rerun_of_upload_rewrites_an_object_whose_bytes_differ_and_verify_then_passes(tmp_path, s3):
    """A byte flipped in an uploaded chunk (same size): verify fails, and the upload kept the
    object because its size matched, so no rerun could repair it."""
    make_cache(tmp_path / "c", parts=3)
    url = fresh_url()
    assert CliRunner().invoke(cache_main, ["upload", str(tmp_path / "c"), url]).exit_code == 0
    flip_a_byte(s3, url, CHUNK)
    assert CliRunner().invoke(cache_main, ["verify", url]).exit_code == 1
    assert [(p.code, p.fields["object"]) for p in remote_upload.verify_remote(url).problems] == [
        ("cache.verify-remote-crc", CHUNK)]
    again = remote_upload.upload_cache(tmp_path / "c", url)
    assert again["files_uploaded"] == 1, again
    res = CliRunner().invoke(cache_main, ["verify", url])
    assert res.exit_code == 0, res.output
    assert remote_objects(s3, url)[CHUNK] == (tmp_path / "c" / CHUNK).read_bytes()


def test_an_upload_to_a_prefix_holding_another_cache_is_refused_and_replace_leaves_a_fresh_upload(tmp_path, s3):
    make_cache(tmp_path / "a", codec="bf16", parts=3)
    make_cache(tmp_path / "b", codec="raw", parts=2)
    url = fresh_url()
    remote_upload.upload_cache(tmp_path / "a", url)
    before = remote_objects(s3, url)
    res = CliRunner().invoke(cache_main, ["upload", str(tmp_path / "b"), url])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and text.startswith("Error: ") and "Traceback" not in text, res.output
    a_id, b_id = (remote_store.cache_digest(read_header(tmp_path / n)) for n in "ab")
    assert url in text and a_id in text and b_id in text and "--replace" in text, text
    assert remote_objects(s3, url) == before  # nothing written
    with pytest.raises(remote_store.ForeignPrefixError) as refused:
        remote_upload.upload_cache(tmp_path / "b", url)
    assert (refused.value.url, refused.value.found, refused.value.uploading) == (url, a_id, b_id)
    assert refused.value.code == "cache.upload-prefix-other-cache" and refused.value.fields["url"] == url
    assert a_id in refused.value.fields["there"] and b_id in refused.value.fields["uploading"]

    res = CliRunner().invoke(cache_main, ["upload", str(tmp_path / "b"), url, "--replace"])
    assert res.exit_code == 0, res.output
    fresh = fresh_url()
    remote_upload.upload_cache(tmp_path / "b", fresh)
    assert remote_objects(s3, url) == remote_objects(s3, fresh)
    assert CliRunner().invoke(cache_main, ["verify", url]).exit_code == 0


def test_the_unfinished_upload_of_another_cache_is_refused_by_its_objects(tmp_path, s3):
    """No header yet (an upload stopped before its end): the objects' metadata names their cache."""
    make_cache(tmp_path / "a", codec="bf16", parts=2)
    make_cache(tmp_path / "b", codec="raw", parts=2)
    url = fresh_url()
    remote_upload.upload_cache(tmp_path / "a", url)
    s3.delete_object(Bucket=BUCKET, Key=f"{url.split('/', 3)[3]}/manifest.json")
    with pytest.raises(remote_store.ForeignPrefixError) as refused:
        remote_upload.upload_cache(tmp_path / "b", url)
    assert refused.value.found == remote_store.cache_digest(read_header(tmp_path / "a"))
    assert refused.value.code == "cache.upload-prefix-foreign-objects"
    assert refused.value.fields["caches"] == [refused.value.found]
    # The same cache resumes its own unfinished upload.
    assert remote_upload.upload_cache(tmp_path / "a", url)["files_uploaded"] == 0


def test_objects_the_cache_no_longer_holds_are_deleted_so_the_prefix_equals_a_fresh_upload(tmp_path, s3):
    """The same identity with fewer parts (a cache written anew with the same settings): the
    parts it no longer has would stay behind under the prefix."""
    make_cache(tmp_path / "big", parts=3)
    make_cache(tmp_path / "small", parts=2)
    url, fresh = fresh_url(), fresh_url()
    remote_upload.upload_cache(tmp_path / "big", url)
    done = remote_upload.upload_cache(tmp_path / "small", url)
    assert done["files_removed"] > 0 and done["replaced"] is None
    remote_upload.upload_cache(tmp_path / "small", fresh)
    assert remote_objects(s3, url) == remote_objects(s3, fresh)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_endpoint_is_one_paragraph_naming_it_and_the_object(tmp_path, s3, monkeypatch):
    make_cache(tmp_path / "c", parts=1)
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    url = fresh_url()
    res = CliRunner().invoke(cache_main, ["verify", url])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and text.startswith("Error: ") and "Traceback" not in text, res.output
    assert endpoint in text and f"{url}/manifest.json" in text and "cannot be reached" in text, text
    assert "Debug source" not in text and "RetryError" not in text and len(text) < 600, text


class _Refusing(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that refuses every key (403 InvalidAccessKeyId)."""

    def _refuse(self):
        body = b"<Error><Code>InvalidAccessKeyId</Code><Message>No such key id.</Message></Error>"
        self.send_response(403)
        self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = _refuse

    def log_message(self, *args):
        pass


def test_refused_credentials_are_told_apart_from_the_network(tmp_path, s3, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
        make_cache(tmp_path / "c", parts=1)
        url = fresh_url()
        res = CliRunner().invoke(cache_main, ["upload", str(tmp_path / "c"), url])
    finally:
        server.shutdown()
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in text, res.output
    assert "credentials" in text and "AWS_ACCESS_KEY_ID" in text and url in text, text
    assert "cannot be reached" not in text and "Debug source" not in text, text


def test_a_full_staging_disk_is_named_as_the_local_disk_not_the_connection(tmp_path, s3, monkeypatch):
    make_cache(tmp_path / "c", parts=2)
    url = fresh_url()
    remote_upload.upload_cache(tmp_path / "c", url)
    stage = remote.StagedCache(url, tmp_path / "stage").open()
    attempts = []

    def full(path, mode="r", *args, **kw):
        if "w" in mode and remote.PARTIAL in str(path):
            attempts.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return open(path, mode, *args, **kw)

    monkeypatch.setattr(remote, "open", full, raising=False)
    with pytest.raises(remote_store.RemoteCacheError) as failed:
        stage.ensure("part-000000")
    assert failed.value.code == "cache.local-disk-failed", str(failed.value)
    assert failed.value.fields["staging_dir"] == str(tmp_path / "stage") and failed.value.fields["part"] == "part-000000"
    assert failed.value.fields["file"].startswith(str(tmp_path / "stage")) and "AWS_" not in str(failed.value)
    assert len(attempts) >= 1 and not stage.is_staged("part-000000")


def test_a_stop_request_ends_the_retries_of_a_failing_download(tmp_path, s3, monkeypatch):
    """The retry loop slept through a SIGTERM: a trainer's stop waited for every retry."""
    make_cache(tmp_path / "c", parts=1)
    url = fresh_url()
    remote_upload.upload_cache(tmp_path / "c", url)
    stage = remote.StagedCache(url, tmp_path / "stage", retries=8).open()

    def down(self, key):
        raise remote_store.RemoteCacheError(f"Fetching {key} failed: the endpoint cannot be reached.")

    monkeypatch.setattr(remote_store.RemoteStore, "stream", down)
    with StopRequest():
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        # a training run's stop (its StopRequest, seen also by the loader workers it forks): the
        # wait ends with StopWaiting, which the run turns into a checkpoint of its last step
        with pytest.raises(StopWaiting):
            stage.ensure("part-000000")
        assert stop_requested() == signal.SIGTERM
    assert not list(stage.path.rglob(f"*{remote.PARTIAL}*"))


def test_a_signal_delivered_to_an_upload_thread_still_stops_the_upload(tmp_path, s3):
    """The kernel may deliver SIGTERM to any thread: delivered to the upload thread, the main
    thread, blocked waiting for the part's future, ran the handler only once the whole part was
    uploaded (13 objects, seen under load)."""
    make_cache(tmp_path / "c", parts=3)
    url = fresh_url()
    script = textwrap.dedent(f"""
        import signal, threading, time
        from dflash.cache_tools import remote_store
        from dflash.cache_tools.cli import main
        real = remote_store.RemoteStore.put
        sent = []
        def slow(self, key, data, **kw):
            print("put", key, flush=True)
            if not sent:
                sent.append(1)
                signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # to this (upload) thread
            time.sleep(0.3)
            return real(self, key, data, **kw)
        remote_store.RemoteStore.put = slow
        main(["upload", {str(tmp_path / "c")!r}, {url!r}, "--threads", "1"])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env=os.environ.copy())
    assert proc.returncode == 143, proc.stderr
    assert proc.stdout.count("put ") <= 2, proc.stdout  # the object in flight, at most one more
    assert "manifest.json" not in remote_objects(s3, url)


def test_a_signal_stops_an_upload_without_starting_another_object(tmp_path, s3):
    """SIGTERM reached the main thread, but the thread pool then ran every queued object to the
    end before the command could exit."""
    make_cache(tmp_path / "c", parts=3)
    url = fresh_url()
    script = textwrap.dedent(f"""
        import sys, time
        from dflash.cache_tools import remote_store
        from dflash.cache_tools.cli import main
        real = remote_store.RemoteStore.put
        def slow(self, key, data, **kw):
            print("put", key, flush=True)
            time.sleep(0.3)
            return real(self, key, data, **kw)
        remote_store.RemoteStore.put = slow
        main(["upload", {str(tmp_path / "c")!r}, {url!r}, "--threads", "1"])
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=os.environ.copy())
    assert proc.stdout.readline().startswith("put ")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert out.count("put ") <= 1, out  # at most the object in flight when the signal came
    assert "manifest.json" not in remote_objects(s3, url)
