"""Driving `regenerate()` over a dataset: server worker threads or in-process batches.

The unit of work is one sample of one conversation (--samples-per-prompt N gives N of them).
Server: `concurrency` daemon threads each take a sample, run its requests, and hand the
outcome to the main thread, the only writer. In-process: the main thread reads
`batch_size * sort_window` conversations ahead, renders their pending requests, and for each
sample index in turn sorts that sample's requests by prompt length (longest first: a batch too
large for the device fails at once) and runs them `batch_size` at a time through one
`generate()` each, writing each batch's finished records before the next starts (later turns
of --regenerate all form the next round). Sample 0's batches are then those of a
single-sample run, drawn on the same random stream.
A first SIGINT/SIGTERM stops feeding new work and returns within a second (server; in-process
within one decoding step), abandoning what is in flight; a rerun regenerates it.
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from dflash.cache_tools.identity import (
    Purpose,
    target_differences,
    target_identity,
    target_provenance,
)
from dflash.runtime.errors import InputError
from dflash.runtime.findings import Finding, emit
from dflash.runtime.fsio import file_lock
from dflash.runtime.locks import output_lock, refuse_output_among_inputs
from dflash.runtime.records import read_sidecar, write_sidecar
from dflash.runtime.settings import setting
from dflash.runtime.signals import StopRequest

from .backends import HFBackend, RequestFailed, Sampling, ServerBackend
from .formats import Conversation, iter_conversations, list_chat_files
from .generate import GenerateMismatchError, GenerateSummary, Outcome, OutputLog, regenerate
from .pipeline import PrepareConfigError, RenderConfig, build_renderer, render_meta
from .render import LOSS_ON


@dataclass(kw_only=True)
class GenerateConfig(RenderConfig):
    data: str
    """Chat dataset: a .jsonl/.jsonl.gz/.parquet file or a directory of them."""
    output: str
    """The JSONL file to append to (resumable; sidecars <output>.meta.json, <output>.skipped.jsonl)."""
    loss_on: str = setting("last-assistant", choices=LOSS_ON)
    """Which assistant turns are supervised."""
    server: str | None = None
    """Comma-separated base URLs of OpenAI-compatible servers (vLLM, SGLang, transformers serve),
    e.g. http://host1:8000,http://host2:8000. Without it the target runs in-process (HF generate)."""
    model: str | None = None
    """The model name sent in requests (as the server serves it)."""
    concurrency: int = 64
    """Requests in flight over all servers."""
    max_retries: int = 5
    """Retries of a failed request (backoff, next server)."""
    request_timeout: float = 600.0
    """Seconds before a request is retried."""
    token_ids: str = setting("auto", choices=("auto", "server", "text"))
    """Answer tokens: the server's ids where it returns them (auto), or the text re-tokenized and
    checked to round-trip."""
    temperature: float = 0.0
    """0: greedy."""
    top_p: float = 1.0
    """Nucleus sampling's probability mass."""
    max_tokens: int = 2048
    """Longest answer; longer ones end with finish_reason length."""
    stop: list[str] = field(default_factory=list)
    """A stop string (repeat the flag for several)."""
    seed: int | None = None
    """Sampling seed sent with each request (sample k > 0 of --samples-per-prompt: a seed derived
    from it and k)."""
    samples_per_prompt: int = 1
    """Answers per conversation, each one record: sample 0 as a single-sample run writes it,
    samples 1..N-1 drawn at --temperature with seeds of their own (ids <id>#1, <id>#2, ...).
    Raising it on a rerun adds only the missing samples."""
    regenerate: str = setting("last", choices=("last", "all"))
    """Regenerate the last assistant turn, or every one in order on the target's own earlier answers."""
    drop_truncated: bool = setting(False, secondary="--keep-truncated")
    """Leave out answers cut by --max-tokens (finish_reason length)."""
    batch_size: int = 16
    """In-process backend: conversations per generate()."""
    sort_window: int = 8
    """In-process backend: batches read ahead and sorted by prompt length, so a batch pads little
    (1: input order)."""
    device: str | None = None
    """In-process backend: torch device [default: cuda:$LOCAL_RANK if available, else cpu]."""
    dtype: str = setting("bf16", choices=("bf16", "fp16", "fp32"))
    """In-process backend dtype."""
    progress: bool = True
    """Show a progress bar (requests/s, tokens/s, ETA)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.regenerate not in ("last", "all"):
            raise PrepareConfigError(Finding("prepare.flag-choice", flag="--regenerate", value=self.regenerate,
                                             choices=["last", "all"]))
        if self.token_ids not in ("auto", "server", "text"):
            raise PrepareConfigError(Finding("prepare.flag-choice", flag="--token-ids", value=self.token_ids,
                                             choices=["auto", "server", "text"]))
        for name in ("concurrency", "max_tokens", "batch_size", "sort_window", "samples_per_prompt"):
            if getattr(self, name) <= 0:
                raise PrepareConfigError(Finding("prepare.flag-not-positive", flag=f"--{name.replace('_', '-')}",
                                                 value=getattr(self, name)))
        if self.samples_per_prompt > 1 and self.temperature <= 0:
            raise PrepareConfigError(Finding("prepare.greedy-samples", samples=self.samples_per_prompt,
                                             temperature=self.temperature))

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                        stop=list(self.stop) or None, seed=self.seed,
                        chat_template_kwargs=self.chat_template_kwargs)

    def content_settings(self) -> dict[str, Any]:
        """Settings that change what a record holds: a resume must keep them."""
        return {"regenerate": self.regenerate, "temperature": self.temperature, "top_p": self.top_p,
                "max_tokens": self.max_tokens, "stop": list(self.stop), "seed": self.seed,
                "drop_truncated": self.drop_truncated, "loss_on": self.loss_on}


@dataclass
class _Progress:
    total: int
    enabled: bool
    start: float = field(default_factory=time.perf_counter)
    bar: Any = None

    def __post_init__(self) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, desc="dflash-generate", unit=" req", disable=not self.enabled,
                        dynamic_ncols=True)

    def update(self, summary: GenerateSummary) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.update(1)
        self.bar.set_postfix_str(f"{summary.completion_tokens / elapsed:.0f} tok/s", refresh=False)

    def close(self) -> None:
        self.bar.close()


def model_identity(config: GenerateConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """What identifies the model that writes the answers (the sidecar's `target`, compared on
    resume) and where it was (`target_provenance`, named in messages, never compared).

    In-process: the target's identity as a cache header records it (`cache_tools.identity`:
    its config, tokenizer files and weights hash; not its path). Server: the model name sent
    with each request (--model); the server's URLs are provenance (a model may move hosts)."""
    if config.server:
        urls = [u.rstrip("/") for u in config.server.split(",") if u]
        return {"backend": "server", "model": config.model}, {"server": urls}
    model_dir = Path(config.target_model)
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise InputError(Finding("prepare.target-config-unloadable", dir=str(model_dir), error=str(e))) from e
    return {"backend": "in-process", **target_identity(model_config, model_dir)}, target_provenance(model_dir)


def _model_differences(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, recorded, current) where the sidecar's model and this run's differ."""
    if old.get("backend") != new.get("backend"):
        return [("backend", old.get("backend"), new.get("backend"))]
    if new.get("backend") == "server":
        return [] if old.get("model") == new.get("model") else [("model", old.get("model"), new.get("model"))]
    return target_differences(old, new, Purpose.RESUME)


def _check_resume(config: GenerateConfig, meta: dict[str, Any]) -> list[Finding]:
    """Refuse an output of other settings or another model, or write its sidecar; every rank,
    one at a time (the sidecar must be there before any rank's first record: a rank that
    checked after another had appended one saw an output without a sidecar and refused it).
    Returns the notes for the summary."""
    output = Path(config.output)
    with file_lock(output.with_name(f".{output.name}.meta.lock")):
        return _check_resume_locked(config, meta, output)


def _check_resume_locked(config: GenerateConfig, meta: dict[str, Any], output: Path) -> list[Finding]:
    old = read_sidecar(config.output)
    if old is None and output.exists() and output.stat().st_size:
        raise GenerateMismatchError(Finding("prepare.output-without-sidecar", file=str(output)))
    # (after the refusals that need no model: an output that is no dflash-generate's is said first)
    meta["target"], meta["target_provenance"] = model_identity(config)
    if old is None or not output.exists():
        write_sidecar(config.output, meta)
        return []
    keys = ("chat_template_sha256", "chat_template_kwargs", "generation")
    diffs = [k for k in keys if old.get(k) != meta.get(k)]
    if diffs:
        raise GenerateMismatchError(Finding("prepare.output-other-settings", file=str(config.output),
                                            settings={k: old.get(k) for k in diffs}))
    current = meta["target"]
    if not isinstance(old.get("target"), dict):  # a sidecar written before the model was recorded
        return [Finding("prepare.output-model-unrecorded", file=str(output), model=current,
                        provenance=meta.get("target_provenance"))]
    model_diffs = _model_differences(old["target"], current)
    if model_diffs:
        raise GenerateMismatchError(Finding(
            "prepare.output-other-model", file=str(output), model=old["target"], provenance=old.get("target_provenance"),
            this_model=current, this_provenance=meta.get("target_provenance"),
            differences=[list(d) for d in model_diffs]))
    if current.get("backend") == "server" and current.get("model") is None:
        return [Finding("prepare.served-model-unnamed", file=str(output), flag="--model")]
    return []


def run_generate(config: GenerateConfig, tokenizer=None) -> GenerateSummary:
    notes: list[Finding] = []
    files = list_chat_files(config.data, notes)
    for note in notes:
        emit(note)
    renderer = build_renderer(config, tokenizer)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    meta = {"producer": "dflash-generate", **render_meta(config, renderer, files),
            "generation": config.content_settings()}
    refuse_output_among_inputs(config.output, files)
    output = Path(config.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    # The ranks of one run append to one output (each line under flock); another run may not.
    lock = output_lock(output, purpose="generate", shared=world > 1)
    try:
        return _run_generate(config, renderer, files, meta, rank, world)
    finally:
        lock.release()


def _run_generate(config: GenerateConfig, renderer, files, meta: dict[str, Any], rank: int,
                  world: int) -> GenerateSummary:
    notes = _check_resume(config, meta)
    log = OutputLog(config.output)
    summary = GenerateSummary(done_before=len(log.done), notes=notes)
    # A first pass checks every record and counts this rank's work (for the ETA) without
    # holding the dataset in memory (but for its ids, with several samples); the second streams it.
    ids: set[str] | None = set() if config.samples_per_prompt > 1 else None
    total = sum(len(samples) for _, samples in _todo(files, config, log.done, rank, world, ids))
    if ids:
        _refuse_clashing_ids(ids, config.samples_per_prompt)
    todo = _todo(files, config, set(log.done), rank, world)
    t0 = time.perf_counter()
    progress = _Progress(total, config.progress)
    stop = StopRequest(finishing="abandoning the requests in flight, keeping every finished record")
    try:
        with stop:
            if config.server:
                _drive_server(config, renderer, todo, log, summary, progress, stop)
            else:
                _drive_local(config, renderer, todo, log, summary, progress, stop)
    finally:
        progress.close()
        log.close()
        summary.seconds = time.perf_counter() - t0
    summary.stopped_by = stop.signum
    return summary


def _todo(files, config: GenerateConfig, done: set[tuple[str, int]], rank: int, world: int,
          ids: set[str] | None = None) -> Iterator[tuple[Conversation, list[int]]]:
    """This rank's conversations (every WORLD_SIZE-th record, all samples of one on one rank)
    with their sample indices not done yet; a bad record stops. `ids` collects every source id."""
    for n, item in enumerate(iter_conversations(files, config.format, config.group_key)):
        if isinstance(item, tuple):
            raise InputError(Finding("prepare.bad-record", where=item[0], problem=item[1], command="dflash-generate"))
        if ids is not None:
            ids.add(item.id)
        if n % world != rank:
            continue
        samples = [k for k in range(config.samples_per_prompt) if (item.id, k) not in done]
        if samples:
            yield item, samples


def _refuse_clashing_ids(ids: set[str], samples_per_prompt: int) -> None:
    """Refuse a dataset where a source id is another's sample id (`a#1` beside `a`)."""
    for rid in ids:
        m = re.fullmatch(r"(.*)#([1-9][0-9]*)", rid, flags=re.DOTALL)
        if m and m.group(1) in ids and int(m.group(2)) < samples_per_prompt:
            raise InputError(Finding("prepare.sample-id-clash", id=m.group(1), other=rid,
                                     samples=samples_per_prompt, sample=int(m.group(2))))


def _drive_server(config, renderer, todo: Iterator[tuple[Conversation, list[int]]], log: OutputLog,
                  summary: GenerateSummary, progress: _Progress, stop: StopRequest) -> None:
    """One request (per turn) for each sample: each has its own seed and is resumed on its own
    (the API's `n` would share one seed and one history)."""
    urls = [u for u in config.server.split(",") if u]
    backend = ServerBackend(urls, config.sampling(), model=config.model, request_timeout=config.request_timeout,
                            max_retries=config.max_retries, token_ids=config.token_ids)
    jobs: queue.Queue = queue.Queue(maxsize=2 * config.concurrency)  # bounded: the data streams
    results: queue.Queue = queue.Queue()
    fed = {"count": 0, "done": False}

    def work() -> None:
        while not stop.requested:
            try:
                conv, sample = jobs.get(timeout=0.2)
            except queue.Empty:
                if fed["done"]:
                    return
                continue
            try:
                results.put(_run_one(conv, sample, renderer, config, backend.complete))
            except Exception as e:  # a failed request, a server mismatch or a bug: the main thread decides
                results.put((conv, sample, e))

    workers = [threading.Thread(target=work, daemon=True) for _ in range(config.concurrency)]
    for w in workers:
        w.start()
    received = 0
    units = ((conv, k) for conv, samples in todo for k in samples)
    for unit in units:
        while not stop.requested:
            try:
                jobs.put(unit, timeout=0.05)
                fed["count"] += 1
                break
            except queue.Full:
                received += _collect(results, log, summary, progress, backend, timeout=0)
        if stop.requested:
            return
        received += _collect(results, log, summary, progress, backend, timeout=0)
    fed["done"] = True
    while received < fed["count"] and not stop.requested:
        received += _collect(results, log, summary, progress, backend, timeout=0.2)


def _collect(results: queue.Queue, log: OutputLog, summary: GenerateSummary, progress: _Progress,
             backend: ServerBackend, *, timeout: float) -> int:
    """Write the outcomes that are ready (waiting up to `timeout` for the first); how many."""
    n = 0
    while True:
        try:
            item = results.get(timeout=timeout) if timeout and not n else results.get_nowait()
        except queue.Empty:
            return n
        n += 1
        if isinstance(item, tuple):
            conv, sample, e = item
            if not isinstance(e, RequestFailed):
                raise e
            summary.failed += 1
            summary.failures.append(Finding("prepare.record-failed", where=conv.where, id=conv.id, sample=sample,
                                            problem=e.finding))
        else:
            log.append(item)
            summary.add(item)
        summary.retries = backend.stats.retries
        summary.request_errors = dict(backend.stats.errors)
        progress.update(summary)


def _run_one(conv: Conversation, sample: int, renderer, config: GenerateConfig, complete) -> Outcome:
    gen = regenerate(conv, renderer, mode=config.regenerate, drop_truncated=config.drop_truncated,
                     loss_on=config.loss_on, sample=sample)
    try:
        request = next(gen)
        while True:
            request = gen.send(complete(request))
    except StopIteration as done:
        return done.value


def _drive_local(config, renderer, todo: Iterator[tuple[Conversation, list[int]]], log: OutputLog,
                 summary: GenerateSummary, progress: _Progress, stop: StopRequest) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    import torch

    device = config.device or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    backend = HFBackend(config.target_model, renderer, config.sampling(), device=device, dtype=config.dtype,
                        stop_flag=stop)
    it = iter(todo)
    while not stop.requested:
        window = list(islice(it, config.batch_size * config.sort_window))
        if not window:
            return
        gens = {}
        pending = {}
        for conv, samples in window:
            for sample in samples:
                g = regenerate(conv, renderer, mode=config.regenerate, drop_truncated=config.drop_truncated,
                               loss_on=config.loss_on, sample=sample)
                gens[conv.id, sample] = g
                pending[conv.id, sample] = _advance(g, None, log, summary, progress)
        while not stop.requested:  # one round per turn (--regenerate all: the next turns after it)
            live = [(k, r) for k, r in pending.items() if r is not None]
            if not live:
                break
            backend.render([r for _, r in live])
            for k, r in live:
                if (why := backend.past_positions(r)) is not None:  # a reported skip, not an answer out of range
                    gens[k].close()
                    _advance_done(Outcome(k[0], drop_reason=why, sample=k[1]), log, summary, progress)
            live = [(k, r) for k, r in live if backend.past_positions(r) is None]
            pending = {}
            for sample in sorted({r.sample for _, r in live}):  # each sample's batches on its own stream
                group = [(k, r) for k, r in live if r.sample == sample]
                group.sort(key=lambda kr: -len(kr[1].prompt_ids))  # stable: equal lengths keep input order
                for first in range(0, len(group), config.batch_size):
                    part = group[first: first + config.batch_size]
                    completions = backend.complete_batch([r for _, r in part])
                    if stop.requested:
                        return  # the batch was cut short: its answers are not the target's whole answers
                    for (k, _), c in zip(part, completions):
                        pending[k] = _advance(gens[k], c, log, summary, progress)


def _advance(gen, completion, log: OutputLog, summary: GenerateSummary, progress: _Progress):
    """Send `completion` (None: start) to a conversation; its next request, or None once done."""
    try:
        return next(gen) if completion is None else gen.send(completion)
    except StopIteration as done:
        _advance_done(done.value, log, summary, progress)
        return None


def _advance_done(outcome: Outcome, log: OutputLog, summary: GenerateSummary, progress: _Progress) -> None:
    log.append(outcome)
    summary.add(outcome)
    progress.update(summary)
