"""What dflash.cache_tools tells its user: one renderer per finding code (`dflash.runtime.findings`).

Each renderer takes a finding's fields and returns one paragraph: what was wrong, where (file,
sample, part, flag) and what to do. Code states findings; the words live here.
"""

from __future__ import annotations

from dflash.runtime.findings import renders

# -- remote caches (cache_tools/remote_store.py, remote.py, remote_upload.py) ------------------


def request_failure(cause, detail, endpoint):
    """Why a request failed (`remote_store.failure_fields`), in the terms a user acts on."""
    if cause == "credentials":
        return (f"the credentials were refused or are missing ({detail}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to a key that may use this bucket")
    if cause == "network":
        return (f"{endpoint} cannot be reached ({detail}): check the network and AWS_ENDPOINT_URL "
                "(AWS_ALLOW_HTTP=true for an http:// endpoint), then rerun")
    if cause == "missing":  # (detail: the object's own finding)
        return detail.rstrip(".")
    return detail


_REQUEST = {"fetch": "Fetching {}", "look-up": "Looking up {}", "upload": "Uploading {}", "list": "Listing {}",
            "delete": "Deleting objects under {}"}
_FAILURE = dict(cause="network", detail="error sending request", endpoint="http://127.0.0.1:9000")


@renders("cache.remote-url-invalid", example=dict(url="bucket/prefix"))
def _remote_url_invalid(url):
    return f"{url} is not a remote cache URL: write s3://bucket/prefix."


@renders("cache.obstore-missing", example=dict(url="s3://bucket/cache"))
def _obstore_missing(url):
    return f"Reading {url} needs obstore: pip install 'dflash-pipeline[s3]' (or pip install obstore)."


@renders("cache.obstore-forked", example=dict(url="s3://bucket/cache"))
def _obstore_forked(url):
    return (f"{url}: obstore was used before this process was forked and cannot be used in it; fetch "
            "through a fresh process (StagedCache does).")


@renders("cache.remote-open-failed", example=dict(url="s3://bucket/cache", **_FAILURE))
def _remote_open_failed(url, cause, detail, endpoint):
    return f"Cannot open {url}: {request_failure(cause, detail, endpoint)}. Check the URL and the AWS_* settings."


@renders("cache.remote-request-failed", example=dict(action="fetch", url="s3://bucket/cache/manifest.json", **_FAILURE))
def _remote_request_failed(action, url, cause, detail, endpoint):
    return f"{_REQUEST[action].format(url)} failed: {request_failure(cause, detail, endpoint)}."


@renders("cache.remote-object-missing", example=dict(url="s3://bucket/cache/manifest.json"))
def _remote_object_missing(url):
    return f"{url} does not exist."


@renders("cache.local-disk-failed", example=dict(object="s3://b/c/parts/p-1/hidden.bin", part="p-1",
                                                staging_dir="/scratch/stage", error="No space left on device",
                                                file="/scratch/stage/parts/p-1/hidden.bin.partial"))
def _local_disk_failed(object, part, staging_dir, error, file):
    what = (f"Staging {object} (part {part!r}) into {staging_dir}" if staging_dir is not None
            else f"Uploading {object}")
    where = f" ({file})" if file else ""
    return (f"{what} failed on the local disk: {error}{where}. Free space there or choose another location "
            "(dflash-train --staging-dir), then rerun: what was already fetched is kept.")


@renders("cache.file-index-record", example=dict(file="s3://bucket/cache/files.jsonl", line=3, error="'part'"))
def _file_index_record(file, line, error):
    return f"{file}, line {line}: not a file index record ({error})."


@renders("cache.remote-not-a-cache", example=dict(url="s3://bucket/cache", missing="manifest.json"))
def _remote_not_a_cache(url, missing):
    return (f"{url} is not a dflash cache: it has no {missing}. Upload a cache with `dflash-cache upload "
            f"LOCAL {url}` (the header is written last: an interrupted upload has none yet).")


@renders("cache.parts-not-indexed", example=dict(url="s3://bucket/cache", parts=["p-00001"], index="files.jsonl"))
def _parts_not_indexed(url, parts, index):
    return (f"{url}: the parts {parts} are committed but not in {index}: the upload did not finish. Upload "
            "the cache again (`dflash-cache upload`).")


@renders("cache.download-corrupt", example=dict(object="s3://b/c/parts/p-1/hidden.bin", part="p-1", size=10,
                                               indexed_size=12, attempts=3, url="s3://b/c"))
def _download_corrupt(object, part, size, indexed_size, attempts, url):
    has = f"{size} bytes, the index says {indexed_size}" if size != indexed_size else "a wrong crc32c"
    return (f"{object} (part {part!r}): the download has {has} after {attempts} attempts. The remote object "
            f"is corrupt: run `dflash-cache verify {url}`, then upload the part again from a good copy.")


@renders("cache.fetch-failed-retries", example=dict(object="s3://b/c/parts/p-1/hidden.bin", part="p-1", attempts=3,
                                                   **_FAILURE))
def _fetch_failed_retries(object, part, attempts, cause, detail, endpoint):
    return (f"Fetching {object} (part {part!r}) failed {attempts} times: {request_failure(cause, detail, endpoint)}. "
            "Parts already staged are kept.")


def progress(committed, planned, committed_samples=0, planned_samples=0):
    """How far a planned extraction is: "6 of its 46 planned parts are committed (24 of 300 samples)"."""
    samples = f" ({committed_samples:,} of {planned_samples:,} samples)" if planned_samples else ""
    return f"{committed} of its {planned} planned parts are committed{samples}"


_PROGRESS = dict(committed=6, planned=46, committed_samples=24, planned_samples=300)


@renders("cache.upload-unfinished", example=dict(cache="cache", **_PROGRESS))
def _upload_unfinished(cache, committed, planned, committed_samples, planned_samples):
    return (f"Cannot upload {cache}: it is not a finished cache "
            f"({progress(committed, planned, committed_samples, planned_samples)}): its extraction was stopped "
            "before its end, is still running, or lost a rank, and a trainer of the remote copy would take the "
            "parts there for the whole data. Rerun the same dflash-extract command to finish it, then upload.")


@renders("cache.upload-prefix-other-cache", example=dict(
    url="s3://b/c", local="cache", uploading="Qwen3ForCausalLM, layers [1, 3], codec bf16, identity 0123abcd",
    there="Qwen3ForCausalLM, layers [2, 4], codec bf16, identity 4567cdef", header="manifest.json",
    differences=[["target_layer_ids", "[2, 4]", "[1, 3]"]]))
def _upload_prefix_other_cache(url, local, uploading, there, header, differences):
    if there is None:
        what = f"a {header} that is not a cache header"
    else:
        what = f"another cache ({there}" + (
            "; " + ", ".join(f"{k} {b} there, {a} here" for k, b, a in differences) if differences else "") + ")"
    return (f"{url} holds {what}, not {local} ({uploading}): uploading would mix the two caches' objects under "
            f"one prefix. {_UPLOAD_ADVICE}")


_UPLOAD_ADVICE = ("Upload to another prefix, or pass --replace to delete what is there and upload this cache in its "
                  "place (the remote copy of the other cache is lost).")


@renders("cache.upload-prefix-foreign-objects", example=dict(
    url="s3://b/c", objects=2, first="parts/p-1/hidden.bin", caches=["4567cdef"], local="cache",
    uploading="Qwen3ForCausalLM, layers [1, 3], codec bf16, identity 0123abcd"))
def _upload_prefix_foreign_objects(url, objects, first, caches, local, uploading):
    whose = (f"of the unfinished upload of another cache (identity {', '.join(caches)})" if caches
             else "written by no dflash upload of this cache")
    return f"{url} holds {objects} object(s) ({first} first) {whose}, not of {local} ({uploading}). {_UPLOAD_ADVICE}"


@renders("cache.plan-not-json", example=dict(file="cache/extraction_plan.json", error="Expecting value: line 1"))
def _plan_not_json(file, error):
    return (f"{file} is not valid JSON ({error}): the extraction plan is damaged. Delete it and rerun "
            "dflash-extract on the cache to write it again.")


@renders("cache.plan-damaged", example=dict(file="cache/extraction_plan.json", lacks="'parts'"))
def _plan_damaged(file, lacks):
    return (f"{file}: the extraction plan lacks {lacks}: it is damaged. Delete it and rerun dflash-extract on "
            "the cache to write it again.")
