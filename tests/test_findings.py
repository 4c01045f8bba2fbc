"""Findings: codes and fields, one renderer per code (runtime/findings.py).

Every code stated in the product source has a renderer, every renderer is used, and every
renderer renders its own example as one paragraph; an error built from a finding keeps its
class, carries the code and fields, and survives a pickle (DataLoader workers send errors so)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pickle
from pathlib import Path

import pytest
from dflash.runtime.errors import InputError, MismatchError
from dflash.runtime.findings import Finding, collected, emit, registered, render, renders

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "cache_tools", "extract", "prepare", "train", "eval", "demo")


def _all_registered() -> dict:
    for package in PACKAGES:  # and each subpackage (train/data/, ...): its __init__ registers its messages
        for init in sorted((ROOT / package).rglob("__init__.py")):
            importlib.import_module(".".join(("dflash", *init.parent.relative_to(ROOT).parts)))
    return {code: r for code, r in registered().items() if not code.startswith("test.")}


# The codes a command gives runtime.cli's contract (its stop, OSError, out-of-memory and compile findings),
# as `stop_note="x.stopped"` or a class attribute `stop_note = "x.stopped"`.
CONTRACT_CODES = ("stop_note", "os_error_advice", "oom_advice", "compile_advice")


def _code_given(node: ast.AST) -> ast.Constant | None:
    """The code constant that `node` states: `Finding("code", ...)`, or a contract code."""
    if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Finding"
            and node.args and isinstance(node.args[0], ast.Constant)):
        return node.args[0]
    if isinstance(node, ast.keyword) and node.arg in CONTRACT_CODES and isinstance(node.value, ast.Constant):
        return node.value
    if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) in CONTRACT_CODES for t in node.targets)
            and isinstance(node.value, ast.Constant)):
        return node.value
    return None


def _codes_in_source() -> dict[str, list[str]]:
    """{code: [file:line, ...]} of every `Finding("code", ...)` (or contract code) in the product source."""
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (code := _code_given(node)) is not None:
                    found.setdefault(code.value, []).append(f"{path.relative_to(ROOT)}:{code.lineno}")
    return found


def test_every_code_in_the_source_has_a_renderer_and_every_renderer_is_used():
    have, used = _all_registered(), _codes_in_source()
    assert not sorted(set(used) - set(have)), {c: used[c] for c in set(used) - set(have)}
    assert not sorted(set(have) - set(used))


@pytest.mark.parametrize("code", sorted(_all_registered()))
def test_each_renderer_renders_its_example_as_one_short_paragraph(code):
    entry = registered()[code]
    params = inspect.signature(entry.render).parameters
    assert set(entry.example) <= set(params), "the example names a field the renderer does not take"
    text = render(Finding(code, **entry.example))
    assert text and "\n" not in text and len(text) <= 900
    assert code.split(".")[0] in {"runtime", "cache", "extract", "prepare", "train", "eval", "demo"}


def test_an_error_from_a_finding_keeps_its_class_code_fields_and_text_and_pickles():
    @renders("test.sample", example={"file": "a", "sample": 1})
    def _(file, sample):
        return f"Sample {sample} of {file} is empty.\n Remove it."

    e = InputError(Finding("test.sample", file="data.jsonl", sample=7))
    assert isinstance(e, InputError) and e.code == "test.sample" and e.fields == {"file": "data.jsonl", "sample": 7}
    assert str(e) == "Sample 7 of data.jsonl is empty. Remove it."
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is InputError and back.code == e.code and back.fields == e.fields and str(back) == str(e)
    assert MismatchError("plain words").code is None and MismatchError("plain words").fields == {}


def test_a_second_renderer_for_a_code_is_refused():
    @renders("test.once", example={})
    def first():
        return "once"

    with pytest.raises(ValueError):
        @renders("test.once", example={})
        def second():
            return "twice"


def test_emitted_notices_are_collected_with_their_fields_and_printed_once(capsys):
    @renders("test.notice", example={"flag": "--x"})
    def _(flag):
        return f"{flag} is ignored here."

    with collected() as got:
        emit(Finding("test.notice", flag="--lr"))
    assert [(f.code, f.fields) for f in got] == [("test.notice", {"flag": "--lr"})]
    assert capsys.readouterr().err.count("--lr is ignored here.") == 1


def test_a_code_without_renderer_still_reads_as_code_and_fields():
    assert render(Finding("test.unregistered", part=3)) == "test.unregistered: part=3"
