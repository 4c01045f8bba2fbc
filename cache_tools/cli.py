"""`dflash-cache`: inspect, check and maintain hidden-state caches.

Thin click commands over `summary`, `maintenance` and `rewrite`, imported when a command runs
(`maintenance` and `rewrite` load torch; `info`, which reads the manifest only, and `--help`
do not). Errors follow the contract of every dflash command
(`dflash.runtime.cli`): one paragraph, exit status 2.
"""

from __future__ import annotations

import json
import sys
from dataclasses import MISSING, dataclass
from typing import TYPE_CHECKING, Any

import click
from dflash.runtime.cli import EXIT_FAILED, Group
from dflash.runtime.errors import SettingError
from dflash.runtime.findings import Finding, render
from dflash.runtime.settings import IntList, setting, settings_options

from .codecs import CODEC_NAMES  # (no torch)

if TYPE_CHECKING:
    from .rewrite import CopyReport



# -- the settings of each command (flags, --config keys and --help: dflash.runtime.settings) ----


@dataclass(kw_only=True)
class InfoSettings:
    as_json: bool = setting(False, flag="--json", one_way=True)
    """Print the summary as JSON (for scripts)."""


@dataclass(kw_only=True)
class VerifySettings:
    fast: bool = setting(False, one_way=True)
    """Check structure only (files, metadata, shard indexes, sizes); do not decode chunks."""
    quarantine: bool = setting(False, one_way=True)
    """Move the damaged parts out of the cache (into CACHE/quarantine/), so that rerunning the
    command that wrote them (dflash-extract, recompress, merge) writes exactly those parts again."""
    progress: bool | None = None
    """Show a progress bar (default: on a terminal)."""


@dataclass(kw_only=True)
class StatsSettings:
    num_tokens: int = setting(4096, type=click.IntRange(min=1))
    """How many random tokens to sample."""
    seed: int = 0
    """Seed of the token sample."""
    outlier_sigma: float = setting(6.0, type=click.FloatRange(min=0, min_open=True))
    """A value is an outlier when |x| exceeds this many times the RMS of its (token, layer) row."""
    as_json: bool = setting(False, flag="--json", one_way=True)
    """Print the statistics as JSON."""
    progress: bool | None = None
    """Show a progress bar (default: on a terminal)."""


@dataclass(kw_only=True)
class RecompressSettings:
    codec: str = setting(MISSING, choices=CODEC_NAMES)
    """bf16 (lossless), fp8 (e4m3, one scale per token and layer; ~2-3 % error), nf4 (4-bit, one
    scale per 32 values), raw (uncompressed)."""
    clevel: int = setting(1, type=click.IntRange(0, 22))
    """zstd level inside Blosc."""
    force: bool = setting(False, one_way=True)
    """Delete a DST cache written with other settings and start anew."""
    progress: bool | None = None
    """Show a progress bar (default: on a terminal)."""


@dataclass(kw_only=True)
class ImportSettings:
    format: str
    """The source's format: specforge (the --output-path of SpecForge's prepare_hidden_states.py) or
    speculators (the dataset directory of speculators' prepare_data.py, whose hidden_states/
    data_generation_offline.py filled)."""
    target_model: str
    """The target the hidden states were computed with: its config.json (hidden size, layers,
    vocabulary) checks the files and, with its tokenizer files, is the cache's target identity. No
    weights are read."""
    target_layer_ids: list[int] | None = setting(None, type=IntList())
    """The layers the files hold, in our numbering (id l is the output of decoder layer l, as
    dflash-extract --target-layer-ids); a speculators file's extra last slot (the last layer) is
    found by its width. Give this or --source-layer-ids."""
    source_layer_ids: list[int] | None = setting(None, type=IntList())
    """The layers the files hold, as the source numbers them: SpecForge as we do; speculators one
    more (vLLM counts the embedding), with the last layer N that launch_vllm.py appends."""
    codec: str = setting("bf16", choices=CODEC_NAMES)
    """Hidden-state codec of the new cache (bf16 keeps bf16 sources bit for bit)."""
    store_last_hidden: bool = False
    """Store the files' last-layer slot (speculators: layer N, before the final norm) as the cache's
    last_hidden."""
    skip_bad: bool = False
    """Leave out (and count) the sample files that cannot be read or fail a check, instead of stopping
    at the first one with an error."""
    part_tokens: int = setting(65536, type=click.IntRange(min=1))
    """Tokens per cache part (the unit of resume)."""
    chunk_rows: int = setting(128, type=click.IntRange(min=1))
    """Rows per compressed chunk in the cache."""
    shard_rows: int = setting(8192, type=click.IntRange(min=1))
    """Rows per shard file in the cache (a multiple of --chunk-rows)."""
    force: bool = setting(False, one_way=True)
    """Delete an OUT cache written with other settings and start anew."""
    progress: bool | None = None
    """Show a progress bar (default: on a terminal)."""


@dataclass(kw_only=True)
class MergeSettings:
    force: bool = setting(False, one_way=True)
    """Delete a DST cache written with other settings and start anew."""
    progress: bool | None = None
    """Show a progress bar (default: on a terminal)."""


@dataclass(kw_only=True)
class UploadSettings:
    threads: int = setting(8, type=click.IntRange(min=1))
    """Parallel uploads."""
    replace: bool = setting(False, one_way=True)
    """Where URL holds another cache (another identity), delete it and upload CACHE in its place
    (without it, such a prefix is refused)."""


@dataclass(kw_only=True)
class PruneSettings:
    dry_run: bool = setting(False, one_way=True)
    """List what would be removed; remove nothing."""


def _packing(codec: dict) -> str:
    """How the chunks were asked to be packed: ', literals only' (no zstd matches), or
    ', hash log 6, min match 7' for zstd with match limits, or '' for zstd's own parameters."""
    if codec.get("zstd_literals_only"):
        return ", literals only"
    parts = [f"{label} {codec[key]}" for key, label in (("zstd_hash_log", "hash log"), ("zstd_min_match", "min match"))
             if codec.get(key)]
    return "".join(f", {p}" for p in parts)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=1, default=str))


CACHE_ARG = click.argument("cache", type=click.Path(file_okay=False, path_type=str))


@click.group(cls=Group, name="dflash-cache", context_settings={"help_option_names": ["-h", "--help"]},
             stop_note="cache.stopped")
def main() -> None:
    """Inspect, check and maintain dflash hidden-state caches.

    A cache is a directory written by `dflash-extract`: manifest.json (what the cache is),
    manifest.parts.jsonl (the committed parts) and parts/ (one zarr group per part).

    \b
    Examples:
      dflash-cache info runs/cache            # what is in it, how well it compresses
      dflash-cache verify runs/cache          # re-read and checksum every chunk
      dflash-cache recompress runs/cache runs/cache-fp8 --codec fp8

    Exit status: 0 success, 1 `verify` found damage, 2 bad usage or a bad cache (one
    paragraph says what and where), 130/143 stopped by SIGINT/SIGTERM.
    """


@main.command()
@CACHE_ARG
@settings_options(InfoSettings)
def info(cache: str, settings: InfoSettings) -> None:
    """Summarize CACHE from its manifest: target, layers, codec, sizes, compression.

    Reads only the manifest files, so it is instant on any cache size. The compression ratio
    is relative to the same activations stored as plain bf16 (tokens x layers x hidden x 2
    bytes, plus hidden x 2 per token when the final hidden state is stored).

    \b
    Example:
      dflash-cache info runs/cache --json | jq .compression_ratio
    """
    from .manifest import chat_templates
    from .summary import cache_info

    s = cache_info(cache)
    if settings.as_json:
        _echo_json(s)
        return
    target = ", ".join(f"{k}={v}" for k, v in s["target"].items()) or "(not recorded)"
    codec = s["codec"]
    lengths = s["sample_length"]
    lines = [
        f"cache            {s['cache_dir']} (format {s['format_version']})",
        f"target           {target}",
        f"target_layer_ids {s['target_layer_ids']} (K={s['num_layers']}), hidden_size {s['hidden_size']}",
        f"codec            {codec['name']} (zstd level {codec['clevel']}{_packing(codec)}, "
        f"blocksize {codec['blocksize']}), "
        f"chunk_rows {s['chunk_rows']}, shard_rows {s['shard_rows']}" + _recompressed(s["codec_history"]),
        f"extras           last_hidden={s['extras'].get('last_hidden')}, topk={s['extras'].get('topk')}, "
        f"top1={_top1_line(s)}",
        f"parts            {s['parts']}" + (
            f" of {s['unfinished']['planned_parts']} planned ({s['samples']} of {s['unfinished']['planned_samples']} "
            "samples): the extraction has not finished; rerun its dflash-extract command to finish it"
            if s["unfinished"] else ""),
        f"samples          {s['samples']} (length min {lengths['min']}, mean {lengths['mean']:.1f}, "
        f"max {lengths['max']})",
        f"tokens           {s['tokens']}",
        f"bytes on disk    {s['bytes']} ({_human_bytes(s['bytes'])}), {s['bytes_per_token']:.1f} bytes/token",
        f"raw bf16 bytes   {s['raw_bf16_bytes']} ({_human_bytes(s['raw_bf16_bytes'])})",
        f"compression      {s['compression_ratio']:.3f}x vs raw bf16",
    ]
    if s["evicted_parts"]:
        lines.append(f"evicted          {len(s['evicted_parts'])} parts, {s['evicted_bytes']} bytes "
                     f"({_human_bytes(s['evicted_bytes'])}) under a disk budget (an extraction's later "
                     "--follow-epochs pass writes them again; until then a training run without --follow and "
                     "the maintenance verbs refuse the cache); "
                     f"on disk now {_human_bytes(s['bytes'] - s['evicted_bytes'])}")
    if s["part_stats"]:
        lines.append("part stats       " + ", ".join(f"{k}={v}" for k, v in sorted(s["part_stats"].items())))
    for rendering in chat_templates({"data": s["data"]}):
        lines.append(f"chat template    sha256 {rendering.get('chat_template_sha256')}, kwargs "
                     f"{json.dumps(rendering.get('chat_template_kwargs', {}))}, loss_on "
                     f"{rendering.get('loss_on')} ({rendering.get('producer')})")
    if s["data"]:
        lines.append(f"data             {json.dumps(s['data'], default=str)[:300]}")
    click.echo("\n".join(lines))


def _recompressed(history: list[str]) -> str:
    """Where a recompressed cache's values came from: a lossy codec among them set their precision."""
    if not history:
        return ""
    lossy = [c for c in history if c in ("fp8", "nf4")]
    return (f"; recompressed from {' -> '.join(history)}"
            + (f" (the values keep {lossy[0]}'s precision)" if lossy else ""))


def _top1_line(s: dict) -> str:
    """Whether and for which samples the cache stores the target's top-1."""
    dtype, share = s["extras"].get("top1"), s["top1_share"]
    if not dtype:
        return "none"
    counted = "?" if s["top1_samples"] is None else s["top1_samples"]
    if share >= 1:
        return f"{dtype} (every sample)"
    return (f"{dtype} for {counted} of {s['samples']} samples (--top1-share {share:g}: those the held-out split "
            "takes first)")


@main.command()
@CACHE_ARG
@settings_options(VerifySettings)
def verify(cache: str, settings: VerifySettings) -> None:
    """Check CACHE for damage: every chunk of every array of every committed part.

    The full check re-reads every chunk and compares its crc32c, and checks each part's
    offsets and token counts against the commit log, sample ids (unique per part), array
    lengths, token ids against the target's vocabulary, loss masks and fp8 scales. It does not
    stop at the first problem: each bad part, array and chunk or file is listed.
    --fast checks the structure only (part files present, metadata, shard indexes, sizes on
    disk), which reads a few KiB per part.

    Exit status 0 when the cache is sound, 1 when anything is damaged (also with --quarantine).
    To repair it, `--quarantine` takes the damaged parts out of the commit log (their files and
    records are kept under CACHE/quarantine/<time>-<pid>/); then rerun the dflash-extract command
    that wrote the cache: it extracts exactly those parts again. Quarantine waits for no one: it
    is refused while an extraction writes the cache.

    A remote cache (s3://bucket/prefix) is checked against its file index: every committed
    part is indexed and every file is stored with its size (--fast) and its crc32c (read
    through, nothing is written locally).

    \b
    Example:
      dflash-cache verify runs/cache && echo sound
      dflash-cache verify --quarantine runs/cache; dflash-extract ...   # the same command as before
      dflash-cache verify s3://bucket/caches/qwen3-8b
    """
    from . import maintenance, remote_store

    fast = settings.fast
    if remote_store.is_remote(cache):
        if settings.quarantine:
            raise SettingError(Finding("cache.quarantine-remote", url=cache, flag="--quarantine"))
        _verify_remote(cache, fast)
        return
    report = maintenance.verify_cache(cache, fast=fast, progress=settings.progress)
    for note in report.notes:
        click.echo(f"note: {render(note)}")
    mode = "structure" if fast else f"{report.chunks} chunks"
    if report.ok:
        planned = f" (of {report.planned} planned: unfinished)" if report.planned else ""
        evicted = f", {len(report.evicted)} of them evicted (see the note)" if report.evicted else ""
        click.echo(f"OK: {report.parts} parts{planned}{evicted}, {mode} checked, no problems found.")
        return
    for problem in report.problems:
        click.echo(f"BAD {problem}")
    click.echo(
        f"FAILED: {len(report.problems)} problems in {len(report.bad_parts)} of {report.parts} parts "
        f"({', '.join(report.bad_parts) or 'the commit log'}); {mode} checked."
        + ("" if settings.quarantine else
           f" To re-extract the damaged parts: `dflash-cache verify --quarantine {cache}` takes them out of "
           "the cache, then rerun the dflash-extract command that wrote it (or recompress / merge).")
    )
    if settings.quarantine:
        _quarantine(cache, report)
    sys.exit(EXIT_FAILED)


def _quarantine(cache: str, report: Any) -> None:
    from .quarantine import quarantine_damaged

    done = quarantine_damaged(cache, report)
    for name in done.moved:
        click.echo(f"quarantined {name} -> {done.directory / 'parts' / name}")
    for name in sorted(set(done.parts) - set(done.moved)):
        click.echo(f"quarantined {name} (its commit record; the part directory was missing)")
    for number in done.damaged_lines:
        click.echo(f"quarantined the damaged commit record of line {number} -> {done.directory / 'manifest.parts.jsonl'}")
    if done.parts or done.damaged_lines:
        click.echo(f"Quarantine: {len(done.parts)} parts left the cache (kept in {done.directory}). Rerun the "
                   "dflash-extract command that wrote the cache (or the recompress / merge that did) to write "
                   "exactly them again, then verify again.")
    else:
        click.echo("Quarantine: no part to take out (the problems are not in a committed part).")


@main.command()
@CACHE_ARG
@settings_options(StatsSettings)
def stats(cache: str, settings: StatsSettings) -> None:
    """Value statistics of CACHE's hidden states per target layer, and sample lengths.

    Samples --num-tokens random tokens and prints, for each captured layer, mean, std, absmax,
    the fraction of outliers, and the channels with the largest RMS (relative to the median
    channel): the outlier channels that make int8 quantization fail. Also prints a histogram
    of sample lengths (all samples, from the manifest).

    \b
    Example:
      dflash-cache stats runs/cache --num-tokens 20000 --seed 1
    """
    from . import maintenance

    s = maintenance.cache_stats(cache, num_tokens=settings.num_tokens, seed=settings.seed,
                                outlier_sigma=settings.outlier_sigma, progress=settings.progress)
    if settings.as_json:
        _echo_json(s)
        return
    click.echo(f"{s['sampled_tokens']} random tokens (seed {s['seed']}); loss_mask=1 on "
               f"{100 * s['loss_mask_fraction']:.1f} % of them")
    click.echo(f"{'layer':>5} {'mean':>10} {'std':>10} {'absmax':>10} {'outliers':>9}  top channels (rms / median)")
    for layer in s["layers"]:
        top = ", ".join(f"{c['channel']}: {c['rms_over_median']:.1f}x" for c in layer["top_channels"])
        click.echo(f"{layer['layer_id']:>5} {layer['mean']:>10.4g} {layer['std']:>10.4g} {layer['absmax']:>10.4g} "
                   f"{100 * layer['outlier_fraction']:>8.3f}%  {top}")
    click.echo(f"(outliers: |x| > {s['outlier_sigma']:g} x the RMS of the value's token and layer)")
    click.echo("sample lengths:")
    hist = s["length_histogram"]
    most = max((h["samples"] for h in hist), default=1) or 1
    for h in hist:
        bar = "#" * max(1 if h["samples"] else 0, round(40 * h["samples"] / most))
        click.echo(f"  {h['min']:>7}-{h['max']:<7} {h['samples']:>8}  {bar}")


def _echo_copy(report: CopyReport, verb: str) -> None:
    ratio = report.raw_bf16_bytes / report.dst_bytes if report.dst_bytes else 0.0
    click.echo(f"{verb} {len(report.written)} parts, {len(report.skipped)} already present (skipped).")
    click.echo(f"{report.dst}: {report.dst_tokens} tokens, {_human_bytes(report.dst_bytes)} "
               f"({ratio:.3f}x vs raw bf16; sources {_human_bytes(report.src_bytes)}).")


@main.command()
@click.argument("src", type=click.Path(file_okay=False, path_type=str))
@click.argument("dst", type=click.Path(file_okay=False, path_type=str))
@settings_options(RecompressSettings)
def recompress(src: str, dst: str, settings: RecompressSettings) -> None:
    """Write a copy of cache SRC into DST with another hidden-state codec.

    DST gets the same parts, in the same order, with the same samples and sample ids. Each
    part is committed atomically; rerunning the same command after an interruption skips the
    parts already in DST. Converting to fp8 is lossy (and fp8 to bf16 does not restore the
    lost precision); between bf16 and raw, and fp8 to fp8, the stored values are copied exactly.

    \b
    Example:
      dflash-cache recompress runs/cache runs/cache-fp8 --codec fp8
    """
    from . import rewrite

    report = rewrite.recompress_cache(src, dst, codec=settings.codec, clevel=settings.clevel, force=settings.force,
                                      progress=settings.progress)
    _echo_copy(report, "Recompressed")


@main.command()
@click.argument("dst", type=click.Path(file_okay=False, path_type=str))
@click.argument("srcs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=str))
@settings_options(MergeSettings)
def merge(dst: str, srcs: tuple[str, ...], settings: MergeSettings) -> None:
    """Merge the caches SRCS... into one new cache DST.

    The sources must share target model, target_layer_ids, codec and extraction settings
    (everything but their data); otherwise nothing is written. Part P of the i-th source
    becomes part s<i>-P in DST, sample ids are kept, and DST's manifest lists the sources in
    its data section. Stored values are copied exactly. Resumable like recompress.

    \b
    Example:
      dflash-cache merge runs/cache-all runs/cache-math runs/cache-code
    """
    from . import rewrite

    report = rewrite.merge_caches(dst, list(srcs), force=settings.force, progress=settings.progress)
    _echo_copy(report, "Merged")


@main.command(name="import")
@click.argument("src", type=click.Path(file_okay=False, path_type=str))
@click.argument("out", type=click.Path(file_okay=False, path_type=str))
@settings_options(ImportSettings)
def import_(src: str, out: str, settings: ImportSettings) -> None:
    """Turn another trainer's hidden-state directory SRC into the cache OUT.

    Reads SpecForge's offline features (--format specforge: one torch.save file per sample) or
    speculators' (--format speculators: a dataset directory and one safetensors file per row),
    checks every sample (token counts of ids, mask and hidden states; the width against the layer
    ids and the target's hidden size; ids in the target's vocabulary) and writes a cache of any
    codec, planned first and committed part by part like an extraction: a rerun of the same
    command resumes, and `dflash-cache verify OUT` checks it. The files do not say which layers
    they hold: give --target-layer-ids or --source-layer-ids. See docs/cache-tools.md.

    \b
    Example:
      dflash-cache import sf-out runs/cache --format specforge --target-model /models/qwen3-8b \\
          --target-layer-ids 1,9,17,25,33
      dflash-cache import sharegpt-data runs/cache --format speculators \\
          --target-model /models/qwen3-8b --source-layer-ids 2,18,33,36 --codec fp8
    """
    from .importing import ImportOptions, import_cache

    options = ImportOptions(
        format=settings.format, target_layer_ids=settings.target_layer_ids,
        source_layer_ids=settings.source_layer_ids, codec=settings.codec,
        store_last_hidden=settings.store_last_hidden, skip_bad=settings.skip_bad, part_tokens=settings.part_tokens,
        chunk_rows=settings.chunk_rows, shard_rows=settings.shard_rows)
    report = import_cache(src, out, target_model=settings.target_model, options=options, force=settings.force,
                          progress=settings.progress)
    ratio = report.raw_bf16_bytes / report.dst_bytes if report.dst_bytes else 0.0
    click.echo(f"Imported {len(report.written)} parts, {len(report.skipped)} already present (skipped); "
               f"{report.layers}.")
    click.echo(f"{report.dst}: {report.samples} samples, {report.tokens} tokens, {_human_bytes(report.dst_bytes)} "
               f"({ratio:.3f}x vs raw bf16).")
    for path, problem in report.bad[:5]:
        click.echo(f"skipped {path}: {render(problem) if isinstance(problem, Finding) else problem}")
    if report.bad or report.bad_before:
        click.echo(f"Skipped {len(report.bad) or report.bad_before} bad sample file(s) (--skip-bad)"
                   + (f", {len(report.bad) - 5} more not listed" if len(report.bad) > 5 else "") + ".")
    for note in report.notes:
        click.echo(f"Note: {render(note)}")


def _verify_remote(url: str, fast: bool) -> None:
    from . import remote_upload

    report = remote_upload.verify_remote(url, fast=fast)
    mode = "sizes" if fast else "sizes and crc32c"
    if report.ok:
        click.echo(f"OK: {report.parts} parts, {report.files} files, {mode} checked, no problems found.")
        return
    for problem in report.problems:
        click.echo(f"BAD {problem}")
    click.echo(f"FAILED: {len(report.problems)} problems in {url}; {mode} checked. Upload the damaged "
               "parts again from a sound local cache (`dflash-cache upload` resumes: it rewrites what differs).")
    sys.exit(EXIT_FAILED)


@main.command()
@CACHE_ARG
@click.argument("url")
@settings_options(UploadSettings)
def upload(cache: str, url: str, settings: UploadSettings) -> None:
    """Copy the local cache CACHE to object storage at URL (s3://bucket/prefix).

    Parts go first, then a file index (each file's size and crc32c), the commit log and the
    header last: a remote cache is readable only once complete. Each object is stored with its
    crc32c and the cache's identity; a rerun keeps those that match the local files and rewrites
    the rest, so it resumes an interrupted upload and repairs what `verify` rejects. A URL that
    holds another cache is refused unless --replace. S3 settings come from the AWS_*
    environment variables (AWS_ENDPOINT_URL and AWS_ALLOW_HTTP=true for a local server).
    Needs the s3 extra (obstore). Train from it with `dflash-train --cache URL`.

    \b
    Example:
      dflash-cache upload runs/cache s3://bucket/caches/qwen3-8b
    """
    from . import remote_store, remote_upload

    if not remote_store.is_remote(url):
        raise SettingError(Finding("cache.remote-url-invalid", url=url))
    done = remote_upload.upload_cache(cache, url, threads=settings.threads, replace=settings.replace)
    click.echo(f"Uploaded {done['parts']} parts to {url}: {done['files_uploaded']} files written, "
               f"{done['files_kept']} already there with the same content"
               + (f", {done['files_removed']} left-over objects deleted" if done["files_removed"] else "")
               + (f" (it replaced another cache, identity {done['replaced']})" if done["replaced"] else "")
               + f", {_human_bytes(done['bytes'])} in all.")


@main.command()
@CACHE_ARG
@settings_options(PruneSettings)
def prune(cache: str, settings: PruneSettings) -> None:
    """Remove leftovers of interrupted writers from CACHE.

    Deletes temporary parts (parts/.tmp-*) whose writer is no longer alive and part
    directories that the commit log does not name. Runs under the cache lock; the parts of
    writers still running and every committed part are kept. Readers never see these
    leftovers, so pruning only frees disk space.

    \b
    Example:
      dflash-cache prune runs/cache --dry-run
    """
    from . import maintenance

    dry_run = settings.dry_run
    removed = maintenance.prune_cache(cache, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for name, nbytes in removed:
        click.echo(f"{verb} parts/{name} ({_human_bytes(nbytes)})")
    total = sum(n for _, n in removed)
    click.echo(f"{'Would remove' if dry_run else 'Removed'} {len(removed)} entries, {_human_bytes(total)}."
               if removed else "Nothing to remove.")


if __name__ == "__main__":
    main()
