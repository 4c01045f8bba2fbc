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

import json
import os
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import google_crc32c

from .errors import CacheCorruptError, CacheError, CacheNotFoundError
from .manifest import HEADER_FILE, LOG_FILE, read_manifest

REMOTE_SCHEMES = ("s3://",)
FILES_INDEX = "manifest.files.jsonl"
READ_BLOCK = 8 << 20


class RemoteCacheError(CacheError):
    """A remote cache cannot be reached, or a file of it cannot be fetched."""


# obstore runs its requests on one tokio runtime per process, which does not survive a fork: a
# process forked after its parent used obstore (a DataLoader worker) hangs in its first request,
# with a client of its own too. Such a process fetches through a fresh interpreter instead.
_OBSTORE_PID: int | None = None  # the process that first used obstore


def obstore_usable() -> bool:
    return _OBSTORE_PID is None or _OBSTORE_PID == os.getpid()


def is_remote(path: str | os.PathLike) -> bool:
    return str(path).startswith(REMOTE_SCHEMES)


# -- the store ---------------------------------------------------------------------------------

class RemoteStore:
    """The objects under one s3:// prefix (obstore), with the errors this package raises."""

    def __init__(self, url: str):
        if not is_remote(url):
            raise CacheError(f"{url} is not a remote cache URL: write s3://bucket/prefix.")
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError:
            raise CacheError(
                f"Reading {url} needs obstore: pip install 'dflash-pipeline[s3]' (or pip install obstore)."
            ) from None
        global _OBSTORE_PID
        if not obstore_usable():
            raise RemoteCacheError(f"{url}: obstore was used before this process was forked and cannot be "
                                   "used in it; fetch through a fresh process (StagedCache does).")
        _OBSTORE_PID = _OBSTORE_PID or os.getpid()
        self.url = url.rstrip("/")
        self._obs = obstore
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        options = {"allow_http": True} if endpoint.startswith("http://") else None
        try:
            self.store = S3Store.from_url(self.url, client_options=options)
        except Exception as e:  # noqa: BLE001 - obstore raises its own types for bad URLs and settings
            raise RemoteCacheError(f"Cannot open {url}: {e}. Check the URL and the AWS_* settings.") from e

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def get(self, key: str) -> bytes:
        try:
            return bytes(self._obs.get(self.store, key).bytes())
        except FileNotFoundError:
            raise CacheNotFoundError(f"{self.where(key)} does not exist.") from None
        except Exception as e:  # noqa: BLE001
            raise RemoteCacheError(f"Fetching {self.where(key)} failed: {e}") from e

    def stream(self, key: str) -> Iterable[bytes]:
        try:
            return self._obs.get(self.store, key).stream(min_chunk_size=READ_BLOCK)
        except FileNotFoundError:
            raise CacheNotFoundError(f"{self.where(key)} does not exist.") from None
        except Exception as e:  # noqa: BLE001
            raise RemoteCacheError(f"Fetching {self.where(key)} failed: {e}") from e

    def size(self, key: str) -> int | None:
        """The object's size, None when it does not exist."""
        try:
            return int(self._obs.head(self.store, key)["size"])
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            raise RemoteCacheError(f"Looking up {self.where(key)} failed: {e}") from e

    def put(self, key: str, data: bytes | Path) -> None:
        try:
            self._obs.put(self.store, key, data)
        except Exception as e:  # noqa: BLE001
            raise RemoteCacheError(f"Uploading {self.where(key)} failed: {e}") from e


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
                raise CacheCorruptError(f"{where}, line {n}: not a file index record ({e}).") from e
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
                raise CacheNotFoundError(
                    f"{store.url} is not a dflash cache: it has no {name}. Upload a cache with "
                    f"`dflash-cache upload LOCAL {store.url}` (the header is written last: an "
                    "interrupted upload has none yet)."
                ) from None
        yield read_manifest(d), FilesIndex.from_bytes((d / FILES_INDEX).read_bytes(), store.where(FILES_INDEX))
