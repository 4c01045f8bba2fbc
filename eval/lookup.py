"""Prompt lookup: the free baseline a trained drafter has to beat, under dflash-eval's verification.

An n-gram drafter with no weights (prompt lookup decoding; the n-gram speculator of vLLM
and SGLang works the same way): the last `n` tokens known so far (prompt + output, ending
with the anchor) are searched for earlier in the same text, and the tokens that followed
that earlier occurrence are proposed as the next block. Code, chat and edits repeat their
own context (identifiers, quoted lines, boilerplate), which is why it is a real competitor
there and why a drafter's tau means little until it is set beside this one.

Its proposals (and the rules that make figures comparable) are runtime/lookup.py's, which the
trainer's held-out walk replays too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from dflash.runtime.errors import SettingError
from dflash.runtime.findings import Finding
from dflash.runtime.lookup import lookup_proposal

from .speculative import DecodeConfig, Generation, Proposer, verify_generate


class LookupProposer(Proposer):
    """Prompt lookup under the verification loop: proposals from each row's own text."""

    def __init__(self, block_size: int, max_ngram: int = 4, min_ngram: int = 1, filler_id: int = 0) -> None:
        if block_size < 2:
            raise SettingError(Finding("eval.flag-out-of-range", flag="--block-size", value=block_size, low=2, high=None))
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
