"""The target's vocabulary: bytes, or a byte-level BPE learned from the training documents.

`bytes`: the 256 byte values and four specials (ids 256..259), padded with ids no text uses
up to `size`. `bpe`: a byte-level BPE of `size` ids (the four specials first, then the 256
byte symbols, then merges) trained by the `tokenizers` library (a transformers dependency)
on the training documents in name order. The training is deterministic: the same documents
give the same vocabulary on any machine (the corpus digest says whether the documents are the
same). The learned tokenizer is saved with the target (tokenizer.json, as a real target has
one), so later stages and dflash-eval read the same one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SPECIALS = ("<pad>", "<bos>", "<eos>", "<mask>")
BYTE_VOCAB_SIZE = 260
"""256 bytes and the four specials (pad, bos, eos, mask at 256..259)."""


@dataclass(frozen=True)
class Encoded:
    """One document as token ids, and which positions start a line."""

    tokens: np.ndarray
    """int32 token ids."""
    line_starts: np.ndarray
    """Sorted token positions whose text begins right after a newline (or the document's start)."""


class Vocabulary:
    """Token ids of the benchmark's text: `encode` documents, the special ids, the size."""

    kind: str
    size: int
    pad_id: int
    bos_id: int
    eos_id: int
    mask_id: int

    def encode(self, texts: list[bytes]) -> list[Encoded]:
        raise NotImplementedError

    def save(self, target_dir: Path) -> None:
        """Write the tokenizer beside the target's weights (nothing for bytes)."""


class ByteVocabulary(Vocabulary):
    kind = "bytes"

    def __init__(self, size: int = BYTE_VOCAB_SIZE) -> None:
        if size < BYTE_VOCAB_SIZE:
            raise ValueError(f"vocab_size {size} is below the {BYTE_VOCAB_SIZE} ids of the bytes and specials.")
        self.size = size
        self.pad_id, self.bos_id, self.eos_id, self.mask_id = 256, 257, 258, 259

    def encode(self, texts: list[bytes]) -> list[Encoded]:
        out = []
        for data in texts:
            tokens = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
            starts = np.flatnonzero(tokens[:-1] == ord("\n")) + 1
            out.append(Encoded(tokens, np.concatenate([[0], starts]).astype(np.int64)))
        return out


class BpeVocabulary(Vocabulary):
    kind = "bpe"

    def __init__(self, tokenizer: Any, size: int) -> None:
        learned = tokenizer.get_vocab_size()
        if learned > size:
            raise ValueError(f"the tokenizer has {learned} ids, more than vocab_size {size}.")
        self.tokenizer, self.size = tokenizer, size  # a smaller learned vocabulary leaves ids unused
        self.pad_id, self.bos_id, self.eos_id, self.mask_id = (tokenizer.token_to_id(t) for t in SPECIALS)

    def encode(self, texts: list[bytes]) -> list[Encoded]:
        strings = [t.decode("utf-8", "replace") for t in texts]
        out = []
        for text, enc in zip(strings, self.tokenizer.encode_batch(strings, add_special_tokens=False)):
            starts = [i for i, (a, _) in enumerate(enc.offsets) if a == 0 or text[a - 1] == "\n"]
            out.append(Encoded(np.asarray(enc.ids, dtype=np.int32), np.asarray(starts, dtype=np.int64)))
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def save(self, target_dir: Path) -> None:
        from transformers import PreTrainedTokenizerFast

        pad, bos, eos, mask = SPECIALS
        PreTrainedTokenizerFast(tokenizer_object=self.tokenizer, pad_token=pad, bos_token=bos, eos_token=eos,
                                mask_token=mask).save_pretrained(str(target_dir))


def train_bpe(texts: list[bytes], size: int, max_bytes: int = 0) -> BpeVocabulary:
    """A byte-level BPE of `size` ids learned from `texts` in their order (the first `max_bytes`
    of them when > 0: the merges of a few tens of MB are the merges of more)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if size < len(SPECIALS) + 256:
        raise ValueError(f"vocab_size {size} leaves no room for merges (the specials and 256 bytes take "
                         f"{len(SPECIALS) + 256}).")
    chosen, total = [], 0
    for t in texts:
        if max_bytes and total >= max_bytes:
            break
        chosen.append(t.decode("utf-8", "replace"))
        total += len(t)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=list(SPECIALS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(chosen, trainer, length=len(chosen))
    return BpeVocabulary(tokenizer, size)


def load_vocabulary(kind: str, size: int, target_dir: Path) -> Vocabulary:
    """The vocabulary of a trained target (its tokenizer.json for bpe)."""
    if kind == "bytes":
        return ByteVocabulary(size)
    from tokenizers import Tokenizer

    return BpeVocabulary(Tokenizer.from_file(str(target_dir / "tokenizer.json")), size)


def vocabulary_digest(vocab: Vocabulary) -> str:
    """A short digest of the vocabulary (bpe: its merges and ids; bytes: its size)."""
    import hashlib

    if isinstance(vocab, BpeVocabulary):
        model = json.loads(vocab.tokenizer.to_str())["model"]
        text = json.dumps([sorted(model["vocab"].items()), model["merges"]])
    else:
        text = f"bytes-{vocab.size}"
    return hashlib.sha1(text.encode()).hexdigest()[:12]
