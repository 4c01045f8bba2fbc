"""What dflash.extract tells its user: one renderer per finding code (`dflash.runtime.findings`).

Each renderer takes a finding's fields and returns one paragraph: what was wrong, where (file,
sample, part, flag) and what to do. Code states findings; the words live here.
"""

from __future__ import annotations

import math
import time

from dflash.cache_tools.staging import format_size
from dflash.runtime.findings import renders


def _s(n: int) -> str:
    return "s" if n != 1 else ""


def _listed(names: list[str], limit: int, sep: str = ", ") -> str:
    return sep.join(names[:limit]) + (f"{sep if sep == '; ' else ' '}and {len(names) - limit} more"
                                      if len(names) > limit else "")


def size_at_least(nbytes: int) -> str:
    """A size --disk-budget reads as `nbytes` or a little more ("2.7MiB")."""
    for unit, step in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= step:
            return f"{math.ceil(nbytes * 10 / step) / 10:g}{unit}"
    return str(int(nbytes))


# -- settings --------------------------------------------------------------------------------

@renders("extract.flag-required", example=dict(flag="--data"))
def _flag_required(flag):
    return f"{flag} is required."


@renders("extract.flag-choice", example=dict(flag="--codec", value="fp4", choices=["bf16", "fp8", "nf4", "raw"]))
def _flag_choice(flag, value, choices):
    return f"{flag} {value!r} is not one of {', '.join(choices)}."


@renders("extract.flag-below-minimum", example=dict(flag="--part-tokens", value=0, minimum=1))
def _flag_below_minimum(flag, value, minimum):
    return f"{flag} must be at least 1 (got {value})." if minimum == 1 else f"{flag} must be 0 or more (got {value})."


@renders("extract.top1-share-range", example=dict(flag="--top1-share", value=1.5))
def _top1_share_range(flag, value):
    return (f"{flag} must be between 0 and 1 (got {value}): the share of samples whose target top-1 is stored, "
            "1 for all of them, 0 for none.")


@renders("extract.disk-budget-not-positive", example=dict(flag="--disk-budget", value="0"))
def _disk_budget_not_positive(flag, value):
    return f"{flag} must be a positive size such as 500G (got {value!r})."


@renders("extract.follow-epochs-without-budget", example=dict(flag="--follow-epochs", needs="--disk-budget"))
def _follow_epochs_without_budget(flag, needs):
    return (f"{flag} extracts again what a {needs} evicted: give {needs} too (without a budget nothing is "
            "evicted and one extraction serves every epoch).")


@renders("extract.rank-out-of-range", example=dict(rank=2, world_size=2))
def _rank_out_of_range(rank, world_size):
    return (f"Rank {rank} of world size {world_size} is invalid: need 0 <= rank < world_size (set "
            "--rank/--world-size or RANK/WORLD_SIZE).")


# -- input data ------------------------------------------------------------------------------

@renders("extract.data-missing", example=dict(file="data.jsonl"))
def _data_missing(file):
    return f"Input data {file} does not exist. Pass a JSONL file or a directory of them with --data."


@renders("extract.data-not-json-lines", example=dict(file="d/stats.json", what="one JSON document spanning 4 lines",
                                                     in_scan=True))
def _data_not_json_lines(file, what, in_scan):
    fix = "Move it out of --data, or " if in_scan else "Point --data to the data file (or its directory), or "
    return (f"{file} is not JSON Lines of records: {what}. --data takes tokenized records, one JSON object a line "
            f"(input_ids and a loss mask: docs/extract.md). {fix}convert it to JSON Lines (for an array of "
            f"records: jq -c '.[]' {file}).")


def _documents_note(dir, documents) -> str:
    n = len(documents)
    listed = _listed([f"{name}, {what}" for name, what in documents], 8, "; ")
    return (f"the scan of {dir} left out {n} .json file{_s(n)} that {'are' if n > 1 else 'is'} not JSON Lines of "
            f"records: {listed}. A .json file of one record a line (as Dataset.to_json writes) is read; convert "
            "one of these to JSON Lines if it is data.")


@renders("extract.data-no-files", example=dict(dir="d", documents=[["stats.json", "one JSON document"]]))
def _data_no_files(dir, documents):
    return (f"Input directory {dir} holds no data files (*.jsonl or *.jsonl.gz, or *.json of one record a line). "
            "Point --data to the directory with the tokenized completions."
            + (f" Note: {_documents_note(dir, documents)}" if documents else ""))


@renders("extract.data-json-documents-left-out", example=dict(dir="d", documents=[["config.json", "one JSON document"]]))
def _data_json_documents_left_out(dir, documents):
    return _documents_note(dir, documents)


@renders("extract.data-files-skipped", example=dict(dir="d", files=["a.JSONL", "b.bz2"],
                                                    suffixes=[".jsonl", ".jsonl.gz", ".json.gz", ".json"]))
def _data_files_skipped(dir, files, suffixes):
    cased = [n for n in files if n.lower().endswith(tuple(suffixes))]
    return (f"the scan of {dir} reads only {', '.join('*' + s for s in suffixes)} (lower case) and skipped "
            f"{len(files)} other file{_s(len(files))}: {_listed(files, 8)}."
            + (f" Rename {cased[0]}{' and the like' if len(cased) > 1 else ''} with a lower-case suffix to read it."
               if cased else "")
            + " Decompress or convert the others to JSONL (or .jsonl.gz) if they are data.")


@renders("extract.data-paths-repeated", example=dict(dir="d", paths=["latest"]))
def _data_paths_repeated(dir, paths):
    return (f"the scan of {dir} reached {len(paths)} path{_s(len(paths))} through symbolic links that lead to data "
            f"it had already read ({_listed(paths, 4)}), and read that data once.")


@renders("extract.data-unreadable", example=dict(file="d.jsonl.gz", error="Compressed file ended early"))
def _data_unreadable(file, error):
    return f"{file}: cannot read the file ({error}). Check that it is complete and readable."


@renders("extract.data-changed-during-run", example=dict(file="d.jsonl", bytes_now=2048, bytes_at_start=1024,
                                                         bytes_read=1024))
def _data_changed_during_run(file, bytes_now, bytes_at_start, bytes_read):
    what = "is gone" if bytes_now is None else f"is now {bytes_now:,} bytes"
    return (f"{file} changed during the extraction (it {what}; {bytes_at_start:,} when the run started): the cache "
            f"holds its first {bytes_read:,} bytes, as read and as its manifest's fingerprint records; what changed "
            "later is not in it. Pass --force (or choose a new --output) to extract the file as it is now.")


@renders("extract.data-grown", example=dict(file="d.jsonl", grown=100, bytes_read=1024))
def _data_grown(file, grown, bytes_read):
    return (f"{file} has grown by {grown:,} bytes since the cache was started: this run reads its first "
            f"{bytes_read:,} bytes, as the cache's manifest fingerprints; the lines added since are not extracted "
            "(pass --force, or choose a new --output, to extract the file as it is now).")


def _change(c: dict) -> str:
    file, change = c["file"], c["change"]
    if change == "added":
        return f"{file} is not among the files the cache was extracted from"
    if change == "edited":
        return (f"{file} changed since the cache was extracted from it (its first {c['bytes']:,} bytes differ from "
                "the ones fingerprinted then)")
    if change == "left-out":
        return (f"{file} was extracted into the cache, but the scan of --data leaves it out as not JSON Lines of "
                f"records ({c['what']})")
    return f"{file} was extracted into the cache but is no longer in --data"


@renders("extract.data-differs", example=dict(changes=[{"file": "d/b.jsonl", "change": "gone"},
                                                       {"file": "d/a.jsonl", "change": "edited", "bytes": 10}]))
def _data_differs(changes):
    return ("The input data differs from the data the cache was extracted from: "
            + "; ".join(_change(c) for c in changes[:5]) + ("; ..." if len(changes) > 5 else "")
            + ". Restore the data, pass --force to extract the cache anew, or choose a new --output.")


@renders("extract.bad-record", example=dict(where="d.jsonl, line 3", problem="input_ids is empty"))
def _bad_record(where, problem):
    return f"{where}: {problem}. Fix the record or pass --skip-bad to skip it."


@renders("extract.no-usable-sample", example=dict(files=["d.jsonl"], count=1, skipped=4))
def _no_usable_sample(files, count, skipped):
    return (f"The input ({', '.join(files)}{', ...' if count > len(files) else ''}) holds no usable sample"
            + (f" ({skipped} records, all skipped)." if skipped else ".") + " Check --data.")


# -- the target ------------------------------------------------------------------------------

@renders("extract.target-without-config", example=dict(dir="models/target"))
def _target_without_config(dir):
    return (f"{dir} is not a Hugging Face model directory (no config.json). Point --target-model to a local "
            "directory holding config.json and the weights.")


@renders("extract.target-without-weights", example=dict(dir="models/target"))
def _target_without_weights(dir):
    return (f"{dir} has a config.json but no weights (*.safetensors). Download or copy the model's weight files "
            "into that directory.")


@renders("extract.target-unloadable", example=dict(dir="models/target", error="unknown model type"))
def _target_unloadable(dir, error):
    return f"Cannot load the target model from {dir}: {error}"


@renders("extract.target-without-layers", example=dict(architecture="GPT2LMHeadModel"))
def _target_without_layers(architecture):
    return (f"The target ({architecture}) does not expose its decoder layers as model.model.layers, which layer "
            "capture needs. Supported are HF decoder-only causal LMs such as Llama, Qwen2/3 and Mistral.")


@renders("extract.forward-ended-early", example=dict(architecture="LlamaForCausalLM"))
def _forward_ended_early(architecture):
    return f"The forward of the target ({architecture}) ended without reaching the last captured layer."


@renders("extract.target-without-head", example=dict(flag="--store-topk", architecture="LlamaModel"))
def _target_without_head(flag, architecture):
    what = "--store-topk" if flag == "--store-topk" else "Storing the target's top-1"
    fix = "" if flag == "--store-topk" else ": pass --no-store-top1"
    return (f"{what} needs the target's final norm (model.model.norm) and lm_head; this model ({architecture}) "
            f"lacks one of them{fix}.")


@renders("extract.target-positions-unknown", example=dict(flag="--max-seq-len", value=8192))
def _target_positions_unknown(flag, value):
    return (f"the target's config gives no number of positions (max_position_embeddings): samples were held to "
            f"{flag} {value} alone; if the target takes fewer, pass that as {flag}.")


@renders("extract.samples-past-positions", example=dict(
    samples=2, positions="the target's 16 positions (max_position_embeddings 16 of its config)", limit=16,
    long_samples="truncate", max_seq_len=8192))
def _samples_past_positions(samples, positions, limit, long_samples, max_seq_len):
    many = samples > 1
    done = (f"cut to {'their' if many else 'its'} first {limit:,} tokens (--long-samples skip leaves such samples "
            "out instead)" if long_samples == "truncate" else "skipped")
    return (f"{samples} sample{_s(samples)} longer than {positions} {'were' if many else 'was'} {done}: past them "
            f"the target's hidden states are out of the range it was trained on (--max-seq-len {max_seq_len} is "
            "more than it takes).")


@renders("extract.cache-past-positions", example=dict(
    cache="cache", max_seq_len=8192, positions="the target's 16 positions (max_position_embeddings 16 of its config)",
    limit=16))
def _cache_past_positions(cache, max_seq_len, positions, limit):
    return (f"The cache at {cache} was extracted with max_seq_len {max_seq_len}, more than {positions}: its samples "
            f"longer than {limit:,} tokens may hold hidden states past the target's positions, and an extraction "
            "holds samples to them (--long-samples), which cuts the remaining parts otherwise. Pass --force to "
            "extract the cache anew, or choose a new --output.")


@renders("extract.runs-unfused", example=dict(part="quantization", error="BackendCompilerFailed: no triton"))
def _runs_unfused(part, error):
    what = ("hidden-state quantization runs unfused" if part == "quantization"
            else "the target's top-k log-probs are reduced unfused")
    return f"{what} ({error})"


# -- writing parts -------------------------------------------------------------------------

@renders("extract.writers-died", example=dict(parts=3))
def _writers_died(parts):
    return ("All writer processes died (out of memory?) with parts still to write. Rerun the same command to "
            "resume; lower --num-writers or --part-tokens if memory is short.")


@renders("extract.shared-memory-short", example=dict(dir="/dev/shm", free=64 << 20, buffers=4, part_bytes=100 << 20,
                                                     part_tokens=65536))
def _shared_memory_short(dir, free, buffers, part_bytes, part_tokens):
    return (f"Shared memory ({dir}) has {free / 1e9:.2f} GB free, but extraction needs {buffers} part buffers of "
            f"{part_bytes / 1e9:.2f} GB there ({buffers - 1} filled at once by the batches in flight, one for a "
            f"writer process; --part-tokens {part_tokens}). Enlarge it (docker: --shm-size), lower --part-tokens or "
            "--token-budget, or write from the main process with --num-writers 0.")


@renders("extract.part-write-failed", example=dict(part="part-000003", cache="cache", error="[Errno 28] No space left"))
def _part_write_failed(part, cache, error):
    return (f"Writing part {part} into {cache} failed: {error}. Free space or fix the cause, then rerun the same "
            "command: committed parts are kept and the rest is redone.")


# -- the disk budget -------------------------------------------------------------------------

@renders("extract.budget-too-small", example=dict(budget=1 << 20, smallest=3 << 20, parts=2, token_budget=4096,
                                                  fitting_token_budget=1024))
def _budget_too_small(budget, smallest, parts, token_budget, fitting_token_budget):
    way = (f"lower --token-budget to {fitting_token_budget} (a batch's parts then fit)" if fitting_token_budget
           else "lower --part-tokens (a new cache: --force or another --output), since one part alone does not fit")
    return (f"--disk-budget {format_size(budget)} cannot hold the {parts} parts one forward batch of --token-budget "
            f"{token_budget} spans (about {format_size(smallest)} with the cache's manifests): a batch's parts are "
            "committed together, so the extraction would wait for room forever. Raise --disk-budget to at least "
            f"{size_at_least(smallest)} plus the trainer's group of --shuffle-parts parts, or {way}.")


def _waiting(waited, since, part, more, need, used, limit) -> str:
    return (f"--disk-budget: waiting {waited} s (since {since}) for room for {part}"
            f"{f' and {more} more' if more else ''} ({format_size(need)}): {format_size(used)} of "
            f"{format_size(limit)} held")


_WAIT = dict(waited=31, since=time.strftime("%H:%M:%S", time.gmtime(0)), part="part-000002", more=0, need=8192,
             used=1 << 20, limit=1 << 21)


@renders("extract.budget-wait-own-batch", example=dict(**_WAIT, open_parts=2, reserved=1 << 20))
def _budget_wait_own_batch(waited, since, part, more, need, used, limit, open_parts, reserved):
    return (f"{_waiting(waited, since, part, more, need, used, limit)}, and this extraction's {open_parts} open "
            f"part(s) of one forward batch reserve {format_size(reserved)}: a batch's parts are committed together, "
            "so no room comes. Stop it (Ctrl-C) and rerun with a lower --token-budget or a higher --disk-budget.")


@renders("extract.budget-wait-untrained", example=dict(**_WAIT, untrained=2, kept=0, trainer_epochs=None, trained=None))
def _budget_wait_untrained(waited, since, part, more, need, used, limit, untrained, kept, trainer_epochs, trained):
    trainer = ("no training run has reported its consumption yet" if trainer_epochs is None else
               "the training ranks are at epoch " + ", ".join(str(e) for e in trainer_epochs)
               + f" with {trained} of its parts trained")
    return (f"{_waiting(waited, since, part, more, need, used, limit)} by {untrained} committed part(s) no training "
            f"rank has reported trained{f' ({kept} kept for a later epoch)' if kept else ''}; {trainer}. It ends when "
            "the next report (dflash-train --follow writes manifest.trained-rank*.json after each checkpoint) lets a "
            "part go; if the trainer waits too, the budget is below its --shuffle-parts group plus one forward "
            "batch's parts: raise --disk-budget, or lower --shuffle-parts or --token-budget.")


@renders("extract.budget-evicted", example=dict(part="part-000001", freed=1 << 20, epoch=0, again=True))
def _budget_evicted(part, freed, epoch, again):
    return (f"--disk-budget: evicted {part} ({format_size(freed)}; trained on in epoch {epoch} by every training rank"
            + (f", extracted again for epoch {epoch + 1})" if again else ", not read again)"))



# -- dflash-extract's contract (extract/cli.py: runtime.cli's stop and out-of-memory findings) --


@renders("extract.stopped", example=dict(command="dflash-extract", signal="SIGINT"))
def _stopped(command, signal):
    return (f"{command} stopped by {signal} outside the extraction loop; committed parts are kept. Rerun the same "
            "command to resume.")


@renders("extract.out-of-memory", example=dict(command="dflash-extract", error="CUDA out of memory"))
def _out_of_memory(command, error):
    return (f"{command} ran out of device memory ({error}). One forward runs --token-budget padded tokens through the "
            "target (and its head for the samples of --top1-share, or every token with --store-topk / "
            "--store-last-hidden): lower --token-budget, or free the device of other processes. Committed parts are "
            "kept: rerun with the smaller budget to resume.")
