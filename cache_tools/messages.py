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


# -- imports (cache_tools/importers.py, importing.py) ------------------------------------------


PLANNED_FIX = ("It was readable when the import was planned: restore it, or start the import anew with --force "
                "(--skip-bad then leaves it out).")
_SPECFORGE_FIX = "Regenerate it with prepare_hidden_states.py, or pass --skip-bad to leave it out."


def _sample(file, key, problem, fix=None, planned=False):
    """A sample file's problem (BadSampleFile): where (the file, the key), what, and the fix (the
    import's, once it was planned: the file changed since)."""
    where = f"{file}" + (f", key {key!r}" if key else "")
    fix = PLANNED_FIX if planned else fix
    return f"{where}: {problem}." + (f" {fix}" if fix else "")


_F = dict(file="features/rows_0-100/data_7.ckpt")


@renders("cache.import-format-unknown", example=dict(format="eagle", formats=["specforge", "speculators"]))
def _import_format_unknown(format, formats):
    return f"--format {format!r} is not a format dflash-cache import reads: use one of {', '.join(formats)}."


@renders("cache.import-source-not-dir", example=dict(src="features", format="specforge"))
def _import_source_not_dir(src, format):
    return f"{src} is not a directory: point dflash-cache import at the {format} output directory."


@renders("cache.sample-not-tensor", example=dict(_F, key="input_ids", got="list"))
def _sample_not_tensor(file, key, got, planned=False):
    return _sample(file, key, f"is a {got}, not a tensor", planned=planned)


@renders("cache.sample-token-shape", example=dict(_F, key="input_ids", shape=[2, 7]))
def _sample_token_shape(file, key, shape, planned=False):
    return _sample(file, key, f"has shape {shape}, not [tokens] (or [1, tokens])", planned=planned)


@renders("cache.sample-token-dtype", example=dict(_F, key="input_ids", dtype="float32"))
def _sample_token_dtype(file, key, dtype, planned=False):
    return _sample(file, key, f"holds {dtype} values, not integers", planned=planned)


@renders("cache.sample-hidden-shape", example=dict(_F, key="hidden_states", shape=[7]))
def _sample_hidden_shape(file, key, shape, planned=False):
    return _sample(file, key, f"has shape {shape}, not [tokens, width] (or [1, tokens, width])", planned=planned)


@renders("cache.sample-hidden-dtype", example=dict(_F, key="hidden_states", dtype="int8",
                                                  dtypes=["bfloat16", "float16", "float32"]))
def _sample_hidden_dtype(file, key, dtype, dtypes, planned=False):
    return _sample(file, key, f"holds {dtype} values; an import reads {', '.join(dtypes)} hidden states (a quantized "
                   "format needs its scales, which this file does not name)", planned=planned)


@renders("cache.specforge-duplicate-sample", example=dict(_F, other="features/rows_0-100/data_7.ckpt.gz", sample=7))
def _specforge_duplicate_sample(file, other, sample):
    return (f"{other} and {file} both hold sample {sample}: SpecForge writes one file per sample (a run with and "
            "one without --compress wrote the same directory?). Remove one of them.")


@renders("cache.specforge-no-files", example=dict(src="features"))
def _specforge_no_files(src):
    return (f"{src} holds no SpecForge feature files (data_<index>.ckpt or .ckpt.gz, below rows_* directories): "
            "point at the --output-path of scripts/prepare_hidden_states.py.")


@renders("cache.sample-not-torch-save", example=dict(_F, key=None, error="PytorchStreamReader failed"))
def _sample_not_torch_save(file, key, error, planned=False):
    return _sample(file, key, f"cannot be read as a torch.save file ({error})", _SPECFORGE_FIX, planned)


@renders("cache.sample-not-tensors", example=dict(_F, key=None, error="Unsupported global: GLOBAL foo.Bar"))
def _sample_not_tensors(file, key, error, planned=False):
    return _sample(file, key, f"holds objects other than tensors (torch.load(weights_only=True) refused it: {error})",
                   _SPECFORGE_FIX, planned)


@renders("cache.sample-not-dict", example=dict(_F, key=None, got="list"))
def _sample_not_dict(file, key, got, planned=False):
    return _sample(file, key, f"holds a {got}, not a dict of tensors", _SPECFORGE_FIX, planned)


@renders("cache.specforge-keys", example=dict(_F, key=None, missing=["loss_mask"], hidden=["hidden_states"],
                                             expected=["hidden_states", "aux_hidden_state"],
                                             keys=["hidden_states", "input_ids"]))
def _specforge_keys(file, key, missing, hidden, expected, keys, planned=False):
    what = f"lacks {missing}" if missing else f"holds both {hidden}" if hidden else f"holds none of {expected}"
    return _sample(file, key, f"{what} (its keys: {keys}): it is not a SpecForge DFlash/DSpark/Domino or EAGLE3 "
                   "feature file", planned=planned)


_S = dict(file="data/hidden_states/hs_7.safetensors", key=None)


@renders("cache.safetensors-unreadable", example=dict(_S, error="shorter than a safetensors header"))
def _safetensors_unreadable(file, key, error, planned=False):
    return _sample(file, key, f"is not a readable safetensors file ({error})", planned=planned)


@renders("cache.safetensors-not-object", example=_S)
def _safetensors_not_object(file, key, planned=False):
    return _sample(file, key, "is not a safetensors file (its header is not a JSON object)", planned=planned)


@renders("cache.safetensors-truncated", example=dict(_S, size=1000, promised=4096))
def _safetensors_truncated(file, key, size, promised, planned=False):
    return _sample(file, key, f"is truncated ({size:,} bytes, its header promises {promised:,})", planned=planned)


@renders("cache.pyarrow-missing", example=dict(src="data"))
def _pyarrow_missing(src):
    return (f"{src} is a speculators dataset (Arrow files), and reading it needs pyarrow, which is not installed. "
            "Install it with `pip install 'dflash-pipeline[parquet]'` (or `pip install pyarrow`).")


@renders("cache.speculators-no-state", example=dict(src="data"))
def _speculators_no_state(src):
    return (f"{src} holds no state.json: a speculators import reads the dataset written by prepare_data.py (its "
            "--output, the directory whose hidden_states/ holds the hs_<index>.safetensors files).")


@renders("cache.speculators-state-files", example=dict(file="data/state.json", error="'_data_files'"))
def _speculators_state_files(file, error):
    return f"{file} does not list the dataset's Arrow files ({error})."


@renders("cache.speculators-indices", example=dict(file="data/state.json"))
def _speculators_indices(file):
    return (f"{file} maps its rows through an indices file, which the import does not read: save the dataset "
            "again with save_to_disk (it writes the rows in order).")


@renders("cache.arrow-unreadable", example=dict(file="data/data-00000-of-00001.arrow", error="Invalid IPC stream"))
def _arrow_unreadable(file, error):
    return f"{file}: cannot read the dataset's Arrow file ({error})."


@renders("cache.speculators-columns", example=dict(src="data", missing=["loss_mask"], columns=["input_ids"]))
def _speculators_columns(src, missing, columns):
    return f"{src}: the dataset has no {missing or 'rows'} (columns: {columns})."


@renders("cache.speculators-no-files", example=dict(src="data/hidden_states"))
def _speculators_no_files(src):
    return (f"{src} holds no hs_<row>.safetensors files: point at the dataset directory whose hidden_states/ "
            "data_generation_offline.py filled (its default --output).")


@renders("cache.speculators-row-beyond", example=dict(file="data/hidden_states/hs_12.safetensors", row=12,
                                                     src="data", rows=10, files=2))
def _speculators_row_beyond(file, row, src, rows, files):
    return (f"{file} is the hidden states of row {row}, but the dataset at {src} has {rows} rows ({files} such "
            "file(s)): the files were generated from another dataset.")


@renders("cache.sample-row-missing", example=dict(_S, key="loss_mask", row=7, src="data"))
def _sample_row_missing(file, key, row, src, planned=False):
    return _sample(file, key, f"is missing from row {row} of the dataset at {src}", planned=planned)


@renders("cache.sample-being-written", example=_S)
def _sample_being_written(file, key, planned=False):
    return _sample(file, key, "is still being written (its .lock file is there)",
                   "Wait for data_generation_offline.py to finish, or pass --skip-bad to leave it out.", planned)


@renders("cache.sample-lacks-key", example=dict(_S, lacks="token_ids", keys=["hidden_states"]))
def _sample_lacks_key(file, key, lacks, keys, planned=False):
    return _sample(file, key, f"lacks {lacks!r} (its keys: {keys})", planned=planned)


@renders("cache.sample-hidden-3d", example=dict(_S, key="hidden_states", shape=[7, 4096]))
def _sample_hidden_3d(file, key, shape, planned=False):
    return _sample(file, key, f"has shape {shape}, not [tokens, layers, hidden]", planned=planned)


@renders("cache.sample-unreadable", example=dict(_S, error="Error while deserializing header"))
def _sample_unreadable(file, key, error, planned=False):
    return _sample(file, key, f"cannot be read ({error})", planned=planned)


@renders("cache.sample-token-ids-mismatch", example=dict(_S, key="token_ids", tokens=7, row=7, row_tokens=9))
def _sample_token_ids_mismatch(file, key, tokens, row, row_tokens, planned=False):
    return _sample(file, key, f"holds {tokens} token ids that are not row {row}'s input_ids ({row_tokens} ids) in "
                   "the dataset", "The hidden states belong to another sample: regenerate the file.", planned)


_T = dict(file="models/qwen3/config.json")


@renders("cache.import-target-config-missing", example=_T)
def _import_target_config_missing(file):
    return (f"{file} does not exist: --target-model names the target's Hugging Face directory (its config.json "
            "gives the hidden size, layers and vocabulary).")


@renders("cache.import-target-config-unreadable", example=dict(_T, error="Expecting value: line 1 column 1"))
def _import_target_config_unreadable(file, error):
    return f"{file} cannot be read as JSON ({error})."


@renders("cache.import-target-config-lacks", example=dict(_T, lacks="'vocab_size'"))
def _import_target_config_lacks(file, lacks):
    return (f"{file} lacks a usable {lacks} (hidden_size, num_hidden_layers and vocab_size are needed to check the "
            "imported hidden states).")


def _layer_flags(source, numbering):
    return (f"--target-layer-ids (ours: id l is the output of decoder layer l) or --source-layer-ids (the {source} "
            f"numbering: {numbering})")


_N = dict(source="speculators", numbering="the layer ids vLLM captured")


@renders("cache.import-layer-flags", example=_N)
def _import_layer_flags(source, numbering):
    return f"Pass one of {_layer_flags(source, numbering)}: the {source} files do not record which layers they hold."


@renders("cache.sample-slot-width", example=dict(_S, width=2048, hidden_size=4096))
def _sample_slot_width(file, key, width, hidden_size, planned=False):
    return _sample(file, key, f"holds layers of width {width}, the target's hidden size is {hidden_size}: it was "
                   "written for another target", planned=planned)


@renders("cache.sample-width-not-multiple", example=dict(_F, key=None, width=5000, hidden_size=4096))
def _sample_width_not_multiple(file, key, width, hidden_size, planned=False):
    return _sample(file, key, f"holds hidden states of width {width}, not a multiple of the target's hidden size "
                   f"{hidden_size}: it was written for another target", planned=planned)


@renders("cache.sample-layer-count", example=dict(_S, slots=4, hidden_size=4096, ids=[3, 19, 33], **_N))
def _sample_layer_count(file, key, slots, hidden_size, ids, source, numbering, planned=False):
    return _sample(file, key, f"holds {slots} layers of width {hidden_size}, but the layer ids name {len(ids)} "
                   f"({ids} in the {source} numbering)",
                   f"Pass the ids of every layer the files hold: {_layer_flags(source, numbering)}.", planned)


@renders("cache.sample-layers-recorded", example=dict(_S, recorded=[2, 18, 33], ids=[3, 19, 33]))
def _sample_layers_recorded(file, key, recorded, ids, planned=False):
    return _sample(file, key, f"records the layers {recorded}, the flags name {ids}", planned=planned)


@renders("cache.sample-empty", example=dict(_F, key="input_ids"))
def _sample_empty(file, key, planned=False):
    return _sample(file, key, "is empty: a cached sample needs at least one token", planned=planned)


@renders("cache.sample-mask-length", example=dict(_F, key="loss_mask", entries=6, tokens=7))
def _sample_mask_length(file, key, entries, tokens, planned=False):
    return _sample(file, key, f"has {entries} entries for {tokens} input_ids", planned=planned)


@renders("cache.sample-rows", example=dict(_F, key="hidden states", rows=6, tokens=7))
def _sample_rows(file, key, rows, tokens, planned=False):
    return _sample(file, key, f"has {rows} rows for {tokens} input_ids: the hidden states are not the states of "
                   "these tokens", planned=planned)


@renders("cache.sample-width-differs", example=dict(_F, key="hidden states", width=8192, others=12288))
def _sample_width_differs(file, key, width, others, planned=False):
    return _sample(file, key, f"has width {width}, the other files {others} (the layers or the target differ "
                   "between files)", planned=planned)


@renders("cache.sample-token-outside", example=dict(_F, key="input_ids", token=151936, position=3, vocab_size=151936))
def _sample_token_outside(file, key, token, position, vocab_size, planned=False):
    return _sample(file, key, f"holds the id {token} at position {position}, outside the target's {vocab_size} ids",
                   planned=planned)


@renders("cache.sample-mask-values", example=dict(_F, key="loss_mask"))
def _sample_mask_values(file, key, planned=False):
    return _sample(file, key, "holds values other than 0 and 1", planned=planned)


@renders("cache.sample-tokens-changed", example=dict(_F, key="input_ids", tokens=9, planned_tokens=7))
def _sample_tokens_changed(file, key, tokens, planned_tokens, planned=False):
    return _sample(file, key, f"has {tokens} tokens, {planned_tokens} when the import was planned", planned=planned)


@renders("cache.sample-not-finite", example=dict(_F, key="hidden states", planned=True))
def _sample_not_finite(file, key, planned=False):
    return _sample(file, key, "holds NaN or infinite values", planned=planned)


@renders("cache.import-overlap", example=dict(cache="features/cache", src="features"))
def _import_overlap(cache, src):
    return (f"The cache {cache} and the source {src} overlap: write the cache into a directory outside the source "
            "(and not around it).")


@renders("cache.import-part-tokens", example=dict(flag="--part-tokens", value=0))
def _import_part_tokens(flag, value):
    return f"{flag} must be positive (got {value})."


@renders("cache.import-no-last-layer", example=dict(flag="--store-last-hidden", source="specforge",
                                                   source_ids=[1, 17, 32], target_layer_ids=[1, 17, 32]))
def _import_no_last_layer(flag, source, source_ids, target_layer_ids):
    return (f"{flag}: the {source} files hold no last-layer slot ({source} layers {source_ids} -> target_layer_ids "
            f"{target_layer_ids}); import without it.")


@renders("cache.import-nothing-readable", example=dict(files=3, src="features", first="features/data_0.ckpt: ..."))
def _import_nothing_readable(files, src, first):
    return f"None of the {files} sample files of {src} can be read (the first: {first})."


@renders("cache.import-nothing-importable", example=dict(files=3, src="features", first=None))
def _import_nothing_importable(files, src, first):
    return f"None of the {files} sample files of {src} can be imported (the first: {first or 'none'})."


@renders("cache.part-write-failed", example=dict(part="part-000003", cache="cache", error="No space left on device",
                                                file=None))
def _part_write_failed(part, cache, error, file):
    return (f"Writing part {part} into {cache} failed: {error}{f' ({file})' if file else ''}. Free space there (or "
            "fix the cause), then rerun the same command: the parts written so far are kept and skipped.")


# -- writing a cache (cache_tools/writer.py) ---------------------------------------------------


@renders("cache.dir-not-a-cache", example=dict(cache="runs/out"))
def _dir_not_a_cache(cache):
    return (f"{cache} is not empty and holds no cache manifest: refusing to write a cache into it. Choose an empty "
            "or new directory.")


@renders("cache.dir-not-creatable", example=dict(cache="/data/cache", error="Read-only file system"))
def _dir_not_creatable(cache, error):
    return f"Cannot create the cache directory {cache}: {error}. Choose a writable location with free space."


@renders("cache.dir-not-writable", example=dict(cache="cache", error="Permission denied", file="cache/manifest.json"))
def _dir_not_writable(cache, error, file):
    return (f"Cannot write to the cache at {cache}: {error}{f' ({file})' if file else ''}. Make the directory "
            "writable (or free space), then rerun.")


@renders("cache.part-name-invalid", example=dict(part="../p"))
def _part_name_invalid(part):
    return f"Invalid part name {part!r}: use a plain name such as part-000012."


@renders("cache.write-sample-empty", example=dict(sample=7))
def _write_sample_empty(sample):
    return f"Sample {sample} is empty: a cached sample needs at least one token."


@renders("cache.write-lengths", example=dict(part="part-000001", samples=4, lengths=3))
def _write_lengths(part, samples, lengths):
    return (f"Part {part}: {samples} sample ids for {lengths} lengths, or an empty sample; every sample needs at "
            "least one token.")


@renders("cache.write-split-keys-count", example=dict(part="part-000001", keys=3, samples=4))
def _write_split_keys_count(part, keys, samples):
    return f"Part {part}: {keys} split keys for {samples} samples."


@renders("cache.write-grouped-outside", example=dict(part="part-000001", samples=4))
def _write_grouped_outside(part, samples):
    return f"Part {part}: grouped sample indices outside its {samples} samples."


def _written(sample, part):
    return f"Sample {sample}" if sample is not None else f"Part {part}"


@renders("cache.write-arrays", example=dict(sample=None, part="part-000001", stored=["input_ids", "hidden"],
                                           missing=["hidden"], unknown=["last_hidden"]))
def _write_arrays(sample, part, stored, missing, unknown):
    given = "; ".join(([f"missing {missing}"] if missing else []) + ([f"not stored {unknown}"] if unknown else []))
    return (f"{_written(sample, part)}: the cache stores the arrays {stored}; {given}. Pass exactly the arrays the "
            "cache was created with (store_last_hidden, store_topk, the scales of an fp8 codec).")


@renders("cache.write-rows", example=dict(sample=7, part=None, array="hidden", rows=9, tokens=10))
def _write_rows(sample, part, array, rows, tokens):
    return f"{_written(sample, part)}: {array} has {rows} rows, input_ids {tokens}."


@renders("cache.write-width", example=dict(sample=7, part=None, array="hidden", shape=[4096], width=8192, layers=2,
                                          hidden_size=4096))
def _write_width(sample, part, array, shape, width, layers, hidden_size):
    got = " x ".join(map(str, shape)) or "none (1-D)"
    expect = f"{layers} layers x {hidden_size} = {width}" if layers is not None else str(width or "none (1-D)")
    return f"{_written(sample, part)}: {array} has width {got}, the cache expects {expect}."


@renders("cache.write-dtype", example=dict(sample=7, part=None, array="input_ids", dtype="int32", got="int64"))
def _write_dtype(sample, part, array, dtype, got):
    return f"{_written(sample, part)}: {array} must be {dtype} rows, got {got}."


@renders("cache.write-scales-missing", example=dict(codec="fp8", array="hidden_scale"))
def _write_scales_missing(codec, array):
    return f"{codec} rows given as stored need their {array} array too."


@renders("cache.write-part-empty", example=dict(part="part-000001"))
def _write_part_empty(part):
    return f"Part {part} has no samples: nothing to commit."


@renders("cache.write-split-keys-some", example=dict(part="part-000001", given=2, samples=4))
def _write_split_keys_some(part, given, samples):
    return f"Part {part}: {given} of its {samples} samples have a split key: give one for every sample or for none."


# -- reading a part's files (cache_tools/part_files.py, shard_format.py) -----------------------


def _at(part=None, array=None, dir=None, chunk=None, shard_file=None, where=None):
    """Where in a cache part: "cache part 'p' (array hidden, chunk 3) at DIR" (or the caller's own words)."""
    if where is not None:
        return where
    extra = f", chunk {chunk}" if chunk is not None else f", shard file {shard_file}, index" if shard_file else ""
    return f"cache part {part!r} (array {array}{extra}) at {dir}"


_AT = dict(part="part-000001", array="hidden", dir="cache/parts/part-000001", chunk=3, shard_file=None)
_VERIFY_FIX = "Run `dflash-cache verify` to list every damaged chunk, then re-extract the part."

# What is wrong with a part's file, without where (the reader's findings say where, and what to
# do; verify lists them under its own location).
_PART_FILE_REASONS = {
    "cache.chunk-checksum": lambda f: "checksum mismatch, the stored bytes are corrupt",
    "cache.chunk-truncated": lambda f: "chunk is shorter than its checksum (truncated)",
    "cache.shard-truncated": lambda f: f"the shard file is truncated ({f['size']} bytes)",
    "cache.shard-offsets-past-end": lambda f: "chunk offsets point past the end of the file (truncated)",
    "cache.array-meta-unknown": lambda f: f"array metadata is not a layout this reader knows ({f['error']})",
    "cache.array-meta-not-json": lambda f: f"zarr.json is not valid JSON ({f['error']})",
    "cache.part-file-missing": lambda f: f"file {f['file']} is missing",
    "cache.part-file-empty": lambda f: f"file {f['file']} is empty (truncated)",
    "cache.chunk-decompress": lambda f: f"chunk does not decompress ({f['error']})",
    "cache.chunk-size": lambda f: f"decoded chunk has {f['size']} bytes, expected {f['expected']}",
    "cache.commit-record-checksum": lambda f: "the commit record is damaged (checksum mismatch: it was edited or torn)",
    "cache.commit-record-split-keys": lambda f: (f"the commit record of {f['part']} lists {f['keys']} split keys for "
                                                 f"its {f['samples']} samples, keys outside 64 bits, or grouped "
                                                 "samples outside them (it was edited)"),
}


def part_file_reason(finding):
    """The reason of a reader's finding (or an error's text) without its location and advice."""
    reason = _PART_FILE_REASONS.get(getattr(finding, "code", None))
    return reason(finding.fields) if reason is not None else str(finding).rstrip(".")


@renders("cache.chunk-checksum", example=_AT)
def _chunk_checksum(part=None, array=None, dir=None, chunk=None, shard_file=None, where=None):
    return f"{_at(part, array, dir, chunk, shard_file, where)}: {_PART_FILE_REASONS['cache.chunk-checksum']({})}. {_VERIFY_FIX}"


@renders("cache.chunk-truncated", example=_AT)
def _chunk_truncated(part=None, array=None, dir=None, chunk=None, shard_file=None, where=None):
    return f"{_at(part, array, dir, chunk, shard_file, where)}: {_PART_FILE_REASONS['cache.chunk-truncated']({})}."


@renders("cache.shard-truncated", example=dict(_AT, chunk=None, shard_file="c/0/0", size=12))
def _shard_truncated(size, part=None, array=None, dir=None, chunk=None, shard_file=None, where=None):
    return f"{_at(part, array, dir, chunk, shard_file, where)}: {_PART_FILE_REASONS['cache.shard-truncated'](dict(size=size))}."


@renders("cache.shard-offsets-past-end", example=dict(_AT, chunk=None, shard_file="c/0/0"))
def _shard_offsets_past_end(part=None, array=None, dir=None, chunk=None, shard_file=None, where=None):
    return f"{_at(part, array, dir, chunk, shard_file, where)}: {_PART_FILE_REASONS['cache.shard-offsets-past-end']({})}."


@renders("cache.array-meta-unknown", example=dict(_AT, chunk=None, error="unsupported codecs ('gzip',)"))
def _array_meta_unknown(error, part=None, array=None, dir=None, chunk=None, shard_file=None, where=None):
    return f"{_at(part, array, dir, chunk, shard_file, where)}: {_PART_FILE_REASONS['cache.array-meta-unknown'](dict(error=error))}."


@renders("cache.array-meta-not-json", example=dict(_AT, chunk=None, error="Expecting value: line 1 column 1"))
def _array_meta_not_json(error, part=None, array=None, dir=None, chunk=None, shard_file=None):
    return f"{_at(part, array, dir, chunk, shard_file)}: {_PART_FILE_REASONS['cache.array-meta-not-json'](dict(error=error))}."


@renders("cache.part-file-missing", example=dict(_AT, chunk=None, file="c/0/0"))
def _part_file_missing(file, part=None, array=None, dir=None, chunk=None, shard_file=None):
    return (f"{_at(part, array, dir, chunk, shard_file)}: {_PART_FILE_REASONS['cache.part-file-missing'](dict(file=file))}. "
            "The part is damaged: run `dflash-cache verify` and re-extract it.")


@renders("cache.part-file-empty", example=dict(_AT, chunk=None, file="c/0/0"))
def _part_file_empty(file, part=None, array=None, dir=None, chunk=None, shard_file=None):
    return f"{_at(part, array, dir, chunk, shard_file)}: {_PART_FILE_REASONS['cache.part-file-empty'](dict(file=file))}."


@renders("cache.array-meta-mismatch", example=dict(_AT, chunk=None, shape=[64, 8192], dtype="uint16",
                                                  expected_shape=[64, 4096], expected_dtype="uint16",
                                                  manifest="manifest.json"))
def _array_meta_mismatch(shape, dtype, expected_shape, expected_dtype, manifest, part=None, array=None, dir=None,
                         chunk=None, shard_file=None):
    return (f"{_at(part, array, dir, chunk, shard_file)}: its metadata says shape {tuple(shape)} {dtype}, but the "
            f"manifest expects {tuple(expected_shape)} {expected_dtype}: the part and {manifest} disagree (a part "
            "written with other settings, or an edited manifest). Run `dflash-cache verify` and re-extract the "
            "parts it names.")


@renders("cache.chunk-decompress", example=dict(_AT, error="Error -10 while decompressing"))
def _chunk_decompress(error, part=None, array=None, dir=None, chunk=None, shard_file=None, where=None):
    return (f"{_at(part, array, dir, chunk, shard_file, where)}: "
            f"{_PART_FILE_REASONS['cache.chunk-decompress'](dict(error=error))}; the part is damaged.")


@renders("cache.chunk-size", example=dict(_AT, size=100, expected=128))
def _chunk_size(size, expected, part=None, array=None, dir=None, chunk=None, shard_file=None, where=None):
    return f"{_at(part, array, dir, chunk, shard_file, where)}: {_PART_FILE_REASONS['cache.chunk-size'](dict(size=size, expected=expected))}."


@renders("cache.part-sample-ids", example=dict(_AT, chunk=None, array="sample_ids", log="manifest.parts.jsonl"))
def _part_sample_ids(log, part=None, array=None, dir=None, chunk=None, shard_file=None):
    return (f"{_at(part, array, dir, chunk, shard_file)}: the part holds other sample ids than its commit record in "
            f"{log} lists (the part's files were replaced after it was committed). Run `dflash-cache verify` and "
            "re-extract the part.")


# -- the manifest and the commit log (cache_tools/manifest.py) ---------------------------------


_QUARANTINE_FIX = ("`dflash-cache verify --quarantine CACHE` takes it out of the cache, then rerun the dflash-extract "
                   "command that wrote the cache to extract it again.")


@renders("cache.commit-record-checksum", example=dict(where="cache/manifest.parts.jsonl, line 2"))
def _commit_record_checksum(where):
    return (f"{where}: {_PART_FILE_REASONS['cache.commit-record-checksum']({})}. The part it names cannot be "
            f"trusted: {_QUARANTINE_FIX}")


@renders("cache.commit-record-split-keys", example=dict(where="cache/manifest.parts.jsonl, line 2",
                                                       part="part-000001", keys=3, samples=4))
def _commit_record_split_keys(where, part, keys, samples):
    reason = _PART_FILE_REASONS["cache.commit-record-split-keys"](dict(part=part, keys=keys, samples=samples))
    return f"{where}: {reason}. The part cannot be trusted: {_QUARANTINE_FIX}"


@renders("cache.log-replaced", example=dict(file="cache/manifest.parts.jsonl"))
def _log_replaced(file):
    return (f"{file} was replaced while this process read the cache (`dflash-cache verify --quarantine` took parts "
            "out of it, or --force started it anew): rerun the command to read the cache as it is now.")


@renders("cache.header-no-layers", example={})
def _header_no_layers():
    return "target_layer_ids is empty: a cache must capture at least one layer."


@renders("cache.header-shard-rows", example=dict(shard_rows=100, chunk_rows=64))
def _header_shard_rows(shard_rows, chunk_rows):
    return f"shard_rows ({shard_rows}) must be a positive multiple of chunk_rows ({chunk_rows})."


@renders("cache.dir-missing", example=dict(cache="runs/cache"))
def _dir_missing(cache):
    return f"Cache directory {cache} does not exist. Check the path, or create a cache with `dflash-extract --output DIR`."


@renders("cache.no-manifest", example=dict(cache="runs/cache", manifest="manifest.json"))
def _no_manifest(cache, manifest):
    return (f"{cache} is not a dflash cache: it has no {manifest}. Point to a directory written by `dflash-extract`, "
            "or restore the manifest from a backup.")


@renders("cache.manifest-not-json", example=dict(file="cache/manifest.json", error="Expecting value: line 1"))
def _manifest_not_json(file, error):
    return (f"{file} is not valid JSON ({error}). The manifest is damaged: restore it from a backup, or re-extract "
            "into a new cache.")


@renders("cache.format-version", example=dict(file="cache/manifest.json", version=2, supported=1))
def _format_version(file, version, supported):
    return (f"{file} has format_version {version!r}; this version of dflash-pipeline reads format {supported}. Use "
            "a matching dflash-pipeline version or re-extract.")


@renders("cache.manifest-lacks-keys", example=dict(file="cache/manifest.json", missing=["hidden"]))
def _manifest_lacks_keys(file, missing):
    return (f"{file} lacks the keys {missing}: the manifest is damaged. Restore it from a backup, or re-extract into "
            "a new cache.")


_HEADER_PROBLEMS = {  # manifest.header_problem's codes
    "not-an-object": "{key} is {value}, not an object",
    "not-layer-ids": "{key} is {value}, not a list of layer numbers",
    "codec-refused": "{key}: {expected}",
    "not-positive": "{key} is {value}, not a positive integer",
    "not-a-multiple": "{key} {value} is not a multiple of hidden.chunk_rows {expected}",
    "layer-count": "{key} is {value}, but target_layer_ids names {expected} layers",
    "storage-dtype": "{key} is {value}, but the codec {expected[0]} stores {expected[1]}",
    "not-bool": "{key} is {value}, not true or false",
    "not-a-count": "{key} is {value}, not a count",
    "not-top1-dtype": "{key} is {value}, not one of {top1}",
    "not-a-share": "{key} is {value}, not a share between 0 and 1",
    "share-without-top1": "{key} is set, but extras.top1 says the cache stores no top-1",
}


@renders("cache.manifest-invalid", example=dict(file="cache/manifest.json", key="hidden.num_layers",
                                                problem="layer-count", value="3", expected=2))
def _manifest_invalid(file, key, problem, value, expected):
    top1 = ", ".join(expected) if problem == "not-top1-dtype" else None
    what = _HEADER_PROBLEMS[problem].format(key=key, value=value, expected=expected, top1=top1)
    return (f"{file} is not a valid cache manifest: {str(what).rstrip('.')}. The manifest was edited or damaged (the "
            "parts were written as the header first said): undo the edit or restore manifest.json from a backup, or "
            "re-extract into a new cache. `dflash-cache verify` cannot check parts against it.")


_WRITER = {"extraction": "this extraction", "import": "this import", "recompress": "this recompression",
           "merge": "this merge"}  # (manifest.IDENTITY_CHECK_PURPOSES)


@renders("cache.settings-differ", example=dict(cache="cache", purpose="extraction",
                                              differences=[["target_layer_ids", "[1, 3]", "[2, 4]"]], more=False,
                                              target_paths=None))
def _settings_differ(cache, purpose, differences, more, target_paths):
    what = _WRITER[purpose]
    shown = "; ".join(f"{key}: cache has {found}, requested {want}" for key, found, want in differences)
    shown += "; ..." if more else ""
    if target_paths:
        shown += f" (the cache's target was {target_paths[0]}, {what}'s is {target_paths[1]})"
    return (f"The cache at {cache} was written with other settings than {what}: {shown}. Rerun with the "
            "cache's settings, choose a new output directory, or pass --force to start the cache anew.")


# -- the target's weights (cache_tools/identity.py) --------------------------------------------


@renders("cache.target-weights-differ", example=dict(cache="runs/cache", target="models/qwen3",
                                                     cache_hash="0123456789ab", target_hash="ba9876543210"))
def _target_weights_differ(cache, target, cache_hash, target_hash):
    return (f"The cache at {cache} has other weights (sha256 {cache_hash}) than the target model at {target} (sha256 "
            f"{target_hash}), with the same config: the hidden states and the model they are used with come from "
            "different checkpoints of it.")


_RECORDED_BY = {"cache": "The cache at {path}", "checkpoint": "The checkpoint {path}"}


@renders("cache.target-weights-unrecorded", example=dict(purpose="checkpoint", path="runs/a/checkpoints/step-100"))
def _target_weights_unrecorded(purpose, path):
    return (f"{_RECORDED_BY[purpose].format(path=path)} records no hash of its target's weights (older or imported): "
            "not checked against this target.")


# -- codecs (cache_tools/codecs.py) ------------------------------------------------------------


@renders("cache.codec-name", example=dict(codec_class="Fp8Codec", named="fp8", name="bf16"))
def _codec_name(codec_class, named, name):
    return f"The {codec_class} codec is named {named!r}, not {name!r}."


@renders("cache.codec-level", example=dict(clevel=30))
def _codec_level(clevel):
    return f"Codec level {clevel} is out of range: zstd takes 0..22."


@renders("cache.codec-blocksize", example=dict(blocksize=-1))
def _codec_blocksize(blocksize):
    return f"Blosc block size {blocksize} must be 0 (automatic) or a positive byte count."


@renders("cache.codec-parameters", example=dict(unknown=["zstd_window"]))
def _codec_parameters(unknown):
    return f"Unknown codec parameters {unknown} in the manifest."


@renders("cache.codec-unknown", example=dict(name="bf8", choices=[["bf16", "lossless"], ["raw", ""]]))
def _codec_unknown(name, choices):
    shown = "; ".join(f"{n} ({summary})" if summary else n for n, summary in choices)
    return f"Unknown codec {name!r}: choose one of {shown}."


@renders("cache.codec-nf4-width", example=dict(group=32, width=100))
def _codec_nf4_width(group, width):
    return f"The nf4 codec needs hidden widths that are multiples of {group}; this one has {width}. Use fp8 or bf16 for this target."


# -- target layer ids (cache_tools/layers.py) --------------------------------------------------

ENGINE_CONSTRAINT = ("The serving engines (vLLM, SGLang) capture target layers in ascending order and cannot "
                     "capture the last one, so ids must be strictly increasing, unique and at most N-2 for an "
                     "N-layer target")


def layer_example(n, k):
    """A valid id list for a message: up to k evenly spread ids in [0, N-2]."""
    top = n - 2
    if top < 0:
        return "none: use a target with at least 2 layers"
    k = max(1, min(k, top + 1))
    if k == 1:
        return str(top // 2)
    return ",".join(str(round(i * top / (k - 1))) for i in range(k))


def _numbering(source, offset):
    return f" ({source} numbers our layer id l as l + {offset})" if offset else ""


def _of(purpose, cache=None, source=None, source_ids=None, offset=0):
    """Whose ids (cache_tools.layers.PURPOSES)."""
    return {None: "", "extract": " of this extraction", "flag": " of --target-layer-ids",
            "cache": f" of the cache at {cache}",
            "source-flag": f" of --source-layer-ids {source_ids}{_numbering(source, offset)}"}[purpose]


def _layer_ids_fix(purpose, source, offset):
    if purpose == "cache":
        return "Re-extract the cache with --target-layer-ids such ids"
    if purpose == "source-flag":
        return f"Pass --source-layer-ids with the ids {source} captured{_numbering(source, offset)}"
    return "Pass --target-layer-ids with such ids"


@renders("cache.layer-ids-not-integers", example=dict(ids="['1', 'x']", purpose="flag"))
def _layer_ids_not_integers(ids, purpose, cache=None, source=None, source_ids=None, offset=0):
    return f"target_layer_ids {ids}{_of(purpose, cache, source, source_ids, offset)} are not integers."


_LAYERS = dict(ids=[1, 5], layers=6, purpose="cache", cache="runs/cache",
               empty=False, too_shallow=False, repeated=[], unordered=False, negative=[], above=[5])


@renders("cache.layer-ids-unusable", example=_LAYERS)
def _layer_ids_unusable(ids, layers, purpose, empty, too_shallow, repeated, unordered, negative, above, cache=None,
                        source=None, source_ids=None, offset=0):
    n = layers
    problems = (["the list is empty"] * bool(empty)
                + [f"a {n}-layer target has no layer a drafter can read (N-2 < 0)"] * bool(too_shallow)
                + [f"{repeated} appear more than once"] * bool(repeated)
                + ["they are not in ascending order"] * bool(unordered)
                + [f"{negative} are negative"] * bool(negative)
                + [f"{above} are above N-2 = {n - 2 if n is not None else '?'} for this {n}-layer target"] * bool(above))
    example = layer_example(n, len(ids)) if n is not None else "1,9,17,25,33"
    return (f"target_layer_ids {ids}{_of(purpose, cache, source, source_ids, offset)} cannot be used: "
            f"{'; '.join(problems)}. {ENGINE_CONSTRAINT}. {_layer_ids_fix(purpose, source, offset)} (e.g. {example}).")


@renders("cache.layer-count-invalid", example=dict(count=0, layers=36))
def _layer_count_invalid(count, layers):
    return (f"Cannot pick {count} target layers from a {layers}-layer target: num_draft_layers (K) and the "
            "target's layer count must both be at least 1.")


@renders("cache.layer-rule-too-shallow", example=dict(count=5, layers=6))
def _layer_rule_too_shallow(count, layers):
    k, n = count, layers
    most = max(n - 3, 1 if n >= 3 else 0)
    return (f"The default layer rule cannot pick {k} distinct target layer(s) from a {n}-layer target: it needs at "
            f"least {k + 3 if k > 1 else 3} layers, and repeating ids would give a drafter the engines cannot serve. "
            f"Pass target_layer_ids explicitly (--target-layer-ids: strictly increasing, at most N-2 = {n - 2}, e.g. "
            f"{layer_example(n, k)})" + (f", or ask for fewer layers (at most {most} with this rule)." if most >= 1 else "."))


# -- caches used together (cache_tools/cache_set.py, rewrite.py) -------------------------------


@renders("cache.same-data", example=dict(first="runs/a", second="runs/b", sha256="0123456789abcdef", use="train"))
def _same_data(first, second, sha256, use):
    what = "the merged cache" if use == "merge" else "training on them together"
    return (f"{first} and {second} hold the same samples: both were extracted from the same data (sha256 "
            f"{sha256[:12]}), so {what} would hold each of them twice (one is a copy, a recompressed copy or a "
            "second extraction of the other). Give one of them.")


@renders("cache.not-trainable-together", example=dict(first="runs/a", second="runs/b",
                                                      differences=[["target_layer_ids", "[1, 2]", "[0, 2]"]]))
def _not_trainable_together(first, second, differences):
    shown = "; ".join(f"{key}: second has {b}, first has {a}" for key, a, b in differences)
    return (f"The caches {first} (first) and {second} (second) cannot be trained on together: {shown}. Train on "
            "caches extracted from the same target model with the same layers.")


@renders("cache.destination-is-source", example=dict(dst="runs/c", src=None))
def _destination_is_source(dst, src):
    return f"The destination {dst} is also a source{f' ({src})' if src else ''}: write into a new directory."


@renders("cache.source-twice", example=dict(src="runs/a", also="runs/link-to-a"))
def _source_twice(src, also):
    return (f"The source cache {src} is given twice{f' (as {also} too)' if also else ''}: merging it with itself "
            "would hold every sample twice. Name each cache once.")


@renders("cache.merge-no-source", example={})
def _merge_no_source():
    return "merge needs at least one source cache."


@renders("cache.merge-source-missing", example=dict(missing="Cache directory runs/new does not exist.",
                                                    dst="runs/merged"))
def _merge_source_missing(missing, dst):
    return (f"{missing} Note that merge takes the new cache first (`dflash-cache merge DST SRC...`), and the first "
            f"argument, {dst}, is an existing cache: if it is meant as a source, name the new cache first.")


@renders("cache.merge-unfinished", example=dict(cache="runs/a", **_PROGRESS))
def _merge_unfinished(cache, committed, planned, committed_samples, planned_samples):
    return (f"Cannot merge {cache}: it is not a finished cache "
            f"({progress(committed, planned, committed_samples, planned_samples)}): its extraction was stopped "
            "before its end, is still running, or lost a rank. Rerun the same dflash-extract command to finish it, "
            "then merge.")


@renders("cache.merge-settings-differ", example=dict(cache="runs/b", first="runs/a",
                                                     differences=[["hidden.codec.name", "'bf16'", "'fp8'"]], more=False))
def _merge_settings_differ(cache, first, differences, more):
    shown = "; ".join(f"{key} ({a} in {first}, {b} in {cache})" for key, a, b in differences)
    return (f"Cannot merge {cache} with {first}: they differ in {shown}{'; ...' if more else ''}. Only caches of "
            "the same target model, target_layer_ids, codec and extraction settings can be merged; recompress one "
            "of them (for a codec difference) or train from them separately.")


# -- disk budgets and evictions (cache_tools/eviction.py, staging.py) --------------------------


_EVICTED_COMMAND = {"train": "Training on it without --follow"}


@renders("cache.parts-evicted", example=dict(cache="runs/cache", parts=3, first="part-000000",
                                             file="manifest.evicted.jsonl", command="recompress"))
def _parts_evicted(cache, parts, first, file, command):
    also = ("; the training run that followed the extraction resumes with --follow in its --output-dir"
            if command == "train" else "")
    return (f"{parts} part(s) of {cache} are evicted under a disk budget ({first} first; {file}): their files were "
            "deleted once training had read them, and only an extraction's later --follow-epochs pass writes them "
            f"again. {_EVICTED_COMMAND.get(command, command)} reads every part: rerun the dflash-extract command on "
            "the cache without --disk-budget, with room for all of it: it restores them (checked against the "
            f"evicted copies){also}.")


@renders("cache.eviction-record-damaged", example=dict(where="runs/cache/manifest.evicted.jsonl, line 3"))
def _eviction_record_damaged(where):
    return (f"{where}: the eviction record is damaged (checksum mismatch). Run `dflash-cache verify` on the cache; a "
            "part whose state is unknown must be re-extracted.")


@renders("cache.reextraction-differs", example=dict(part="part-000003", cache="runs/cache", epoch=1,
                                                    sha256="0123456789abcdef", nbytes=1000,
                                                    evicted_sha256="fedcba9876543210", evicted_nbytes=1000))
def _reextraction_differs(part, cache, epoch, sha256, nbytes, evicted_sha256, evicted_nbytes):
    return (f"cache part {part!r} at {cache}: its re-extraction gave other bytes than the copy evicted after epoch "
            f"{epoch} (sha256 {sha256[:12]}.. of {nbytes} bytes, evicted {evicted_sha256[:12]}.. of "
            f"{evicted_nbytes}). A part's bytes follow from the data, the cache's identity and the extraction's "
            "batching: rerun dflash-extract with the first run's --token-budget, dtype, attention implementation and "
            "device kind (and the same torch), or start the cache anew with --force.")


@renders("cache.budget-file-damaged", example=dict(file="runs/cache/manifest.budget.json", error="'budget'"))
def _budget_file_damaged(file, error):
    return f"{file} is damaged ({error}): rerun the dflash-extract command on the cache to write it again."


@renders("cache.size-invalid", example=dict(value="12Q"))
def _size_invalid(value):
    return (f"Disk size {value!r} is not a size: write a number with an optional unit, e.g. 500G, 1.5T, 800MB or "
            "2TiB (K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB of 1000).")


# -- a followed cache (cache_tools/followed.py) ------------------------------------------------


def _follow(cache):
    return f"dflash-train --follow --cache {cache}"


@renders("cache.follow-not-a-directory", example=dict(cache="data/train.jsonl"))
def _follow_not_a_directory(cache):
    return (f"{_follow(cache)}: {cache} is a file, not a cache directory. Pass the directory that dflash-extract "
            "--output names.")


@renders("cache.follow-foreign-directory", example=dict(cache="data", files=["train.jsonl"], header="manifest.json"))
def _follow_foreign_directory(cache, files, header):
    return (f"{_follow(cache)}: {cache} holds files ({', '.join(files)}) but no cache ({header}), and dflash-extract "
            "does not write a cache into such a directory. Check the path: pass the directory that dflash-extract "
            "--output names.")


@renders("cache.follow-no-extraction", example=dict(cache="runs/cahce", seconds=600, missing=None))
def _follow_no_extraction(cache, seconds, missing):
    return (f"{_follow(cache)}: no extraction has begun at {cache} in {seconds} s "
            f"({f'no {missing}' if missing else 'no such directory'}). Check the path, or start dflash-extract "
            "--output on it first, then this run.")


@renders("cache.follow-no-plan", example=dict(cache="runs/cache", parts=5, plan="manifest.plan.json"))
def _follow_no_plan(cache, parts, plan):
    return (f"{_follow(cache)}: the cache holds {parts} committed part(s) but no extraction plan ({plan}) and no "
            "extraction is writing it, so no plan will come: it was written by an earlier version, or its extraction "
            "stopped at a bad record (no plan is written for such input). Train on it without --follow.")


_PLAN_WAIT = {
    "no-directory": "no cache there yet (no such directory): dflash-extract creates it once its target is loaded. "
                    "Refused if no extraction has begun there within {limit} s (a mistyped path?)",
    "no-header": "no cache there yet (no {header}): dflash-extract creates it once its target is loaded. Refused if "
                 "no extraction has begun there within {limit} s (a mistyped path?)",
    "stopped": "no extraction is writing the cache now (it stopped before writing its plan): rerun the dflash-extract "
               "command that started it; it writes the plan first",
    "starting": "dflash-extract is starting the cache and writes the plan before any part",
}


@renders("cache.follow-waiting-for-plan", example=dict(cache="runs/cache", plan="manifest.plan.json", since="12:00:00",
                                                       waited=30, state="no-header", header="manifest.json", limit=600))
def _follow_waiting_for_plan(cache, plan, since, waited, state, header, limit):
    return (f"--follow: waiting for the extraction plan of {cache} ({plan}) since {since} ({waited} s): "
            + _PLAN_WAIT[state].format(header=header, limit=limit))


@renders("cache.follow-waiting-for-part", example=dict(part="part-000002", cache="runs/cache", waited=30, committed=1,
                                                       planned=8, running=True))
def _follow_waiting_for_part(part, cache, waited, committed, planned, running):
    ends = ("dflash-extract commits it" if running else
            "no extraction on this host writes the cache now: rerun dflash-extract to resume it")
    return (f"--follow: waiting {waited} s for part {part} of {cache} ({committed} of {planned} planned parts "
            f"committed so far; {ends})")


@renders("cache.follow-waiting-for-evicted", example=dict(part="part-000002", cache="runs/cache", waited=30, epoch=1,
                                                          reextract=False))
def _follow_waiting_for_evicted(part, cache, waited, epoch, reextract):
    again = ("dflash-extract extracts it again for this epoch" if reextract else
             "the extraction that evicted it does not extract it again: rerun dflash-extract on the cache "
             "with --disk-budget and --follow-epochs of at least this run's --epochs")
    return (f"--follow: waiting {waited} s for part {part} of {cache}: it was evicted under the disk budget after "
            f"epoch {epoch}; {again}")


@renders("cache.follow-sample-id", example=dict(part="part-000002", cache="runs/cache", sample=3, stored=17,
                                                planned=18))
def _follow_sample_id(part, cache, sample, stored, planned):
    return (f"cache part {part!r} at {cache}: sample {sample} has id {stored}, the extraction plan says {planned}. "
            "The part does not match the plan: run `dflash-cache verify` and re-extract it.")


@renders("cache.follow-part-not-planned", example=dict(part="part-000002", cache="runs/cache",
                                                       plan="manifest.plan.json"))
def _follow_part_not_planned(part, cache, plan):
    return (f"cache part {part!r} at {cache}: its commit record lists other samples than the extraction plan "
            f"({plan}). The cache was written with another plan: start it anew with dflash-extract --force, or "
            "train on it without --follow.")


@renders("cache.follow-evicted-for-another-run", example=dict(part="part-000000", cache="runs/cache", epoch=1,
                                                              reading=0, reports="trained-*.json"))
def _follow_evicted_for_another_run(part, cache, epoch, reading, reports):
    return (f"cache part {part!r} of {cache} was evicted under the disk budget after epoch {epoch}, once every "
            f"consumption report ({reports}) said it had been trained on then, but this run reads it for epoch "
            f"{reading}: those reports are another training run's (a second run following the cache, or an earlier "
            "one; or this run's later checkpoints were deleted). Only one training run can follow a cache extracted "
            "under --disk-budget. Resume the run that trained on it (its --output-dir), or give this run a cache of "
            "its own (dflash-extract --output NEW with the same settings).")


# -- the dflash-cache command (cache_tools/cli.py) ---------------------------------------------


@renders("cache.quarantine-remote", example=dict(url="s3://bucket/cache", flag="--quarantine"))
def _quarantine_remote(url, flag):
    return (f"{flag}: a remote cache ({url}) is repaired by uploading its parts again from a sound local copy: "
            "quarantine works on local caches.")


@renders("cache.stopped", example=dict(command="dflash-cache", signal="SIGINT"))
def _stopped(command, signal):
    return f"{command} stopped by {signal}; committed parts are kept (recompress, merge and import resume when rerun)."


# -- dflash-cache verify (cache_tools/maintenance.py, quarantine.py) ---------------------------
# A problem's finding renders its reason; the line verify prints puts the part, the array and
# `verify_location` (the finding's chunk, rows, shard_file, file or line) before it.


def verify_location(chunk=None, rows=None, shard_file=None, file=None, line=None):
    """Where inside a part: "chunk 3 (rows 384-511) in shard file hidden/c/0/0", "file X", ..."""
    if line is not None:
        return f"{file} line {line}"
    if chunk is not None:
        return f"chunk {chunk} (rows {rows[0]}-{rows[1]}) in shard file {shard_file}"
    if shard_file is not None:
        return f"shard file {shard_file}"
    return f"file {file}" if file is not None else ""


_CHUNK = dict(chunk=3, rows=[384, 511], shard_file="hidden/c/0/0")


@renders("cache.verify-unreadable", example=dict(_CHUNK, error="checksum mismatch"))
def _verify_unreadable(error, chunk=None, rows=None, shard_file=None, file=None):
    return part_file_reason(error) + "."


@renders("cache.verify-commit-line", example=dict(file="manifest.parts.jsonl", line=3, error="'name'"))
def _verify_commit_line(file, line, error):
    return part_file_reason(error) + "."


@renders("cache.verify-metadata-shape", example=dict(shape=[64, 128], dtype="uint16", expected_shape=[64, 64],
                                                     expected_dtype="uint16"))
def _verify_metadata_shape(shape, dtype, expected_shape, expected_dtype):
    return f"its metadata says shape {tuple(shape)} {dtype}, expected {tuple(expected_shape)} {expected_dtype} from the manifest."


@renders("cache.verify-metadata-chunks", example=dict(chunk_rows=64, shard_rows=1024, expected_chunk_rows=128,
                                                      expected_shard_rows=8192))
def _verify_metadata_chunks(chunk_rows, shard_rows, expected_chunk_rows, expected_shard_rows):
    return (f"its metadata has chunks of {chunk_rows} rows in shards of {shard_rows}, the manifest says "
            f"{expected_chunk_rows} and {expected_shard_rows}.")


@renders("cache.verify-file-missing", example=dict(file="sample_ids/c/0"))
def _verify_file_missing(file):
    return "missing or empty."


@renders("cache.verify-shard-index", example=dict(shard_file="hidden/c/0/0"))
def _verify_shard_index(shard_file):
    return "the shard index fails its checksum: the file is truncated or corrupt."


@renders("cache.verify-chunks-not-indexed", example=dict(shard_file="hidden/c/0/0", chunks=[5, 6]))
def _verify_chunks_not_indexed(shard_file, chunks):
    return f"chunks {chunks} are missing from the shard index."


@renders("cache.verify-values-not-finite", example=dict(_CHUNK, values=12))
def _verify_values_not_finite(values, chunk, rows, shard_file):
    return f"{values} values are NaN or infinite."


@renders("cache.verify-offsets", example=dict(log="manifest.parts.jsonl"))
def _verify_offsets(log):
    return f"sample offsets disagree with the sample lengths in the commit log ({log})."


@renders("cache.verify-sample-ids-repeated", example=dict(ids=[17, 18]))
def _verify_sample_ids_repeated(ids):
    return f"sample ids {ids} appear more than once."


@renders("cache.verify-token-ids", example=dict(count=2, vocab_size=151936, row=40, token=151940))
def _verify_token_ids(count, vocab_size, row, token):
    return f"{count} token ids are outside the vocabulary [0, {vocab_size}) (first at token row {row}: {token})."


@renders("cache.verify-loss-mask", example={})
def _verify_loss_mask():
    return "loss_mask holds values other than 0 and 1."


@renders("cache.verify-split-keys", example=dict(samples=2, first=5))
def _verify_split_keys(samples, first):
    return (f"the commit record's split keys of {samples} samples (first: sample {first}) are not the hashes of "
            "their prompts as the part stores them (edited).")


@renders("cache.verify-scales", example={})
def _verify_scales():
    return "scales are negative, NaN or infinite."


@renders("cache.verify-part-missing", example=dict(dir="cache/parts/part-000001"))
def _verify_part_missing(dir):
    return f"the part directory {dir} is missing."


@renders("cache.verify-record-counts", example={})
def _verify_record_counts():
    return "the commit record's sample and token counts disagree with its sample lengths."


@renders("cache.verify-part-size", example=dict(size=1000, nbytes=1200))
def _verify_part_size(size, nbytes):
    return f"{size} bytes on disk, the commit record says {nbytes} (a file was truncated, extended or replaced)."


@renders("cache.verify-log-torn", example=dict(file="manifest.parts.jsonl"))
def _verify_log_torn(file):
    return f"{file} ends with a torn line (a writer died mid-commit); it is not a commit."


@renders("cache.verify-unfinished", example=_PROGRESS)
def _verify_unfinished(committed, planned, committed_samples, planned_samples):
    return (f"the extraction has not finished: {progress(committed, planned, committed_samples, planned_samples)} "
            "(stopped before its end, still running, or a rank lost). Rerun its dflash-extract command to finish it; "
            "dflash-train refuses the cache until then (or with --allow-incomplete trains on what is there).")


@renders("cache.verify-parts-evicted", example=dict(parts=["part-000000", "part-000001"], nbytes=4096,
                                                    file="manifest.evicted.jsonl"))
def _verify_parts_evicted(parts, nbytes, file):
    names = ", ".join(parts[:3]) + (", ..." if len(parts) > 3 else "")
    return (f"{len(parts)} parts ({names}; {nbytes} bytes) are evicted under a disk budget ({file}): their files were "
            "deleted once training had read them, so they are not checked. An extraction's later --follow-epochs pass "
            "writes them again; until then a training run without --follow and the maintenance verbs refuse the cache.")


@renders("cache.verify-uncommitted", example=dict(entries=2, dir="parts"))
def _verify_uncommitted(entries, dir):
    return (f"{entries} entries in {dir}/ are not committed (readers ignore them; `dflash-cache prune` removes those "
            "no live writer owns).")


@renders("cache.quarantine-every-part", example=dict(cache="runs/cache", parts=3, part="part-000000", array="hidden",
                                                   problem="checksum mismatch"))
def _quarantine_every_part(cache, parts, part, array, problem):
    fields = getattr(problem, "fields", {})
    where = verify_location(**{k: fields.get(k) for k in ("chunk", "rows", "shard_file", "file", "line")})
    first = " ".join(x for x in (part, array, where) if x) + f": {str(problem).rstrip('.')}"
    return (f"Every one of the {parts} parts of {cache} is reported damaged (the first: {first}). That is more likely "
            "a manifest.json that no longer matches its parts (edited by hand, or another cache's) than that many "
            "damaged parts, and quarantining them all would empty the cache: nothing was moved. Compare manifest.json "
            "with the parts' own metadata (zarr.json) and put it back; if every part really is damaged, extract the "
            "cache anew (dflash-extract --force).")


# -- imports' notes (cache_tools/importers.py) -------------------------------------------------


@renders("cache.import-rows-without-file", example=dict(missing=1, rows=10, src="spec/hidden_states"))
def _import_rows_without_file(missing, rows, src):
    return (f"{missing:,} of the dataset's {rows:,} rows have no hidden-state file in {src} (not generated: "
            "--max-samples, or requests that failed): they are not imported.")


# -- dflash-cache verify of a remote cache (cache_tools/remote_upload.py) ----------------------


@renders("cache.verify-remote-not-indexed", example=dict(part="part-000003", index="files.jsonl"))
def _verify_remote_not_indexed(part, index):
    return f"part {part}: not in {index} (an incomplete upload: upload again)"


@renders("cache.verify-remote-missing", example=dict(part="part-000003", object="parts/part-000003/hidden/c/0/0"))
def _verify_remote_missing(part, object):
    return f"part {part}: {object} is missing"


@renders("cache.verify-remote-size", example=dict(part="part-000003", object="parts/part-000003/hidden/c/0/0",
                                                  size=100, indexed_size=128))
def _verify_remote_size(part, object, size, indexed_size):
    return f"part {part}: {object} has {size} bytes, the index says {indexed_size}"


@renders("cache.verify-remote-crc", example=dict(part="part-000003", object="parts/part-000003/hidden/c/0/0"))
def _verify_remote_crc(part, object):
    return f"part {part}: {object} does not match its crc32c (the object is corrupt)"


@renders("cache.verify-remote-part-size", example=dict(part="part-000003", indexed=1000, nbytes=1200))
def _verify_remote_part_size(part, indexed, nbytes):
    return f"part {part}: its files hold {indexed} bytes, the commit log says {nbytes}"
