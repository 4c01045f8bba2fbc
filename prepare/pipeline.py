"""`dflash-prepare`'s work: chat records -> rendered, masked records in the extract input format.

Output: one JSONL file of {"id", "input_ids", "loss_mask"} records (and the source record's "group",
when it names one), written under a temp name
and renamed when complete (a stopped run leaves no half file), and its sidecar
`<output>.meta.json` (runtime/records.py). Samples that cannot be used are counted by reason; a
malformed record or a refused rendering stops the run with its file and line unless
--skip-bad is given, an empty or over-long sample is skipped and counted.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
from dflash.runtime.errors import InputError, SettingError
from dflash.runtime.findings import Finding, emit
from dflash.runtime.fsio import fsync_dir, temp_name
from dflash.runtime.locks import output_lock, refuse_output_among_inputs
from dflash.runtime.records import format_record, write_sidecar
from dflash.runtime.settings import JsonObject, setting

from .formats import FORMATS, iter_conversations, list_chat_files
from .render import (
    LOSS_ON,
    ChatRenderer,
    EmptySampleError,
    RenderError,
    end_of_turn_ids,
    load_chat_template,
)

MAX_SKIPS_LISTED = 50


class PrepareConfigError(SettingError):
    """Settings of dflash-prepare / dflash-generate are inconsistent or incomplete."""


@dataclass(kw_only=True)
class RenderConfig:
    """How conversations are rendered; shared by dflash-prepare and dflash-generate."""

    target_model: str
    """Local HF model directory: its tokenizer and chat template render the data."""
    format: str = setting("auto", choices=FORMATS)
    """Record shape: OpenAI messages, ShareGPT conversations, prompt/response pairs."""
    group_key: str = "group"
    """The source record's field naming the document it comes from (e.g. conversation_id, source,
    url): written into each record as its "group", so the trainer holds out whole documents
    (docs/prepare.md). A record without the field has no group."""
    chat_template: str | None = setting(None, type=click.Path(dir_okay=False))
    """Jinja file (or JSON with chat_template) to use instead of the tokenizer's; must be the
    template the serving engine uses."""
    chat_template_kwargs: dict[str, Any] = setting(default_factory=dict, type=JsonObject())
    """JSON object of template variables, e.g. '{"enable_thinking": false}'."""
    thinking: str | None = setting(None, choices=("on", "off"))
    """Sets enable_thinking in the template kwargs; match the serving setting."""
    loss_on: str = setting("all-assistant", choices=LOSS_ON)
    """Which assistant turns are supervised."""
    supervise_empty_reasoning: bool = False
    """Also supervise an empty <think></think> block the template inserts."""

    def __post_init__(self) -> None:
        if isinstance(self.chat_template_kwargs, str):
            try:
                self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
            except json.JSONDecodeError as e:
                raise PrepareConfigError(Finding("prepare.template-kwargs-json", error=str(e))) from None
        if not isinstance(self.chat_template_kwargs, dict):
            raise PrepareConfigError(Finding("prepare.template-kwargs-json", error=None))
        if self.thinking not in (None, "on", "off"):
            raise PrepareConfigError(Finding("prepare.flag-choice", flag="--thinking", value=self.thinking,
                                             choices=["on", "off"]))
        if self.thinking is not None:
            self.chat_template_kwargs = {**self.chat_template_kwargs, "enable_thinking": self.thinking == "on"}
        if self.loss_on not in LOSS_ON:
            raise PrepareConfigError(Finding("prepare.flag-choice", flag="--loss-on", value=self.loss_on,
                                             choices=list(LOSS_ON)))
        if self.format not in FORMATS:
            raise PrepareConfigError(Finding("prepare.flag-choice", flag="--format", value=self.format,
                                             choices=list(FORMATS)))


@dataclass(kw_only=True)
class PrepareConfig(RenderConfig):
    data: str
    """Chat dataset: a .jsonl/.jsonl.gz/.parquet file or a directory of them."""
    output: str
    """The JSONL file to write (with its sidecar <output>.meta.json)."""
    max_seq_len: int = 8192
    """Longest rendered sample kept."""
    long_samples: str = setting("skip", choices=("skip", "truncate"))
    """What to do with samples longer than --max-seq-len."""
    skip_bad: bool = False
    """Skip (and count) malformed records and refused renderings instead of stopping."""
    num_workers: int = 0
    """Processes rendering in parallel (0: in this process); the output is the same."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_seq_len <= 0:
            raise PrepareConfigError(Finding("prepare.flag-not-positive", flag="--max-seq-len", value=self.max_seq_len))
        if self.long_samples not in ("skip", "truncate"):
            raise PrepareConfigError(Finding("prepare.flag-choice", flag="--long-samples", value=self.long_samples,
                                             choices=["skip", "truncate"]))


def load_tokenizer(target_model: str):
    path = Path(target_model)
    if not path.is_dir():
        raise InputError(Finding("prepare.target-model-not-dir", dir=str(target_model)))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise InputError(Finding("prepare.tokenizer-unloadable", dir=str(path), error=str(e))) from e


def build_renderer(config: RenderConfig, tokenizer=None) -> ChatRenderer:
    tokenizer = tokenizer or load_tokenizer(config.target_model)
    template = load_chat_template(config.chat_template) if config.chat_template else None
    return ChatRenderer(
        tokenizer, chat_template=template, chat_template_kwargs=config.chat_template_kwargs,
        loss_on=config.loss_on, supervise_empty_reasoning=config.supervise_empty_reasoning,
        eos_ids=end_of_turn_ids(tokenizer, config.target_model),
    )


def render_meta(config: RenderConfig, renderer: ChatRenderer, files: list[Path]) -> dict[str, Any]:
    return {
        **renderer.meta(),
        "chat_template_source": "file" if config.chat_template else "tokenizer",
        "tokenizer": Path(config.target_model).name,
        "format": config.format,
        "source_files": [f.name for f in files],
    }


@dataclass
class PrepareSummary:
    records: int = 0
    written: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)
    skips: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    def skip(self, key: str, where: str, reason: Finding) -> None:
        self.skipped[key] += 1
        if len(self.skips) < MAX_SKIPS_LISTED:
            self.skips.append({"where": where, "reason": str(reason), "code": reason.code})

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["skipped"] = dict(self.skipped)
        del d["skips"]
        return d

    def format(self) -> str:
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items())) or "none"
        return (f"dflash-prepare: {self.written} of {self.records} records written, {self.tokens} tokens "
                f"({self.supervised_tokens} supervised), truncated {self.truncated}, skipped: {skipped} "
                f"({self.seconds:.1f} s)")


def run_prepare(config: PrepareConfig, tokenizer=None) -> PrepareSummary:
    notes: list[Finding] = []
    files = list_chat_files(config.data, notes)
    for note in notes:
        emit(note)
    renderer = build_renderer(config, tokenizer)
    out = Path(config.output)
    refuse_output_among_inputs(out, files)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = PrepareSummary()
    t0 = time.perf_counter()
    tmp = temp_name(out)
    lock = output_lock(out, purpose="prepare")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            _prepare_into(fh, files, config, renderer, summary)
            fh.flush()
            os.fsync(fh.fileno())
        if not summary.written:
            raise InputError(Finding("prepare.no-usable-sample", data=str(config.data), records=summary.records,
                                     skipped=dict(summary.skipped)))
        summary.seconds = time.perf_counter() - t0
        write_sidecar(out, {"producer": "dflash-prepare", **render_meta(config, renderer, files),
                         "max_seq_len": config.max_seq_len, "long_samples": config.long_samples,
                         "stats": summary.to_json()})
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        lock.release()
    return summary


_WORKER_RENDERER: ChatRenderer | None = None


def _init_worker(config: PrepareConfig) -> None:
    global _WORKER_RENDERER
    _WORKER_RENDERER = build_renderer(config)


def _render_one(item: Any, renderer: ChatRenderer | None = None) -> tuple:
    """("ok", id, where, ids, mask, group) | ("empty" | "refused" | "bad", id, where, finding) (a bad record's id is None)."""
    if isinstance(item, tuple):
        return ("bad", None, *item)
    try:
        r = (renderer or _WORKER_RENDERER).render(item)
    except EmptySampleError as e:
        return ("empty", item.id, item.where, e.finding)
    except RenderError as e:
        return ("refused", item.id, item.where, e.finding)
    return ("ok", item.id, item.where, r.input_ids, r.loss_mask, item.group)


def _rendered(files, config: PrepareConfig, renderer: ChatRenderer) -> Iterator[tuple]:
    """The outcome of every record in input order, rendered here or by --num-workers processes."""
    items = iter_conversations(files, config.format, config.group_key)
    if config.num_workers <= 0:
        yield from (_render_one(item, renderer) for item in items)
        return
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    with ctx.Pool(config.num_workers, initializer=_init_worker, initargs=(config,)) as pool:
        yield from pool.imap(_render_one, items, chunksize=32)


def _prepare_into(fh, files, config: PrepareConfig, renderer: ChatRenderer, summary: PrepareSummary) -> None:
    from tqdm import tqdm

    bar = tqdm(desc="dflash-prepare", unit=" records", disable=not config.progress, dynamic_ncols=True)
    seen: dict[str, str] = {}
    for kind, rid, where, *rest in _rendered(files, config, renderer):
        summary.records += 1
        bar.update(1)
        if kind == "bad":
            if not config.skip_bad:
                raise InputError(Finding("prepare.bad-record", where=where, problem=rest[0], command="dflash-prepare"))
            summary.skip("bad_record", where, rest[0])
            continue
        if rid in seen:
            raise InputError(Finding("prepare.duplicate-id", where=where, id=rid, first=seen[rid]))
        seen[rid] = where
        if kind == "empty":
            summary.skip("empty", where, rest[0])
            continue
        if kind == "refused":
            if not config.skip_bad:
                raise InputError(Finding("prepare.render-refused", where=where, id=rid, problem=rest[0]))
            summary.skip("refused", where, rest[0])
            continue
        ids, mask, group = rest
        if len(ids) > config.max_seq_len:
            if config.long_samples == "skip":
                summary.skip("long", where, Finding("prepare.sample-too-long", tokens=len(ids), flag="--max-seq-len",
                                                    limit=config.max_seq_len))
                continue
            ids, mask = ids[: config.max_seq_len], mask[: config.max_seq_len]
            summary.truncated += 1
            if not any(mask):
                summary.skip("empty", where, Finding("prepare.sample-nothing-supervised", flag="--max-seq-len"))
                continue
        fh.write(format_record({"id": rid, **({} if group is None else {"group": group}), "input_ids": ids,
                                "loss_mask": mask}) + "\n")
        summary.written += 1
        summary.tokens += len(ids)
        summary.supervised_tokens += sum(mask)
    bar.close()
