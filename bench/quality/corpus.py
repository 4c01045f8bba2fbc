"""The benchmark's corpora, from installed packages: no network is needed.

Every machine with the project installed has torch, transformers and numpy (and torch's own
dependencies sympy and networkx). Two domains come from them:

- `code`: their Python source files (tens of MB, thousands of files, repeated identifiers and
  boilerplate: the kind of text prompt lookup is good at);
- `prose`: the English of their docstrings (about 10 MB): the paragraphs of each file's module,
  class and function docstrings that read as sentences (no doctest, signature, section header
  or parameter line), one document per source file.

Files are split into a training and a held-out set by a hash of their path inside the
package, so the split does not depend on the package's install location nor on which other
files exist; evaluation prompts and the target's held-out loss come only from held-out files.
The token ids come from vocab.py (bytes, or a BPE learned from the training documents).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from vocab import BYTE_VOCAB_SIZE, Encoded

PAD_ID, BOS_ID, EOS_ID, MASK_ID = 256, 257, 258, 259
"""The byte vocabulary's specials (vocab.ByteVocabulary)."""
VOCAB_SIZE = BYTE_VOCAB_SIZE
DOMAINS = ("code", "prose")


@dataclass(frozen=True)
class Document:
    name: str
    """`package/relative/path.py`: the key of the split."""
    data: bytes


class CorpusError(RuntimeError):
    """The corpus cannot be built on this machine."""


def package_root(package: str) -> Path:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"package {package!r} is not installed here; the benchmark reads its source files "
                          "(pass other --packages that are installed).")
    return Path(next(iter(spec.submodule_search_locations)))


def is_held_out(name: str, held_out_percent: int) -> bool:
    """Whether a document belongs to the held-out set (a hash of its name, stable across machines)."""
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "little") % 100 < held_out_percent


def is_prompt_file(name: str, prompt_percent: int) -> bool:
    """Whether a training document is one of the drafter's prompt files (another hash of its name,
    independent of is_held_out's): the target does not train on them."""
    return int.from_bytes(hashlib.sha1(b"prompt:" + name.encode()).digest()[:4], "little") % 100 < prompt_percent


_DOCSTRING = re.compile(r'(?:\A|:[ \t]*(?:#[^\n]*)?\n)[ \t]*[rRuU]?("""|\'\'\')(.*?)\1', re.S)
"""A module docstring, or a string right after a `def`/`class` header's colon."""
_NOT_PROSE_LINE = re.compile(r"^\s*(?:[-=~^]{3,}|\w[\w, ]* : .*|\S+:)\s*$", re.M)
"""A section header (`Args:`, `Returns`+underline) or a numpy parameter line (`x : array_like`)."""
_CODE_STARTS = (">>>", "...", "$ ", "|", "+-", "..", "#")
_SENTENCE = re.compile(r"[a-z]{3,} [a-z]{3,} [a-z]{2,}")


def is_prose(paragraph: str) -> bool:
    """Whether a docstring paragraph reads as English sentences: 8+ words, mostly letters and
    punctuation, three lowercase words in a row, no code, table or section lines."""
    if any(line.lstrip().startswith(_CODE_STARTS) for line in paragraph.splitlines()):
        return False
    if _NOT_PROSE_LINE.search(paragraph) or len(paragraph.split()) < 8:
        return False
    if sum(c.isalpha() or c in " \n,.;:'()-" for c in paragraph) < 0.9 * len(paragraph):
        return False
    return _SENTENCE.search(paragraph) is not None


def docstring_prose(source: str) -> str:
    """The prose paragraphs of a Python file's docstrings, blank-line separated ('' if none)."""
    kept = []
    for match in _DOCSTRING.finditer(source):
        for paragraph in re.split(r"\n\s*\n", inspect.cleandoc(match.group(2))):
            if is_prose(paragraph):
                kept.append(paragraph.strip())
    return "\n\n".join(kept) + "\n" if kept else ""


def load_corpus(packages: list[str], held_out_percent: int, max_files: int = 0,
                min_bytes: int = 256, domain: str = "code") -> tuple[list[Document], list[Document]]:
    """(training, held-out) documents of `packages`, sorted by name: every `*.py` of at least
    `min_bytes` (code), or the docstring prose of every `*.py` that has at least `min_bytes` of
    it (prose); `max_files` > 0 keeps only the first that many of each set."""
    if domain not in DOMAINS:
        raise CorpusError(f"domain {domain!r} is not one of {', '.join(DOMAINS)}.")
    train: list[Document] = []
    held: list[Document] = []
    for package in packages:
        root = package_root(package)
        for path in sorted(root.rglob("*.py")):
            name = f"{package}/{path.relative_to(root).as_posix()}"
            try:
                data = path.read_bytes()
            except OSError:
                continue  # an unreadable file is not part of the corpus
            if domain == "prose":
                data = docstring_prose(data.decode("utf-8", "replace")).encode()
            if len(data) < min_bytes:
                continue
            (held if is_held_out(name, held_out_percent) else train).append(Document(name, data))
    if max_files:
        train, held = train[:max_files], held[: max(2, max_files // 8)]
    if not train or not held:
        raise CorpusError(f"packages {packages} give {len(train)} training and {len(held)} held-out {domain} "
                          "files; both need at least one (add --set packages=...).")
    return train, held


def corpus_digest(documents: list[Document]) -> str:
    """A short digest of names and contents: two runs compare only when it is the same."""
    h = hashlib.sha1()
    for d in documents:
        h.update(d.name.encode())
        h.update(hashlib.sha1(d.data).digest())
    return h.hexdigest()[:12]


def token_stream(encoded: list[Encoded], bos_id: int, eos_id: int) -> np.ndarray:
    """`<bos> tokens <eos>` for every document, back to back (the target's training text)."""
    parts = []
    for e in encoded:
        parts += [np.array([bos_id], dtype=np.int32), e.tokens, np.array([eos_id], dtype=np.int32)]
    return np.concatenate(parts)


def cut_prompts(encoded: list[Encoded], count: int, lengths: list[int], seed: int,
                tail: int = 0, sources: list[int] | None = None) -> list[list[int]]:
    """`count` prompts of the given token lengths (cycled), each starting at a line start of a
    document picked with probability proportional to its tokens; `tail` tokens must follow the
    prompt in the document. `sources`, when given, gets the index in `encoded` of each prompt's
    document (the same draws either way)."""
    r = random.Random(seed)
    weights = [len(e.tokens) for e in encoded]
    prompts = []
    for i in range(count):
        length = lengths[i % len(lengths)]
        for _ in range(100):
            k = r.choices(range(len(encoded)), weights)[0]
            e = encoded[k]
            last = len(e.tokens) - length - tail  # the latest start that leaves room
            if last < 1:
                continue
            start = r.randrange(0, last)
            at = int(np.searchsorted(e.line_starts, start))  # the first line start at or after it
            if at == len(e.line_starts) or e.line_starts[at] >= last:
                continue
            start = int(e.line_starts[at])
            prompts.append(e.tokens[start : start + length].tolist())
            if sources is not None:
                sources.append(k)
            break
        else:
            raise CorpusError(f"no document holds {length + tail} tokens; use shorter prompts or more files.")
    return prompts
