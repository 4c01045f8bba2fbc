"""`dflash-generate`'s work: regenerate the assistant turns of a chat dataset with the target.

Each conversation becomes one record in dflash-extract's input format per sample (N with
--samples-per-prompt N), keyed by its source id and sample index: the prompt as the local chat
template renders it, then the target's answer with its end-of-turn token, loss on the answer
(and, under --loss-on all-assistant with --regenerate all, on every regenerated turn).
Sample 0 is the record of a single-sample run, byte for byte (id = the source id, no sample
key); sample k > 0 has the id `<source id>#k`, a `"sample": k` key, and its own seed
(backends.sample_seed). `regenerate()` is a coroutine that yields the
requests of one conversation turn by turn and returns its outcome, so that the server
backend (one per worker thread) and the batched in-process backend drive the same logic.

The output is append-only: every finished record is one line, flushed at once (a kill loses
only the requests in flight), and `<output>.skipped.jsonl` records the ids dropped for good
(truncated under --drop-truncated, answers that do not re-tokenize); a rerun reads both and
skips those (source id, sample) keys, so records are never duplicated. Failed requests are not recorded: a rerun
retries them.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.runtime.errors import InputError, MismatchError
from dflash.runtime.findings import Finding
from dflash.runtime.records import SKIPPED_SUFFIX, BadRecord, format_record, read_json

from .backends import Completion, Request, ServerMismatchError
from .formats import Conversation, parse_tool_arguments
from .render import ChatRenderer, RenderError

FSYNC_SECONDS = 2.0


class GenerateMismatchError(MismatchError):
    """An existing output was generated with other settings."""


def sample_record_id(source_id: str, sample: int) -> str:
    """The record id of a conversation's sample: the source id itself for sample 0 (the
    record of a single-sample run), `<source id>#<sample>` for the others."""
    return source_id if sample == 0 else f"{source_id}#{sample}"


@dataclass
class Outcome:
    id: str  # the source id
    record: dict[str, Any] | None = None
    drop_reason: str | None = None  # recorded as skipped for good
    finish_reason: str = "stop"
    completion_tokens: int = 0
    sample: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return self.id, self.sample


def regenerate(conv: Conversation, renderer: ChatRenderer, *, mode: str, drop_truncated: bool,
               loss_on: str, sample: int = 0) -> Generator[Request, Completion, Outcome]:
    """Yield the conversation's requests: the last assistant turn, or every one in order; a
    conversation that ends with a user (or tool) message gets its answer after it instead
    (--regenerate last) or as well (all), so prompt-only data works as it is. `sample` is the
    sample index, carried by every request (its seed) and by the outcome (its record's id)."""
    turns = conv.assistant_turns()
    todo = turns[-1:] if mode == "last" else turns
    if conv.messages and conv.messages[-1]["role"] != "assistant":
        todo = (todo if mode == "all" else []) + [len(conv.messages)]
    todo = [i for i in todo if i > 0]  # an opening assistant greeting answers nothing: kept as context
    if not todo:
        return Outcome(conv.id, drop_reason="nothing to answer (no message before an assistant turn)",
                       sample=sample)
    messages = list(conv.messages[: todo[0]])
    completion: Completion | None = None
    tokens = 0
    for n, i in enumerate(todo):
        if n:  # the source messages between the previous turn and this one (user, tool)
            messages += conv.messages[todo[n - 1] + 1: i]
        completion = yield Request(messages=list(messages), tools=conv.tools, sample=sample)
        tokens += len(completion.token_ids or []) or len(renderer.tokenize(completion.text))
        if completion.finish_reason == "length":
            break
        messages.append(_assistant_message(completion))
    if completion.finish_reason == "length" and drop_truncated:
        return Outcome(conv.id, drop_reason="truncated (finish_reason length)", finish_reason="length",
                       sample=sample)
    try:
        record = build_record(conv, messages, completion, renderer, loss_on=loss_on, sample=sample)
    except RenderError as e:
        return Outcome(conv.id, drop_reason=str(e), finish_reason=completion.finish_reason, sample=sample)
    return Outcome(conv.id, record=record, finish_reason=completion.finish_reason, completion_tokens=tokens,
                   sample=sample)


def _assistant_message(c: Completion) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": c.text}
    if c.tool_calls:
        m["tool_calls"] = parse_tool_arguments(c.tool_calls)
    if c.reasoning_content:
        m["reasoning_content"] = c.reasoning_content
    return m


def build_record(conv: Conversation, messages: list[dict], last: Completion, renderer: ChatRenderer,
                 *, loss_on: str, sample: int = 0) -> dict[str, Any]:
    """The record of a regenerated conversation: the prompt as the local template renders it,
    then the answer's tokens (the backend's ids, or the text re-tokenized and checked)."""
    prompt_messages = messages if last.finish_reason == "length" else messages[:-1]
    if last.local_prompt:  # the in-process backend rendered these messages with this renderer
        prompt = list(last.prompt_token_ids)
    else:
        prompt = renderer.prompt_ids(prompt_messages, conv.tools)
    if not last.local_prompt and last.prompt_token_ids is not None and list(last.prompt_token_ids) != prompt:
        raise ServerMismatchError(Finding("prepare.server-prompt-tokens", where=conv.where, id=conv.id))
    if last.token_ids is not None:
        answer = list(last.token_ids)
        ends = [k for k, t in enumerate(answer) if t in renderer.eos_ids]
        answer = answer[: ends[0] + 1] if ends else answer
    else:
        answer = _answer_from_text(conv, messages, last, renderer, prompt)
    mask = _prompt_mask(conv, prompt_messages, last, prompt, renderer, loss_on)
    group = {} if conv.group is None else {"group": conv.group}  # (the split holds out a group's answers together)
    return {**_record_key(conv.id, sample), **group, "input_ids": prompt + answer,
            "loss_mask": mask + [1] * len(answer), "finish_reason": last.finish_reason}


def _record_key(source_id: str, sample: int) -> dict[str, Any]:
    """A line's leading keys: {"id"} for sample 0 (as a single-sample run writes it), else
    {"id": "<source id>#k", "sample": k}."""
    if sample == 0:
        return {"id": source_id}
    return {"id": sample_record_id(source_id, sample), "sample": sample}


def _answer_from_text(conv, messages, last: Completion, renderer: ChatRenderer, prompt: list[int]) -> list[int]:
    """The answer's tokens when the server gave only text: re-tokenized, and checked to
    round-trip (decode(encode(text)) == text, and the template renders exactly those tokens
    after the prompt, closed by one end-of-turn token, which is added)."""
    answer = renderer.tokenize(last.text)
    if renderer.tokenizer.decode(answer) != last.text:
        raise RenderError(Finding("prepare.answer-not-round-trip"))
    if last.finish_reason == "length":
        return answer
    rendered = renderer.with_loss_on("last-assistant").render(
        Conversation(id=conv.id, where=conv.where, messages=messages, tools=conv.tools))
    span = rendered.input_ids[rendered.prompt_len:]
    if rendered.input_ids[: rendered.prompt_len] != prompt or span[: len(answer)] != answer \
            or len(span) != len(answer) + 1 or span[-1] not in renderer.eos_ids:
        raise RenderError(Finding("prepare.answer-not-round-trip", through="the chat template"))
    return span


def _prompt_mask(conv, prompt_messages, last: Completion, prompt: list[int], renderer: ChatRenderer,
                 loss_on: str) -> list[int]:
    """Zeros, or under all-assistant the masks of the assistant turns inside the prompt, taken
    from the rendering of the whole conversation (the history as the template renders it there)."""
    if loss_on != "all-assistant" or not any(m["role"] == "assistant" for m in prompt_messages):
        return [0] * len(prompt)
    whole = [*prompt_messages, _assistant_message(last)]
    r = renderer.with_loss_on("all-assistant").render(
        Conversation(id=conv.id, where=conv.where, messages=whole, tools=conv.tools))
    if r.input_ids[: len(prompt)] != prompt:
        raise RenderError(Finding("prepare.history-differs-from-prompt", flag="--loss-on"))
    return r.loss_mask[: len(prompt)]


class OutputLog:
    """The append-only output and its skipped-ids log; safe for several processes (flock).
    `done` holds the (source id, sample) keys of both."""

    def __init__(self, output: str | Path):
        self.path = Path(output)
        self.skipped_path = self.path.with_name(self.path.name + SKIPPED_SUFFIX)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: set[tuple[str, int]] = set()
        for p in (self.path, self.skipped_path):
            self.done |= _read_keys(p)
        self._files = {p: open(p, "ab") for p in (self.path, self.skipped_path)}
        self._synced = time.monotonic()

    def append(self, outcome: Outcome) -> None:
        if outcome.record is not None:
            line, path = format_record(outcome.record), self.path
        else:
            line = json.dumps({**_record_key(outcome.id, outcome.sample), "reason": outcome.drop_reason})
            path = self.skipped_path
        f = self._files[path]
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(line.encode() + b"\n")
            f.flush()  # in the page cache now: a killed process loses nothing written
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
        self.done.add(outcome.key)
        if time.monotonic() - self._synced > FSYNC_SECONDS:
            self.sync()

    def sync(self) -> None:
        for f in self._files.values():
            os.fsync(f.fileno())
        self._synced = time.monotonic()

    def close(self) -> None:
        self.sync()
        for f in self._files.values():
            f.close()


def _read_keys(path: Path) -> set[tuple[str, int]]:
    """(source id, sample) of the complete lines of `path`; a torn last line (a kill
    mid-write) is cut off."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    keys = set()
    for line_no, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            keys.add(_line_key(read_json(line)))
        except (BadRecord, KeyError, TypeError, ValueError):
            raise InputError(Finding("prepare.output-line-unreadable", file=str(path), line=line_no)) from None
    return keys


def _line_key(rec: dict[str, Any]) -> tuple[str, int]:
    rid, sample = str(rec["id"]), rec.get("sample", 0)
    if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
        raise ValueError("bad sample index")
    suffix = f"#{sample}"
    if sample == 0:
        return rid, 0
    if not rid.endswith(suffix):
        raise ValueError("the id does not end with its sample index")
    return rid[: -len(suffix)], sample


@dataclass
class GenerateSummary:
    done_before: int = 0
    written: int = 0
    dropped: Counter = field(default_factory=Counter)
    failed: int = 0
    failures: list[Finding] = field(default_factory=list)
    finish_reasons: Counter = field(default_factory=Counter)
    completion_tokens: int = 0
    seconds: float = 0.0
    retries: int = 0
    request_errors: dict[str, int] = field(default_factory=dict)
    stopped_by: int = 0
    notes: list[Finding] = field(default_factory=list)  # what a resume could not check

    def add(self, o: Outcome) -> None:
        self.finish_reasons[o.finish_reason] += 1
        self.completion_tokens += o.completion_tokens
        if o.record is not None:
            self.written += 1
        else:
            self.dropped[o.drop_reason.split(" (")[0][:60]] += 1

    def format(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        lines = [f"dflash-generate: {self.written} records written ({self.done_before} done before), "
                 f"{self.failed} failed, {sum(self.dropped.values())} dropped; {self.completion_tokens} "
                 f"generated tokens in {self.seconds:.1f} s ({rate:.1f} tokens/s)",
                 "  finish reasons: " + (", ".join(f"{k} {v}" for k, v in sorted(self.finish_reasons.items())) or "none")]
        if self.dropped:
            lines.append("  dropped: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items())))
        if self.retries or self.request_errors:
            lines.append(f"  retries: {self.retries}; request errors: "
                         + ", ".join(f"{k} x{v}" for k, v in sorted(self.request_errors.items())))
        lines += [f"  failed: {f}" for f in self.failures[:10]]
        if self.failed:
            lines.append("  Rerun the same command to retry the failed records (finished ones are kept).")
        lines += [f"Note: {note}" for note in self.notes]
        return "\n".join(lines)
