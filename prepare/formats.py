"""Chat datasets in the common shapes, read into one form: a source id and a list of messages.

Accepted record shapes (one JSON object per line, or one Parquet row):
  messages       {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...,
                  "tool_calls": [...], "reasoning_content": ...}, ...], "tools": [...]}
  sharegpt       {"conversations": [{"from": "system"|"human"|"gpt"|"tool"|..., "value": ...}]}
  prompt         {"prompt": "...", "response": "...", "system": "..."}  (also instruction/output;
                 without a response: a prompt for dflash-generate)
plus an optional "id". `detect_format` picks the shape from the keys of a record; `--format`
forces one. Files are JSONL, JSONL.gz or Parquet (Parquet needs pyarrow: the `parquet` extra).
A record without an id gets "<file name>:<line>" (Parquet: "<file name>:<row>"), which stays
stable as long as the file does; that id is what `dflash-generate` resumes by.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.runtime.errors import InputError
from dflash.runtime.findings import Finding
from dflash.runtime.records import SIDECAR_SUFFIXES, json_document

FORMATS = ("auto", "messages", "sharegpt", "prompt")
CHAT_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".parquet")
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "function_call": "assistant",
}
ROLES = ("system", "user", "assistant", "tool")
PROMPT_KEYS = (("prompt", "response"), ("instruction", "output"), ("question", "answer"))


class BadChatRecord(Exception):
    """A record is not a conversation in the expected shape; `finding` is the reason."""

    def __init__(self, finding: Finding):
        super().__init__(finding)
        self.finding = finding


@dataclass
class Conversation:
    """One source record: its id, where it came from, its messages and tool schemas."""

    id: str
    where: str  # "file, line N" for error messages
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    group: str | int | None = None
    """The record's "group" (the document it comes from), copied into its rendered records: the
    trainer's held-out split holds out whole groups (runtime/records.py)."""

    def assistant_turns(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


def list_chat_files(data: str | Path, notes: list[Finding] | None = None) -> list[Path]:
    """`data` itself, or the chat files of a directory (recursively, sorted).

    A `.json` file of a directory is read when it is JSON Lines (as `Dataset.to_json` writes it)
    and left out when it is one JSON document (a pretty-printed config.json or stats.json:
    `records.json_document`); `notes` receives a finding naming the files a scan left out, but
    for hidden files and dflash-generate's sidecars."""
    path = Path(data)
    if path.is_file():
        return [path]
    if not path.exists():
        raise InputError(Finding("prepare.data-missing", file=str(path)))
    files, left_out = [], []
    for p in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                    and not p.name.endswith(SIDECAR_SUFFIXES)):
        if p.name.endswith(CHAT_SUFFIXES) or (p.name.endswith(".json") and json_document(p) is None):
            files.append(p)
        else:
            left_out.append(p)
    if left_out and notes is not None:
        notes.append(Finding("prepare.data-files-left-out", dir=str(path),
                             files=[str(p.relative_to(path)) for p in left_out]))
    if not files:
        raise InputError(Finding("prepare.data-no-chat-files", dir=str(path), files=[p.name for p in left_out[:8]]))
    return files


def detect_format(rec: dict[str, Any]) -> str:
    if "messages" in rec:
        return "messages"
    if "conversations" in rec:
        return "sharegpt"
    if any(p in rec for p, _ in PROMPT_KEYS):
        return "prompt"
    raise BadChatRecord(Finding("prepare.record-shape", keys=sorted(rec)[:8]))


def _content(value: Any, what: str) -> Any:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # OpenAI content parts: text-only ones become one string (templates written for text
        # often render a list as nothing); others are passed to the template as they are.
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            return "".join(p["text"] for p in value)
        return value
    raise BadChatRecord(Finding("prepare.record-field-type", field=what, expected="a string or a list of content parts",
                                type=type(value).__name__))


def _normalize_message(m: Any, index: int) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise BadChatRecord(Finding("prepare.record-field-type", field=f"message {index}", expected="an object"))
    role = m.get("role")
    if role not in ROLES:
        raise BadChatRecord(Finding("prepare.record-role", message=index, role=role, roles=list(ROLES)))
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = _content(m.get("content"), f"message {index}'s content")
    if "tool_calls" in out:
        calls = out["tool_calls"]
        if not isinstance(calls, list):
            raise BadChatRecord(Finding("prepare.record-field-type", field=f"message {index}'s tool_calls", expected="a list"))
        out["tool_calls"] = parse_tool_arguments(calls)
    return out


def parse_tool_arguments(calls: list) -> list:
    """Tool calls with JSON-string arguments parsed to mappings (what templates read; datasets
    and the OpenAI API store a string). Arguments that are not JSON are left as they are."""
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                c = {**c, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except json.JSONDecodeError:
                pass
        out.append(c)
    return out


def to_messages(rec: dict[str, Any], fmt: str) -> tuple[list[dict[str, Any]], list | None]:
    """(messages, tools) of one record in format `fmt` (not "auto")."""
    tools = rec.get("tools")
    if isinstance(tools, str):  # Parquet exports often store nested fields as JSON text
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise BadChatRecord(Finding("prepare.record-tools-json")) from None
    if tools is not None and not isinstance(tools, list):
        raise BadChatRecord(Finding("prepare.record-field-type", field="tools", expected="a list of tool schemas"))
    if fmt == "messages":
        msgs = rec.get("messages")
        if not isinstance(msgs, list):
            raise BadChatRecord(Finding("prepare.record-field-type", field="messages",
                                        expected="a list of {role, content} objects"))
        return [_normalize_message(m, i) for i, m in enumerate(msgs)], tools
    if fmt == "sharegpt":
        conv = rec.get("conversations")
        if not isinstance(conv, list):
            raise BadChatRecord(Finding("prepare.record-field-type", field="conversations",
                                        expected="a list of {from, value} objects"))
        msgs = []
        for i, turn in enumerate(conv):
            if not isinstance(turn, dict) or "from" not in turn:
                raise BadChatRecord(Finding("prepare.record-turn-role", turn=i, role=None))
            role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
            if role is None:
                raise BadChatRecord(Finding("prepare.record-turn-role", turn=i, role=turn["from"]))
            msgs.append({"role": role, "content": _content(turn.get("value"), f"turn {i}'s value")})
        if isinstance(rec.get("system"), str) and not (msgs and msgs[0]["role"] == "system"):
            msgs.insert(0, {"role": "system", "content": rec["system"]})
        return msgs, tools
    if fmt == "prompt":
        for p, r in PROMPT_KEYS:
            if p in rec:
                prompt = rec[p]
                if p == "instruction" and rec.get("input"):
                    prompt = f"{prompt}\n\n{rec['input']}"
                msgs = [{"role": "user", "content": _content(prompt, p)}]
                if rec.get(r) is not None:  # prompt-only records: dflash-generate answers them
                    msgs.append({"role": "assistant", "content": _content(rec[r], r)})
                if isinstance(rec.get("system"), str) and rec["system"]:
                    msgs.insert(0, {"role": "system", "content": rec["system"]})
                return msgs, tools
        raise BadChatRecord(Finding("prepare.record-no-prompt"))
    raise ValueError(f"unknown format {fmt!r}")


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield line_no, json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    yield line_no, BadChatRecord(Finding("prepare.record-json", error=str(e)))
    except (OSError, EOFError) as e:
        raise InputError(Finding("prepare.data-unreadable", file=str(path), error=str(e))) from e


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(Finding("prepare.parquet-needs-pyarrow", file=str(path))) from None
    try:
        pf = pq.ParquetFile(path)
        row = 0
        for batch in pf.iter_batches(batch_size=1024):
            for rec in batch.to_pylist():
                row += 1
                yield row, rec
    except OSError as e:
        raise InputError(Finding("prepare.data-unreadable", file=str(path), error=str(e))) from e


def iter_conversations(files: list[Path], fmt: str = "auto", group_key: str = "group"
                       ) -> Iterator[Conversation | tuple[str, str]]:
    """Every record of `files` in order: a Conversation, or (where, finding) for a bad record;
    a record's `group_key` field, when it has one, is its group."""
    for path in files:
        rows = _iter_parquet(path) if path.name.endswith(".parquet") else _iter_jsonl(path)
        unit = "row" if path.name.endswith(".parquet") else "line"
        for number, rec in rows:
            where = f"{path}, {unit} {number}"
            try:
                if isinstance(rec, BadChatRecord):
                    raise rec
                if not isinstance(rec, dict):
                    raise BadChatRecord(Finding("prepare.record-field-type", field="the record", expected="a JSON object"))
                shape = detect_format(rec) if fmt == "auto" else fmt
                messages, tools = to_messages(rec, shape)
                rid = rec.get("id")
                if rid is not None and not isinstance(rid, str | int):
                    raise BadChatRecord(Finding("prepare.record-field-type", field="id", expected="a string or an integer"))
                group = rec.get(group_key)
                if group is not None and (isinstance(group, bool) or not isinstance(group, str | int)):
                    raise BadChatRecord(Finding("prepare.record-field-type", field=group_key,
                                                expected="a string or an integer (the record's group)"))
                yield Conversation(id=str(rid) if rid is not None else f"{path.name}:{number}",
                                   where=where, messages=messages, tools=tools, group=group)
            except BadChatRecord as e:
                yield where, e.finding
