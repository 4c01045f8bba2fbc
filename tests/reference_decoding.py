"""The drafter's one-sequence inference path, as the reference that the batched decoding of
dflash-eval (dflash.eval.speculative.DraftContext: padding, holes, positions per column) and
the training path are checked against.

A ContextCache holds each layer's context keys/values of one batch of sequences that all have
the same length; the block is recomputed each time and never cached. The anchor sits at
position `cache.length`, so the cache holds exactly the context before it, as in training.
"""

from __future__ import annotations

import torch


class ContextCache:
    """Per-layer keys/values of the fused context seen so far, for `drafter`."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def crop(self, length: int) -> None:
        """Forget context positions >= `length` (after the target rejects drafted tokens)."""
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]

    @torch.no_grad()
    def append_context(self, hidden: torch.Tensor) -> None:
        """Add the captured target states [B, n, K*D] of the next n tokens."""
        d, start = self.drafter, self.length
        positions = torch.arange(start, start + hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
        context = d.fuse_context(hidden)
        cos, sin = d.rope(positions, context)
        new = [layer.self_attn.project_kv(context, cos, sin) for layer in d.layers]
        if not self.keys:
            self.keys, self.values = [k for k, _ in new], [v for _, v in new]
            return
        self.keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(self.keys, new)]
        self.values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(self.values, new)]

    @torch.no_grad()
    def draft_block(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, block_size-1, V] for the block after the anchors [B] at `self.length`."""
        d = self.drafter
        c = d.config
        if self.length == 0:
            raise ValueError("append_context at least one token before drafting a block.")
        batch = anchor_ids.shape[0]
        block_ids = torch.full((batch, c.block_size), c.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        block_ids[:, 0] = anchor_ids
        positions = self.length + torch.arange(c.block_size, device=anchor_ids.device).expand(batch, -1)
        context_positions = torch.arange(self.length, device=anchor_ids.device).expand(batch, -1)
        masks = d.block_masks(context_positions, None, positions)
        h = d.run_block(block_ids, positions, list(zip(self.keys, self.values)), masks)
        return d.logits(h[:, 1:])
