"""One extraction run, wired end to end: data -> parts -> batches -> target forward (the loop,
extract/loop.py) -> writer pool -> cache.

`run_extraction(config)` is what `dflash-extract` runs; it can also be called in-process with
a model already built (`model=`), as the benchmark does.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.errors import ConfigMismatchError
from dflash.cache_tools.eviction import EvictionLog, record_budget
from dflash.cache_tools.identity import target_provenance, unrecorded_weights_note
from dflash.cache_tools.layers import default_target_layer_ids, validate_target_layer_ids
from dflash.cache_tools.manifest import CommitLog, header_top1_share, make_header, read_header
from dflash.cache_tools.schema import top1_dtype
from dflash.cache_tools.staging import parse_size
from dflash.cache_tools.writer import CacheWriter
from dflash.runtime.devices import resolve_device
from dflash.runtime.errors import DflashError
from dflash.runtime.findings import Finding, emit
from dflash.runtime.locks import refuse_output_among_inputs
from dflash.runtime.positions import TargetPositions, target_positions
from dflash.runtime.safetensors_files import refuse_drafter_as_target
from dflash.runtime.signals import StopRequest, stop_if_signalled
from torch import nn
from tqdm import tqdm

from .budget import BudgetTooSmallError, ExtractionBudget
from .config import ExtractConfig
from .data import (
    BadRecordError,
    DataSnapshot,
    PartPlan,
    json_documents_note,
    list_data_files,
    plan_windows,
    repeated_files_note,
    skipped_files_note,
    snapshot_data,
)
from .engine import ExtractionEngine
from .loop import ExtractionLoop
from .pinned import SegmentPinner
from .plan_file import ensure_plan
from .target import LayerCapture, config_layer_count, decoder_layers, load_target, target_identity
from .writers import WriterPool, start_fork_server, stop_fork_server

# Diagnostic: copy rows through the engine's pinned slots and a host-side copy, instead of
# straight into the (page-locked) part buffers. For comparisons and as a fallback.
STAGED_COPY_ENV = "DFLASH_EXTRACT_STAGED_COPY"
# How long the other ranks of a run given --force wait for rank 0 to start the cache anew (rank 0
# loads the same target at the same time; a rank 0 that never comes leaves them the old cache).
FORCE_WAIT_SECONDS = 600.0


@dataclass
class ExtractSummary:
    """What this process did (one rank's share when several run)."""

    samples: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    skipped_bad: int = 0
    skipped_long: int = 0
    truncated: int = 0
    parts_written: int = 0
    parts_done_before: int = 0
    parts_total: int = 0  # of the sort windows reached (all of them, unless stopped)
    parts_this_rank: int = 0
    parts_planned: int = 0  # the cache's plan: every part of the extraction (0: no plan)
    parts_reextracted: int = 0  # evicted parts extracted again (later epochs, or restored)
    tokens_reextracted: int = 0
    parts_on_disk: int = 0  # at the end, by the cache's logs: committed parts whose files are there
    parts_evicted: int = 0  # and those evicted under a disk budget
    budgeted: bool = False  # run under --disk-budget
    bytes: int = 0
    seconds: float = 0.0  # from the first batch to the last part committed
    setup_seconds: float = 0.0  # writers started, part segments page-locked (before the first batch)
    teardown_seconds: float = 0.0  # writers stopped, segments released (after the last commit)
    interrupted_by: int | None = None  # signal number when stopped by SIGINT/SIGTERM
    notes: list[Finding] = field(default_factory=list)  # input files that changed (data.DataSnapshot), ...
    leftovers_removed: int = 0  # temporary or unrecorded parts of dead writers, removed at open
    skips: list[dict] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return (self.tokens + self.tokens_reextracted) / self.seconds if self.seconds > 0 else 0.0

    @property
    def padding_waste(self) -> float:
        return 1 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0

    def format(self) -> str:
        state = (f"stopped by {signal.Signals(self.interrupted_by).name}" if self.interrupted_by
                 else "done")
        again = (f" and {self.parts_reextracted} evicted parts again ({self.tokens_reextracted} tokens)"
                 if self.parts_reextracted else "")
        return (
            f"dflash-extract {state}: {self.samples} samples, {self.tokens} tokens in "
            f"{self.parts_written} parts{again} ({self.bytes / 1e9:.2f} GB), "
            f"{self.tokens_per_second:,.0f} tokens/s (start-up {self.setup_seconds:.1f} s and "
            f"shutdown {self.teardown_seconds:.1f} s not counted), padding waste {self.padding_waste:.1%}; "
            f"skipped {self.skipped_bad} bad and {self.skipped_long} long samples, truncated "
            f"{self.truncated}; {self.parts_done_before} parts were already committed; "
            + (f"this rank's parts: {self.parts_this_rank} of {self.parts_total}." if not self.interrupted_by else
               f"this rank committed {self.parts_done_before + self.parts_written} of the {self.parts_this_rank} "
               f"parts it reached before the stop, of the {self.parts_planned or self.parts_total} the extraction "
               "plans (rerun the same command to finish it).")
            + (f" The cache holds {self.parts_on_disk} of its {self.parts_planned} planned parts; "
               f"{self.parts_evicted} are evicted under --disk-budget"
               + (": a later --follow-epochs pass extracts them again, or rerun without --disk-budget to restore "
                  "them all." if self.budgeted else ".") if self.parts_evicted else "")
            + (f" Removed {self.leftovers_removed} leftover(s) of interrupted writers."
               if self.leftovers_removed else "")
            + "".join(f"\nNote: {note}" for note in self.notes)
        )


class Progress:
    """Samples done of this rank's share; postfix with tokens/s and GB written."""

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, unit="sample", disable=not enabled, dynamic_ncols=True,
                        desc="extract")
        self.start = time.perf_counter()
        self.tokens = 0

    def skip(self, plan: PartPlan) -> None:
        """A part this process will not do (another rank's, or committed): not in the ETA."""
        self.bar.total = max(0, self.bar.total - plan.stats["records"])
        self.bar.refresh()

    def advance(self, plan: PartPlan, nbytes: int) -> None:
        self.tokens += plan.num_tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s, {nbytes / 1e9:.2f} GB written", refresh=False)
        self.bar.update(plan.stats["records"])

    def close(self) -> None:
        self.bar.close()


def default_num_writers(device: torch.device) -> int:
    """Writer processes for this process: the host's cores shared by its local ranks."""
    if device.type == "cpu":
        return 0
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min((os.cpu_count() or 4) // local_ranks - 2, 12))


def writer_count(config: ExtractConfig, device: torch.device) -> int:
    return config.num_writers if config.num_writers is not None else default_num_writers(device)


def build_header(config: ExtractConfig, model: nn.Module, model_dir, layer_ids, data: DataSnapshot,
                 positions: TargetPositions | None = None) -> dict:
    ident = target_identity(model, model_dir)
    return make_header(
        target=ident, target_layer_ids=layer_ids, hidden_size=ident["hidden_size"],
        codec=HiddenCodec(name=config.codec), chunk_rows=config.chunk_rows,
        shard_rows=config.shard_rows, store_last_hidden=config.store_last_hidden,
        topk=config.store_topk, top1=top1_dtype(ident["vocab_size"]) if config.stored_top1_share() else None,
        top1_share=config.stored_top1_share(),
        data={"files": data.entries, "sha256": data.sha256},
        settings=config.content_settings(positions), provenance=target_provenance(model_dir),
    )


def recorded_header(cache_dir) -> dict:
    """The header of the cache at `cache_dir`, if one is there to resume ({} if not: a damaged
    or missing manifest is left to CacheWriter to name)."""
    try:
        return read_header(Path(cache_dir))
    except (DflashError, OSError, ValueError):
        return {}


def run_extraction(config: ExtractConfig, *, model: nn.Module | None = None) -> ExtractSummary:
    """Extract the hidden states of this rank's uncommitted parts into config.output."""
    skipped: list[Path] = []
    repeated: list[Path] = []
    documents: list[tuple[Path, str]] = []
    files = list_data_files(config.data, exclude=(config.output,), skipped=skipped, repeated=repeated,
                            documents=documents)
    refuse_output_among_inputs(config.output, [config.data, *files])
    for note in (skipped_files_note(config.data, skipped), repeated_files_note(config.data, repeated),
                 json_documents_note(config.data, documents)):
        if config.rank == 0 and note:
            emit(note)
    if model is None:
        check_layer_ids_before_loading(config)
    device = resolve_device(config.device)  # under torchrun each process of a host takes its own GPU
    if writer_count(config, device):
        start_fork_server()  # the writers' imports then overlap loading the target
    try:
        return _run_extraction(config, files, device, model, left_out=documents)
    except BaseException:
        stop_fork_server()  # (the writer pool stops it too, when it got that far)
        raise


def check_layer_ids_before_loading(config: ExtractConfig) -> None:
    """The layer rule against the layer count of the target's config.json, so that ids it refuses
    are refused in a second rather than after the weights load (minutes for a large target);
    LayerCapture checks them again against the decoder layers the loaded model has."""
    refuse_drafter_as_target(config.target_model)  # a drafter's config has a drafter's layers: say what it is first
    count = config_layer_count(config.target_model)
    if count is None:
        return
    ids = config.target_layer_ids or default_target_layer_ids(count, config.num_captured_layers)
    validate_target_layer_ids(ids, count, purpose="extract")


def _run_extraction(config: ExtractConfig, files, device: torch.device, model: nn.Module | None, *,
                    left_out: Sequence[tuple[Path, str]] = ()) -> ExtractSummary:
    model_dir = None
    if model is None:
        model_dir = config.target_model
        model = load_target(
            model_dir, dtype=config.dtype, device=str(device),
            attn_implementation=config.attn_implementation, device_map=config.device_map,
        )
    device = model.get_input_embeddings().weight.device
    layer_ids = config.target_layer_ids or default_target_layer_ids(
        len(decoder_layers(model)), config.num_captured_layers
    )
    # Every row to the last layer for the last hidden state or the top-k; for the top-1 only the
    # rows of the samples that get one (--top1-share; all of them at share 1).
    need_last = config.store_last_hidden or config.store_topk > 0 or config.stored_top1_share() >= 1
    capture = LayerCapture(model, layer_ids,  # checks the ids (cache_tools.layers)
                           need_last=need_last, top1_rows=config.stored_top1_share() > 0)
    positions = target_positions(model.config)
    old = {} if config.force else recorded_header(config.output)
    data = snapshot_data(files, config.data, recorded=old.get("data"), left_out=left_out)
    header = build_header(config, model, model_dir, layer_ids, data, positions)
    refuse_a_cache_past_the_positions(old, header, config.output, positions)
    if old and (note := unrecorded_weights_note(old.get("target"), header["target"], purpose="cache",
                                                path=str(config.output))):
        data.notes.append(note)
    if config.force and (run := os.environ.get("TORCHELASTIC_RUN_ID", "none")) != "none":
        header["provenance"]["forced_run"] = run  # what the other ranks wait for (CacheWriter)
    stop_if_signalled()  # a signal whose stop a finalizer swallowed while the target loaded: write nothing
    cache = CacheWriter(config.output, header, force=config.force and config.rank == 0,
                        wait_for_force=FORCE_WAIT_SECONDS if config.force and config.rank > 0 else 0.0)
    rules = config.part_rules(header["target"]["vocab_size"], positions)
    budget, batch_bytes = _disk_budget(config, cache), None
    if budget is not None:  # a budget that cannot hold one batch's parts is refused before anything waits
        try:
            batch_bytes = budget.check_batches(plan_windows(data, rules), config.token_budget, config.world_size)
        except BudgetTooSmallError:
            cache.close()
            raise
        except BadRecordError:
            pass  # (no plan: the run stops at the record, naming it)
    # Before the plan, which a following trainer waits for: it checks what the budget needs.
    record_budget(config.output, None if config.disk_budget is None else parse_size(config.disk_budget), batch_bytes)
    planned = ensure_plan(config.output, data, rules)  # what a following trainer plans from
    built = time.perf_counter()
    engine = ExtractionEngine(model, capture, cache.codec, device=device, topk=config.store_topk,
                              min_rows=config.token_budget, top1=cache.header["extras"].get("top1"),
                              top1_share=header_top1_share(cache.header), store_last_hidden=config.store_last_hidden)
    engine_seconds = time.perf_counter() - built  # compiling the fp8 quantizer, on a GPU
    summary = ExtractSummary(leftovers_removed=len(cache.removed_orphans), notes=list(data.notes))
    summary.parts_planned = planned
    progress = Progress(data.records, config.progress)
    direct = not os.environ.get(STAGED_COPY_ENV)
    try:
        pool = _writer_pool(config, cache, engine, direct)
    except BaseException:
        capture.close()
        progress.close()
        raise
    loop = ExtractionLoop(files=data, rules=rules, rank=config.rank,
                          world_size=config.world_size, token_budget=config.token_budget,
                          committed=set(cache.committed()), evicted=set(EvictionLog(config.output).refresh().evicted()),
                          engine=engine, pool=pool, progress=progress,
                          summary=summary, direct=direct, budget=budget,
                          follow_epochs=config.follow_epochs)
    t0 = time.perf_counter()
    engine.mark_start()
    try:
        with StopRequest(finishing="finishing the parts in progress, then exiting",
                         abandoning="exiting now (unfinished parts are redone on resume)",
                         on_second=pool.kill) as stop:
            loop.run(stop)
            drain_start = time.perf_counter()
            pool.drain()
            _profile_drain(pool, drain_start)
            if (timeline := engine.timeline_report()) is not None:
                print(timeline, file=sys.stderr, flush=True)
        summary.seconds = time.perf_counter() - t0  # every part committed
        pool.close()
    except Exception:
        pool.stop_after_error()  # (bounded: writers that do not stop within seconds are killed)
        raise
    except BaseException:
        pool.kill()
        raise
    finally:
        capture.close()
        progress.close()
        cache.close()
    summary.bytes = pool.nbytes
    summary.budgeted = budget is not None
    on_disk = CommitLog(Path(config.output))
    on_disk.refresh()
    evicted = EvictionLog(config.output).refresh().evicted()
    summary.parts_evicted = len(evicted)
    summary.parts_on_disk = len(on_disk.records) - len(evicted)
    summary.notes += data.changes_since_start()
    if note := long_samples_note(config, positions, summary):
        summary.notes.append(note)
    summary.setup_seconds = engine_seconds + pool.setup_seconds
    summary.teardown_seconds = time.perf_counter() - t0 - summary.seconds
    return summary


def long_samples_note(config: ExtractConfig, positions: TargetPositions | None,
                      summary: ExtractSummary) -> Finding | None:
    """What held the samples of this run to their length, when not --max-seq-len alone: the
    target's positions (fewer than --max-seq-len), or a config that gives none."""
    if positions is None:
        return Finding("extract.target-positions-unknown", flag="--max-seq-len", value=config.max_seq_len)
    held = summary.truncated + summary.skipped_long
    if positions.limit >= config.max_seq_len or not held:
        return None
    return Finding("extract.samples-past-positions", samples=held, positions=positions.describe(),
                   limit=positions.limit, long_samples=config.long_samples, max_seq_len=config.max_seq_len)


def refuse_a_cache_past_the_positions(old: dict, header: dict, output: str,
                                      positions: TargetPositions | None) -> None:
    """A cache of this target extracted with max_seq_len past its positions (by a version that
    did not hold samples to them): resuming it would cut the rest of its parts otherwise, and its
    committed parts may hold hidden states past the positions. Named here, where the header
    comparison would only say that max_seq_len differs (and a rerun with it would differ again)."""
    recorded = (old.get("settings") or {}).get("max_seq_len")
    same_target = (old.get("target") or {}).get("config_hash") == header["target"].get("config_hash")
    if positions is None or not same_target or not isinstance(recorded, int) or recorded <= positions.limit:
        return
    raise ConfigMismatchError(Finding("extract.cache-past-positions", cache=str(output), max_seq_len=recorded,
                                      positions=positions.describe(), limit=positions.limit))


def _disk_budget(config: ExtractConfig, cache: CacheWriter) -> ExtractionBudget | None:
    """--disk-budget: the parts' bytes kept within it, evicting what the trainer consumed (budget.py)."""
    if config.disk_budget is None:
        return None
    return ExtractionBudget(config.output, cache.header, parse_size(config.disk_budget),
                            follow_epochs=config.follow_epochs, schema=cache.schema)


def _writer_pool(config: ExtractConfig, cache: CacheWriter, engine: ExtractionEngine, direct: bool) -> WriterPool:
    """The writer processes and their part segments (page-locked ones for direct copies on CUDA)."""
    num_writers = writer_count(config, engine.device)
    pinner = SegmentPinner(engine.device) if engine.cuda and direct else None
    # Parts open at once: those of the batches in flight (consecutive parts of a window);
    # page-locked segments: those, plus a few in the writers' hands (the pool caps this by
    # the free shared and host memory).
    open_parts = 2 + -(-ExtractionEngine.NUM_SLOTS * config.token_budget // config.part_tokens)
    pool = WriterPool(cache, cache.schema.from_target(), num_writers, pinner=pinner,
                      segment_tokens=config.part_tokens, pinned_segments=open_parts + min(num_writers, 3),
                      open_parts=open_parts)
    if num_writers and os.environ.get("DFLASH_PROFILE_EXTRACT"):
        pinned_note = (f"{pinner.registered} page-locked part segments (registering {pinner.seconds:.2f} s, "
                       f"{pinner.failures} refused) and " if pinner is not None else "")
        print(f"setup: {pinned_note}{num_writers} writer processes ready in {pool.setup_seconds:.2f} s",
              file=sys.stderr, flush=True)
    return pool


def _profile_drain(pool: WriterPool, drain_start: float) -> None:
    if os.environ.get("DFLASH_PROFILE_EXTRACT") and pool.results:
        per_part = sorted(r.seconds for r in pool.results)
        print(f"drain: the last parts were written {time.perf_counter() - drain_start:.2f} s "
              f"after the last batch; writer time per part: median {per_part[len(per_part) // 2]:.2f} s, "
              f"max {per_part[-1]:.2f} s, {len(pool.results)} parts, {pool.num_writers} writers",
              file=sys.stderr, flush=True)
