"""A remote cache's objects on object storage (`s3://bucket/prefix`) and the index that names them.

A remote cache holds the files of a finished local cache under its prefix, plus one file of its
own, `manifest.files.jsonl`: for every part, each file's path, size and crc32c. Upload writes
the parts first, then that index, the commit log, and the header last, so a reader never sees
a manifest whose parts are not all there (remote_upload.py). S3 connection settings come from
the usual environment variables (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, ...;
AWS_ALLOW_HTTP=true for a plain-http endpoint), read by obstore (the `s3` extra). Training
reads a remote cache through a local staging directory (remote.py).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import google_crc32c
from dflash.runtime.errors import Interrupted
from dflash.runtime.findings import Finding
from dflash.runtime.signals import StopRequest, signals_polled, stop_if_signalled
from dflash.runtime.signals import stop_requested as stop_requested_here

from .errors import CacheCorruptError, CacheError, CacheNotFoundError
from .manifest import HEADER_FILE, LOG_FILE, header_identity, read_manifest

REMOTE_SCHEMES = ("s3://",)
FILES_INDEX = "manifest.files.jsonl"
READ_BLOCK = 8 << 20
T = TypeVar("T")
R = TypeVar("R")


# Written with every object by upload (S3 user metadata): the object's crc32c and the identity
# of the cache it belongs to, read back by a rerun with one HEAD request per object.
META_CRC32C = "dflash-crc32c"
META_CACHE = "dflash-cache"
# obstore's own retries, kept short: a wait for a dead endpoint is then ours (retried with a stop
# check, then named) rather than minutes inside one call that no signal reaches from a thread.
RETRY_CONFIG = {"max_retries": 2, "backoff": {"init_backoff": timedelta(milliseconds=100),
                                              "max_backoff": timedelta(seconds=1), "base": 2},
                "retry_timeout": timedelta(seconds=5)}


class RemoteCacheError(CacheError):
    """A remote cache cannot be reached, or a file of it cannot be fetched."""


class ForeignPrefixError(CacheError):
    """An upload's prefix holds another cache than the one uploaded (`url`; `found` and
    `uploading` are their identity digests, `found` None for objects of no known cache)."""

    def __init__(self, message: str | Finding, *, url: str, found: str | None, uploading: str):
        super().__init__(message)
        self.url, self.found, self.uploading = url, found, uploading


def cache_digest(header: dict[str, Any]) -> str:
    """A short name of a cache's identity (`manifest.header_identity`): two headers of one
    digest describe the same contents."""
    blob = json.dumps(header_identity(header), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def describe_cache(header: dict[str, Any]) -> str:
    """A cache's identity in a few words: target, layers, codec and its digest."""
    target = (header.get("target") or {}).get("architecture") or "?"
    codec = ((header.get("hidden") or {}).get("codec") or {}).get("name", "?")
    return f"{target}, layers {header.get('target_layer_ids')}, codec {codec}, identity {cache_digest(header)}"


def stop_requested() -> int:
    """The stop signal the running command was asked to finish by (0: none): the `StopRequest`
    whose handler is installed records it, and any thread may read it, so a fetch or upload
    thread ends its wait within one poll. (A command under `stop_at_once` is stopped by its main
    thread, which raises `Interrupted` where it waits.)"""
    owner = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if isinstance(owner, StopRequest) and owner.signum:
        return owner.signum
    return stop_requested_here()  # (a loader worker: its trainer's StopRequest, in shared memory)


def endpoint_name() -> str:
    return (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            or f"AWS S3 ({os.environ.get('AWS_REGION') or os.environ.get('AWS_DEFAULT_REGION') or 'default region'})")


_CREDENTIALS = re.compile(r"credential|169\.254\.169\.254|InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied|"
                          r"ExpiredToken|status code: 40[13]", re.I)
_NETWORK = re.compile(r"error sending request|connect|timed? ?out|dns|resolve|connection|broken pipe|reset", re.I)
LOCAL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


def failure_fields(e: BaseException) -> dict[str, str]:
    """Why a request failed, as a finding's fields, in the terms a user acts on: `cause`
    "credentials" (refused or missing), "network" (the `endpoint` cannot be reached) or "other";
    `detail` is the error's own first line (obstore's debug dump is left out)."""
    text = " ".join(str(e).split("Debug source:", 1)[0].split())
    detail = _clip(text.rsplit(" - ", 1)[-1])  # obstore: "Error performing GET <url> in 2s - <the cause>"
    if type(e).__name__ in ("PermissionDeniedError", "UnauthenticatedError") or _CREDENTIALS.search(text):
        return {"cause": "credentials", "detail": detail, "endpoint": endpoint_name()}
    if _NETWORK.search(text):
        return {"cause": "network", "detail": detail, "endpoint": endpoint_name()}
    return {"cause": "other", "detail": _clip(text, 300), "endpoint": endpoint_name()}


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit].rstrip() + "..."


def local_disk_finding(e: OSError, object_url: str, *, part: str | None = None,
                       staging_dir: str | None = None) -> Finding:
    """An OSError of the local disk (no space, read-only, permission) while uploading
    `object_url`, or staging it (`part`) into `staging_dir`: its path and the fix."""
    return Finding("cache.local-disk-failed", object=object_url, part=part, staging_dir=staging_dir,
                   error=str(e.strerror or e), file=e.filename and str(e.filename))


@dataclass(frozen=True)
class ObjectInfo:
    """What a HEAD request tells of an object: its size and the metadata upload wrote with it."""

    size: int
    crc32c: int | None  # None: not written by a dflash upload
    cache: str | None


# obstore runs its requests on one tokio runtime per process, which does not survive a fork: a
# process forked after its parent used obstore (a DataLoader worker) hangs in its first request,
# with a client of its own too. Such a process fetches through a fresh interpreter instead.
_OBSTORE_PID: int | None = None  # the process that first used obstore


def obstore_usable() -> bool:
    return _OBSTORE_PID is None or _OBSTORE_PID == os.getpid()


def is_remote(path: str | os.PathLike) -> bool:
    return str(path).startswith(REMOTE_SCHEMES)


WAIT_SLICE_S = 0.05


def run_parallel(fn: Callable[[T, threading.Event], R], items: list[T], threads: int) -> list[R]:
    """`fn(item, stop)` over `items` in threads, results in order. The first error (or a signal's
    `Interrupted` in the waiting main thread) cancels what has not started and sets `stop`,
    which a running `fn` checks between objects (`check_stop`): no transfer starts behind an error or
    a stop."""
    stop = threading.Event()
    futures = []
    # A stop signal is raised between two slices of the wait, never inside the pool's locks
    # (signals_polled; the pool's shutdown runs after it, under the command's own handler).
    with ThreadPoolExecutor(max(1, threads)) as pool, signals_polled():
        try:  # (a signal may land while the items are being submitted, too)
            futures += [pool.submit(fn, item, stop) for item in items]
            pending = set(futures)
            while pending:
                # In slices: the kernel may deliver a signal to a worker thread, and the main
                # thread sees it only between two slices, not inside one long wait.
                done, pending = wait(pending, timeout=WAIT_SLICE_S, return_when=FIRST_COMPLETED)
                for f in done:
                    f.result()  # the first failure, as it happens
                stop_if_signalled()
            return [f.result() for f in futures]
        except BaseException:
            stop.set()
            for f in futures:
                f.cancel()
            raise


def check_stop(stop: threading.Event) -> None:
    """Between two objects of `run_parallel`: end this thread's work if another failed, or raise
    `Interrupted` once a stop was requested."""
    if stop.is_set():
        raise _Stopped
    if signum := stop_requested():
        stop.set()
        raise Interrupted(signum)


class _Stopped(Exception):
    """A thread's work ended because another thread failed (that thread's error is raised)."""


# -- the store ---------------------------------------------------------------------------------

class RemoteStore:
    """The objects under one s3:// prefix (obstore), with the errors this package raises."""

    def __init__(self, url: str):
        if not is_remote(url):
            raise CacheError(Finding("cache.remote-url-invalid", url=url))
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError:
            raise CacheError(Finding("cache.obstore-missing", url=url)) from None
        global _OBSTORE_PID
        if not obstore_usable():
            raise RemoteCacheError(Finding("cache.obstore-forked", url=url))
        _OBSTORE_PID = _OBSTORE_PID or os.getpid()
        self.url = url.rstrip("/")
        self._obs = obstore
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        options = {"allow_http": True} if endpoint.startswith("http://") else None
        try:
            self.store = S3Store.from_url(self.url, client_options=options, retry_config=RETRY_CONFIG)
        except Exception as e:  # noqa: BLE001 - obstore raises its own types for bad URLs and settings
            raise RemoteCacheError(Finding("cache.remote-open-failed", url=url, **failure_fields(e))) from e

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def failed(self, action: str, key: str | None, e: BaseException) -> RemoteCacheError:
        """A failed request: `action` (fetch, look-up, upload, list, delete), which object (None:
        the prefix), and why."""
        return RemoteCacheError(Finding("cache.remote-request-failed", action=action,
                                        url=self.url if key is None else self.where(key), **failure_fields(e)))

    def get(self, key: str) -> bytes:
        try:
            return bytes(self._obs.get(self.store, key).bytes())
        except FileNotFoundError:
            raise CacheNotFoundError(Finding("cache.remote-object-missing", url=self.where(key))) from None
        except Exception as e:  # noqa: BLE001
            raise self.failed("fetch", key, e) from e

    def stream(self, key: str) -> Iterator[bytes]:
        """The object's bytes in blocks; an error mid-stream is this package's too."""
        try:
            blocks = self._obs.get(self.store, key).stream(min_chunk_size=READ_BLOCK)
        except FileNotFoundError:
            raise CacheNotFoundError(Finding("cache.remote-object-missing", url=self.where(key))) from None
        except Exception as e:  # noqa: BLE001
            raise self.failed("fetch", key, e) from e
        return self._blocks(key, blocks)

    def _blocks(self, key: str, blocks: Iterable[Any]) -> Iterator[bytes]:
        it = iter(blocks)
        while True:
            try:
                block = next(it)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001
                raise self.failed("fetch", key, e) from e
            yield block

    def info(self, key: str) -> ObjectInfo | None:
        """The object's size and upload metadata (one HEAD request), None when it does not exist."""
        try:
            got = self._obs.get(self.store, key, options={"head": True})
            size, attrs = int(got.meta["size"]), got.attributes
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            raise self.failed("look-up", key, e) from e
        try:
            crc = int(attrs[META_CRC32C], 16)
        except (KeyError, ValueError):
            crc = None
        return ObjectInfo(size, crc, attrs.get(META_CACHE))

    def size(self, key: str) -> int | None:
        """The object's size, None when it does not exist."""
        found = self.info(key)
        return None if found is None else found.size

    def keys(self) -> list[str]:
        """Every object under the prefix (relative keys)."""
        try:
            return [meta["path"] for batch in self._obs.list(self.store) for meta in batch]
        except Exception as e:  # noqa: BLE001
            raise self.failed("list", None, e) from e

    def put(self, key: str, data: bytes | Path, *, crc32c: int | None = None, cache: str | None = None) -> None:
        """Write one object; with `crc32c` and `cache`, recorded as its metadata (upload's)."""
        attributes = {META_CRC32C: f"{crc32c:08x}", META_CACHE: cache} if crc32c is not None and cache else None
        try:
            self._obs.put(self.store, key, data, attributes=attributes)
        except OSError as e:
            if e.errno in LOCAL_DISK_ERRNOS and e.filename:  # reading the local file, not the request
                raise RemoteCacheError(local_disk_finding(e, self.where(key))) from e
            raise self.failed("upload", key, e) from e
        except Exception as e:  # noqa: BLE001
            raise self.failed("upload", key, e) from e

    def delete(self, keys: list[str]) -> None:
        try:
            for start in range(0, len(keys), 1000):
                self._obs.delete(self.store, keys[start:start + 1000])
        except Exception as e:  # noqa: BLE001
            raise self.failed("delete", None, e) from e


# -- the file index ----------------------------------------------------------------------------

@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to the part directory
    size: int
    crc32c: int


@dataclass
class FilesIndex:
    parts: dict[str, list[RemoteFile]] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        lines = [json.dumps({"part": name, "files": [[f.path, f.size, f"{f.crc32c:08x}"] for f in files]},
                            separators=(",", ":")) for name, files in self.parts.items()]
        return ("\n".join(lines) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> FilesIndex:
        out = cls()
        for n, line in enumerate(data.decode().splitlines(), 1):
            try:
                rec = json.loads(line)
                out.parts[rec["part"]] = [RemoteFile(p, int(s), int(c, 16)) for p, s, c in rec["files"]]
            except (ValueError, KeyError, TypeError) as e:
                raise CacheCorruptError(Finding("cache.file-index-record", file=where, line=n, error=str(e))) from e
        return out


def file_crc32c(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            crc = google_crc32c.extend(crc, block)
    return crc


@contextmanager
def staged_manifest(store: RemoteStore):
    """The remote manifest and file index, read through a temporary local copy."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dflash-remote-") as tmp:
        d = Path(tmp)
        for name in (HEADER_FILE, LOG_FILE, FILES_INDEX):
            try:
                (d / name).write_bytes(store.get(name))
            except CacheNotFoundError:
                if name == LOG_FILE:
                    continue
                raise CacheNotFoundError(Finding("cache.remote-not-a-cache", url=store.url, missing=name)) from None
        yield read_manifest(d), FilesIndex.from_bytes((d / FILES_INDEX).read_bytes(), store.where(FILES_INDEX))
