"""Findings: what a command tells its user, as data.

A finding is a code and its fields (the file, sample, part, flag and values it is about). Its
text comes from the one renderer registered for its code, so the code that finds something
states data, and a test asserts data, not wording:

    raise CacheCorruptError(Finding("cache.chunk-checksum", file=path, chunk=key))
    emit(Finding("train.init-other-target", init=init_dir, trained=a, here=b))

Codes are `<package>.<name>` (`cache.`, `extract.`, `prepare.`, `train.`, `eval.`, `demo.`,
`runtime.`); each package, and each subpackage that has findings of its own (train/data/, ...),
keeps its renderers in its `messages` module, which its `__init__` imports, so that importing
any module of it registers them:

    @renders("cache.chunk-checksum", example=dict(file="cache/p-0001/hidden", chunk="0.0"))
    def _(file, chunk):
        return f"Chunk {chunk} of {file} does not match its checksum. Run dflash-cache verify ..."

A renderer takes the fields as keyword arguments and returns one paragraph that says what was
wrong, where, and what to do; `example` holds fields it renders for its own test
(tests/test_findings.py renders every registered code). An error of the family
(`dflash.runtime.errors`) built from a finding carries it (`error.finding`, `.code`, `.fields`)
and reads as its text, so a refusal keeps its class, its exit status and its one paragraph.
Notices go through `emit`, which prints them and lets a test collect them (`collected`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

Renderer = Callable[..., str]


@dataclass(frozen=True)
class Registered:
    code: str
    render: Renderer
    example: Mapping[str, Any]


_REGISTRY: dict[str, Registered] = {}


class Finding:
    """A code and its fields; `str()` is the code's rendered paragraph."""

    __slots__ = ("code", "fields")

    def __init__(self, code: str, /, **fields: Any):
        self.code = code
        self.fields = fields

    def __str__(self) -> str:
        return render(self)

    def __repr__(self) -> str:
        return f"Finding({self.code!r}, {', '.join(f'{k}={v!r}' for k, v in self.fields.items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Finding) and (self.code, self.fields) == (other.code, other.fields)

    def __hash__(self) -> int:
        return hash(self.code)


def renders(code: str, *, example: Mapping[str, Any]) -> Callable[[Renderer], Renderer]:
    """Register `fn` as the renderer of `code` (one per code: a second is refused at import)."""
    if "." not in code:
        raise ValueError(f"finding code {code!r} is not <package>.<name>")

    def register(fn: Renderer) -> Renderer:
        old = _REGISTRY.get(code)
        if old is not None and (old.render.__module__, old.render.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"finding code {code!r} has a renderer already ({old.render.__module__})")
        _REGISTRY[code] = Registered(code, fn, dict(example))
        return fn

    return register


def registered() -> dict[str, Registered]:
    """Every code with a renderer, of the packages imported so far."""
    return dict(_REGISTRY)


def paragraph(text: str) -> str:
    """`text` as one paragraph: every run of whitespace (newlines included) becomes one space."""
    return " ".join(str(text).split())


def render(finding: Finding) -> str:
    """The finding's paragraph. A code with no renderer (a bug: tests/test_findings.py checks
    every code in the source has one) still reads, as its code and fields."""
    entry = _REGISTRY.get(finding.code)
    if entry is None:
        return f"{finding.code}: " + ", ".join(f"{k}={v}" for k, v in finding.fields.items())
    return paragraph(entry.render(**finding.fields))


@dataclass
class _Collector:
    findings: list[Finding] = field(default_factory=list)
    echo: bool = True


_COLLECTORS: list[_Collector] = []


def emit(finding: Finding, *, prefix: str = "Note: ", stream: TextIO | None = None) -> None:
    """Tell the user `finding` (a notice: the command goes on): one paragraph on stderr."""
    for c in _COLLECTORS:
        c.findings.append(finding)
    if not _COLLECTORS or any(c.echo for c in _COLLECTORS):
        print(prefix + render(finding), file=stream if stream is not None else sys.stderr, flush=True)


@contextlib.contextmanager
def collected(*, echo: bool = True) -> Iterator[list[Finding]]:
    """The findings emitted inside the block (tests assert their codes and fields)."""
    c = _Collector(echo=echo)
    _COLLECTORS.append(c)
    try:
        yield c.findings
    finally:
        _COLLECTORS.remove(c)


def codes(findings: list[Finding]) -> list[str]:
    return [f.code for f in findings]
