"""Prompt lookup: the free baseline a trained drafter has to beat.

An n-gram drafter with no weights (prompt lookup decoding; the n-gram speculator of vLLM
and SGLang works the same way): the last `n` tokens known so far (prompt + output, ending
with the anchor) are searched for earlier in the same text, and the tokens that followed
that earlier occurrence are proposed as the next block. Code, chat and edits repeat their
own context (identifiers, quoted lines, boilerplate), which is why it is a real competitor
there and why a drafter's tau means little until it is set beside this one.

Rules (fixed, so figures are comparable):
- the longest suffix that occurs earlier wins: `n = max_ngram`, then `n - 1`, ... down to
  `min_ngram`; no occurrence at any n: no proposal (the cycle is a plain target step);
- among the occurrences of that suffix, the latest one that still has `B-1` tokens after it,
  otherwise the one with the most tokens after it (the earliest); the proposal is what follows
  it, at most `B-1` tokens, fewer when the occurrence lies near the end of the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .speculative import DecodeConfig, Generation, Proposer, verify_generate


def lookup_proposal(tokens: Sequence[int], max_tokens: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
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


class LookupProposer(Proposer):
    """Prompt lookup under the verification loop: proposals from each row's own text."""

    def __init__(self, block_size: int, max_ngram: int = 4, min_ngram: int = 1, filler_id: int = 0) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + drafts), got {block_size}.")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}.")
        self.block_size, self.max_ngram, self.min_ngram, self.filler_id = block_size, max_ngram, min_ngram, filler_id

    def propose(self, anchors: torch.Tensor, anchor_positions: torch.Tensor,
                histories: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        proposals = [lookup_proposal([*prompt, *output], self.block_size - 1, self.max_ngram, self.min_ngram)
                     for prompt, output in histories]
        # The block is only as wide as the longest proposal: no match anywhere is a plain step.
        width = max(len(p) for p in proposals)
        drafts = torch.full((len(proposals), width), self.filler_id, dtype=torch.long)
        for row, p in enumerate(proposals):
            drafts[row, : len(p)] = torch.tensor(p, dtype=torch.long)
        return drafts, torch.tensor([len(p) for p in proposals], dtype=torch.long)


@torch.no_grad()
def lookup_generate(model: Any, prompts: Sequence[Sequence[int]], config: DecodeConfig,
                    max_ngram: int = 4) -> list[Generation]:
    """Prompt-lookup speculative decoding of `prompts` as one batch (config.block_size required)."""
    if config.block_size is None:
        raise ValueError("prompt lookup needs config.block_size (the block it proposes is B-1 tokens).")
    proposer = LookupProposer(config.block_size, max_ngram=max_ngram, filler_id=config.pad_token_id)
    return verify_generate(model, proposer, prompts, config)
