"""Prompt lookup's proposals, and its verification walk replayed along a known text.

Prompt lookup (n-gram drafting, no weights) is the free baseline a trained drafter has to beat:
`dflash-eval` decodes it beside every drafter (eval/lookup.py), and the trainer replays it on
its held-out samples (`lookup_walk`), so that its held-out tau stands beside the baseline's on
the same text. Its proposals depend on the text alone, so on a greedy completion the replay is
the decoder's walk, cycle for cycle. numpy only: the trainer's evaluation and dflash-eval share it.

Rules (fixed, so figures are comparable):
- the longest suffix that occurs earlier wins: `n = max_ngram`, then `n - 1`, ... down to
  `min_ngram`; no occurrence at any n: no proposal (the cycle is a plain target step);
- among the occurrences of that suffix, the latest one that still has `B-1` tokens after it,
  otherwise the one with the most tokens after it (the earliest); the proposal is what follows
  it, at most `B-1` tokens, fewer when the occurrence lies near the end of the text.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

DEFAULT_MAX_NGRAM = 4


def lookup_proposal(tokens: Sequence[int] | np.ndarray, max_tokens: int, max_ngram: int = DEFAULT_MAX_NGRAM,
                    min_ngram: int = 1) -> list[int]:
    """The tokens prompt lookup proposes after `tokens` (whose last token is the anchor).

    At most `max_tokens`; empty when no suffix of `min_ngram`..`max_ngram` tokens occurs
    earlier (see the module docstring for which occurrence is used).
    """
    if max_tokens < 1 or min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need max_tokens >= 1 and 1 <= min_ngram <= max_ngram, got "
                         f"max_tokens={max_tokens}, min_ngram={min_ngram}, max_ngram={max_ngram}.")
    text = np.asarray(tokens, dtype=np.int64)
    length = len(text)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # Windows of n tokens that end before the last token (so at least one token follows).
        windows = np.lib.stride_tricks.sliding_window_view(text[: length - 1], n)
        starts = np.flatnonzero((windows == text[length - n :]).all(axis=1))
        if len(starts) == 0:
            continue
        follow = starts + n  # where each occurrence's continuation begins
        full = follow[follow + max_tokens <= length]
        begin = int(full[-1]) if len(full) else int(follow[0])
        return text[begin : begin + max_tokens].tolist()
    return []


def lookup_walk(tokens: Sequence[int] | np.ndarray, anchors: Sequence[int], block_size: int,
                scored: Sequence[bool] | np.ndarray | None = None,
                max_ngram: int = DEFAULT_MAX_NGRAM) -> tuple[int, int]:
    """(tokens, cycles) of prompt lookup's verification walked along `tokens` as the trainer
    walks its drafter (train/measure/metrics.py, VerificationWalk): the first block at the first of
    `anchors` (the eligible positions: completion tokens followed by another), each proposal made
    from the text up to its anchor (`lookup_proposal`'s) and accepted while it matches the text,
    at most `block_size - 1` tokens and only over `scored` positions (the completion's: the loss
    mask; all of the text when None), the next block `accepted + 1` on, for as long as that
    position is an anchor. On a greedy completion this is what `dflash-eval` measures for prompt
    lookup there (its last cycle cut at the completion's end).

    The proposals come from an index of the text's n-grams grown as the walk moves on, so a walk
    costs about one pass over the text (`lookup_proposal` per anchor would cost one pass per
    cycle: minutes for a few thousand samples of a few thousand tokens)."""
    text = [int(t) for t in np.asarray(tokens, dtype=np.int64).tolist()]
    mask = [True] * len(text) if scored is None else [bool(m) for m in np.asarray(scored, dtype=bool)[: len(text)]]
    eligible = set(int(p) for p in anchors)
    if not eligible:
        return 0, 0
    width = block_size - 1
    starts: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram + 1)]  # n -> n-gram -> starts
    indexed = 0  # n-grams ending before this position are indexed
    walked = cycles = 0
    p = min(eligible)
    while p in eligible:
        for end in range(indexed, p):  # every n-gram that ends before the anchor
            for n in range(1, min(max_ngram, end + 1) + 1):
                starts[n].setdefault(tuple(text[end - n + 1 : end + 1]), []).append(end - n + 1)
        indexed = max(indexed, p)
        proposal: list[int] = []
        for n in range(min(max_ngram, p), 0, -1):  # the longest suffix that occurs earlier
            found = starts[n].get(tuple(text[p - n + 1 : p + 1]))
            if not found:
                continue
            # the latest occurrence with `width` tokens after it in the text so far, else the earliest
            full = bisect.bisect_right(found, p + 1 - n - width) - 1
            begin = (found[full] if full >= 0 else found[0]) + n
            proposal = text[begin : min(begin + width, p + 1)]
            break
        accepted = 0
        while (accepted < len(proposal) and p + 1 + accepted < len(text) and mask[p + 1 + accepted]
               and text[p + 1 + accepted] == proposal[accepted]):
            accepted += 1
        walked, cycles = walked + accepted + 1, cycles + 1
        p += accepted + 1
    return walked, cycles


_KEPT: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
"""Walks of texts seen (by a digest of what they read, so that long samples do not stay in
memory): a held-out sample's text is the same at the trainer's startup and every evaluation."""
_KEEP = 1 << 16


def sample_lookup_walk(ids: np.ndarray, mask: np.ndarray, block_size: int) -> tuple[int, int]:
    """lookup_walk of one sample (its ids and loss mask, cut to its length) from the trainer's
    eligible positions (completion tokens followed by another), kept for the next call over the
    same sample (at most 65,536 walks kept, by a digest of what they read)."""
    ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
    key = hashlib.blake2b(b"".join((ids.tobytes(), mask.tobytes(), block_size.to_bytes(4, "little"))),
                          digest_size=16).digest()
    walked = _KEPT.get(key)
    if walked is None:
        anchors = np.flatnonzero(mask[:-1] & mask[1:])
        walked = _KEPT[key] = lookup_walk(ids, anchors, block_size, scored=mask)
        if len(_KEPT) > _KEEP:
            _KEPT.popitem(last=False)
    return walked
