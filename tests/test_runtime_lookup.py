"""Prompt lookup's walk over a known text (runtime/lookup.py): the trainer replays it on its held-out
samples, so it must be exactly the walk that proposing with `lookup_proposal` at every anchor gives."""

from __future__ import annotations

import numpy as np
from dflash.runtime.lookup import lookup_proposal, lookup_walk


def _walk_by_proposals(text: np.ndarray, anchors: list[int], block: int, scored: np.ndarray) -> tuple[int, int]:
    eligible, walked, cycles = set(anchors), 0, 0
    p = min(eligible) if eligible else None
    while p in eligible:
        proposal = lookup_proposal(text[: p + 1], block - 1)
        accepted = 0
        while (accepted < len(proposal) and p + 1 + accepted < len(text) and scored[p + 1 + accepted]
               and text[p + 1 + accepted] == proposal[accepted]):
            accepted += 1
        walked, cycles, p = walked + accepted + 1, cycles + 1, p + accepted + 1
    return walked, cycles


def test_the_indexed_walk_is_the_walk_of_lookup_proposals_at_every_anchor():
    rng = np.random.default_rng(0)
    accepted_any = 0
    for trial in range(200):
        length, vocab = int(rng.integers(2, 120)), int(rng.integers(2, 12))
        text = rng.integers(0, vocab, length)
        if trial % 3 == 0:  # text that repeats itself, where lookup proposes long runs
            chunk = rng.integers(0, 50, int(rng.integers(3, 20)))
            text = np.concatenate([chunk] * int(rng.integers(2, 6)))
        scored = rng.random(len(text)) > 0.1  # a loss mask with gaps (turns of a conversation)
        start = int(rng.integers(0, len(text)))
        anchors = [q for q in range(start, len(text) - 1) if scored[q] and scored[q + 1]]
        block = int(rng.integers(2, 17))
        got = lookup_walk(text, anchors, block, scored=scored)
        assert got == _walk_by_proposals(text, anchors, block, scored), (trial, got)
        accepted_any += got[0] > got[1]
    assert accepted_any > 50  # most walks accepted drafts: the comparison covers proposals, not only misses


def test_a_walk_stops_at_the_anchors_end_and_accepts_only_scored_tokens():
    text = [1, 2, 3, 1, 2, 3, 1, 2]
    # Anchors 2..6, block 5. At 2 nothing earlier ends in 3: no proposal, 1 token. At 3 "1"
    # occurred at 0: it proposes what followed, 2 3 1 (the text so far holds no more), and all 3
    # are the text's next tokens: 4 tokens, on to 7, past the anchors.
    assert lookup_walk(text, range(2, 7), 5) == (1 + 4, 2)
    assert lookup_walk(text, [], 5) == (0, 0)
    # Positions 5.. not scored (another turn's prompt): at 3 only the 2 at 4 is accepted, and the
    # blocks at 5 and 6 accept nothing.
    assert lookup_walk(text, range(2, 7), 5, scored=[True] * 5 + [False] * 3) == (1 + 2 + 1 + 1, 4)
