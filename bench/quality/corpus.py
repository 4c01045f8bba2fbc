"""The benchmark's corpus: Python source files of installed packages, as bytes.

Every machine with the project installed has torch, transformers and numpy, and their
sources are a real code corpus (tens of MB, thousands of files, repeated identifiers and
boilerplate: the kind of text prompt lookup is good at). No network is needed.

Files are split into a training and a held-out set by a hash of their path inside the
package, so the split does not depend on the package's install location nor on which other
files exist; evaluation prompts and the target's held-out loss come only from held-out files.
Tokens are bytes (0..255) plus four specials.
"""

from __future__ import annotations

import hashlib
import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path

PAD_ID, BOS_ID, EOS_ID, MASK_ID = 256, 257, 258, 259
VOCAB_SIZE = 260


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


def load_corpus(packages: list[str], held_out_percent: int, max_files: int = 0,
                min_bytes: int = 256) -> tuple[list[Document], list[Document]]:
    """(training, held-out) documents: every `*.py` of `packages` of at least `min_bytes`,
    sorted by name; `max_files` > 0 keeps only the first that many of each set."""
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
            if len(data) < min_bytes:
                continue
            (held if is_held_out(name, held_out_percent) else train).append(Document(name, data))
    if max_files:
        train, held = train[:max_files], held[: max(2, max_files // 8)]
    if not train or not held:
        raise CorpusError(f"packages {packages} give {len(train)} training and {len(held)} held-out files; "
                          "both need at least one (add --packages).")
    return train, held


def corpus_digest(documents: list[Document]) -> str:
    """A short digest of names and contents: two runs compare only when it is the same."""
    h = hashlib.sha1()
    for d in documents:
        h.update(d.name.encode())
        h.update(hashlib.sha1(d.data).digest())
    return h.hexdigest()[:12]


def token_stream(documents: list[Document]) -> list[int]:
    """`<bos> bytes <eos>` for every document, back to back (the target's training text)."""
    out: list[int] = []
    for d in documents:
        out.append(BOS_ID)
        out.extend(d.data)
        out.append(EOS_ID)
    return out


def cut_prompts(documents: list[Document], count: int, lengths: list[int], seed: int,
                tail: int = 0) -> list[list[int]]:
    """`count` prompts of the given byte lengths (cycled), each starting at a line start of a
    document picked with probability proportional to its size; `tail` bytes must follow the
    prompt in the document."""
    r = random.Random(seed)
    weights = [len(d.data) for d in documents]
    prompts = []
    for i in range(count):
        length = lengths[i % len(lengths)]
        for _ in range(100):
            d = r.choices(documents, weights)[0].data
            if len(d) < length + tail + 1:
                continue
            start = r.randrange(0, len(d) - length - tail)
            if start:
                newline = d.find(b"\n", start, len(d) - length - tail)
                if newline < 0:
                    continue
                start = newline + 1
            prompts.append(list(d[start : start + length]))
            break
        else:
            raise CorpusError(f"no document holds {length + tail} bytes; use shorter prompts or more files.")
    return prompts
