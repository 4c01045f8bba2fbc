"""Speculative decoding with a DFlash drafter and a Hugging Face target, batched, lossless.

One cycle, per sequence (the DFlash paper's engine loop):

1. the drafter drafts a block `[anchor, MASK x (B-1)]` in one pass, where the anchor is the
   last token the target produced and the drafter's context holds the target's captured
   hidden states of every token before it;
2. the target verifies the block in one pass over its KV cache: its prediction after block
   slot k is compared with the drafted token in slot k+1;
3. the longest matching prefix (a drafted tokens) is accepted, plus the target's own next
   token (the bonus, the next anchor), so every cycle yields a+1 tokens;
4. the KV entries and hidden states of the anchor and the accepted drafts are kept (they feed
   the drafter's context); those of rejected drafts are dropped.

Sequences of a batch accept different numbers of tokens per cycle. Instead of re-packing the
caches, both the target's KV cache and the drafter's context keep a column per verified slot
and a validity mask: rejected slots become holes that attention skips, and every token gets
its true position through explicit `position_ids`. Columns that are holes in every row are
cropped. A batch of one therefore never has holes and is exactly the textbook loop.

The loop (`verify_generate`) takes its drafts from a `Proposer`: the DFlash drafter here,
prompt lookup in `lookup.py`. A proposer may propose fewer than B-1 tokens for a row (filler
after them is never accepted), and the verified block is only as wide as the longest
proposal, so every method is measured under the same verification. A drafter head that predicts
each draft's acceptance probability proposes, under a confidence threshold, only the drafts it is
sure enough of (`DecodeConfig.confidence_threshold`).

Greedy decoding (temperature 0) is lossless: the output is the target's own greedy output
token for token. With temperature > 0 the target samples a token at every verified position
and a draft is accepted while it equals the target's sample ("sample-and-match"), so every
emitted token is a sample of the target's distribution given the emitted prefix: the output
distribution is exactly the target's, with lower acceptance than rejection-sampling schemes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from dflash.runtime.errors import SettingError
from dflash.runtime.findings import Finding
from dflash.train.model.drafter import DFlashDrafter

from .target import (
    TargetStateRollback,
    capture_hidden,
    crop_kv,
    forward_with_cache,
    left_pad,
    new_kv_cache,
)


class NoConfidenceError(SettingError):
    """A confidence threshold was given for a drafter that predicts no confidence of its drafts
    (eval.drafter-without-confidence; dflash-eval names the drafter's directory)."""


@dataclass(kw_only=True)
class DecodeConfig:
    """How sequences are generated (shared by speculative and target-only decoding)."""

    max_new_tokens: int = 128
    """Tokens generated per prompt (fewer when a stop token comes first)."""
    temperature: float = 0.0
    """0: greedy (lossless check possible); > 0: sampling from the target's distribution."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a sequence ends after any of these tokens (which is kept)."""
    block_size: int | None = None
    """Tokens per drafted block incl. the anchor; None: the drafter's trained block size."""
    seed: int = 0
    """Seed of the sampling generator (temperature > 0)."""
    pad_token_id: int = 0
    """Filler id for left padding; it is masked out, any valid id works."""
    confidence_threshold: float | None = None
    """A drafter whose head predicts each draft's acceptance probability proposes a block's drafts
    while their running product stays at or above this (at least one); None: the whole block."""

    def __post_init__(self) -> None:
        # (the flags of dflash-eval that set these fields have their names)
        if self.max_new_tokens < 1:
            raise SettingError(Finding("eval.flag-below-one", flag="--max-new-tokens", value=self.max_new_tokens))
        if self.temperature < 0:
            raise SettingError(Finding("eval.flag-out-of-range", flag="--temperature", value=self.temperature,
                                       low=0, high=None))
        if self.block_size is not None and self.block_size < 2:  # the anchor and a draft at least
            raise SettingError(Finding("eval.flag-out-of-range", flag="--block-size", value=self.block_size,
                                       low=2, high=None))
        if self.confidence_threshold is not None and not 0.0 <= self.confidence_threshold <= 1.0:
            raise SettingError(Finding("eval.flag-out-of-range", flag="--confidence-threshold",
                                       value=self.confidence_threshold, low=0, high=1))
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclass
class Generation:
    """What one prompt produced."""

    tokens: list[int]
    """New tokens (prompt excluded), cut after a stop token or at max_new_tokens."""
    acceptance_lengths: list[int] = field(default_factory=list)
    """Per draft-verify cycle: accepted drafts + 1 (empty for target-only decoding)."""
    drafted: list[int] = field(default_factory=list)
    """Per draft-verify cycle: the drafts proposed (at most the block's B-1)."""


class TokenChooser:
    """Greedy argmax, or sampling at a temperature from a seeded generator."""

    def __init__(self, temperature: float, seed: int, device: torch.device) -> None:
        self.temperature = temperature
        self.generator = None
        if temperature > 0:
            self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Token ids [...] from logits [..., V]."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).view(probs.shape[:-1])


def _finish(tokens: list[int], new: list[int], config: DecodeConfig) -> bool:
    """Append `new` to `tokens`, cut at a stop token or the limit; True when the row is done."""
    for token in new:
        tokens.append(token)
        if token in config.stop_token_ids or len(tokens) >= config.max_new_tokens:
            return True
    return False


@torch.no_grad()
def target_generate(model: Any, prompts: Sequence[Sequence[int]], config: DecodeConfig) -> list[Generation]:
    """Target-only decoding with a KV cache, one token per forward pass, all prompts batched."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, config.pad_token_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    choose = TokenChooser(config.temperature, config.seed, device)
    cache = new_kv_cache(model)
    out = forward_with_cache(model, cache, input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
    next_tokens = choose(out.logits[:, -1])
    next_pos = mask.sum(-1)
    results = [Generation(tokens=[]) for _ in prompts]
    active = list(range(len(prompts)))
    while True:
        keep = [i for i, row in enumerate(active) if not _finish(results[row].tokens, [int(next_tokens[i])], config)]
        if not keep:
            return results
        if len(keep) < len(active):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, next_tokens, next_pos = mask[index], next_tokens[index], next_pos[index]
            active = [active[i] for i in keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = forward_with_cache(model, cache, input_ids=next_tokens[:, None], attention_mask=mask,
                       position_ids=next_pos[:, None])
        next_tokens = choose(out.logits[:, -1])
        next_pos = next_pos + 1


# -- drafter context with holes ---------------------------------------------------------------


class DraftContext:
    """The drafter's per-layer context keys/values for a batch of sequences of any lengths.

    Each layer's context keys and values as training computes them, plus a validity mask [B, L]
    so that rows can hold padding and rejected slots (holes); positions are given per token.
    """

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.valid: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [B, L] absolute position of every column
        self.fused: torch.Tensor | None = None  # [B, L, D] the fused context (anchor_context)

    @property
    def length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    @torch.no_grad()
    def append(self, hidden: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Add captured states [B, n, K*D] at `positions` [B, n]; `valid` [B, n] bool."""
        d = self.drafter
        context = d.fuse_context(hidden)
        cos, sin = d.rope(positions, context)
        new = [layer.self_attn.project_kv(context, cos, sin) for layer in d.layers]
        if self.valid is None:
            self.keys, self.values, self.valid = [k for k, _ in new], [v for _, v in new], valid.bool()
            self.positions, self.fused = positions, context
            return
        self.fused = torch.cat([self.fused, context], dim=1)
        self.keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(self.keys, new)]
        self.values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(self.values, new)]
        self.valid = torch.cat([self.valid, valid.bool()], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)

    def crop(self, remove: int) -> None:
        """Drop the last `remove` columns."""
        if remove > 0 and self.valid is not None:
            length = self.length - remove
            self.keys = [k[:, :, :length] for k in self.keys]
            self.values = [v[:, :, :length] for v in self.values]
            self.valid = self.valid[:, :length]
            self.positions, self.fused = self.positions[:, :length], self.fused[:, :length]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (finished sequences leave the batch)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        if self.valid is not None:
            self.valid, self.positions, self.fused = self.valid[rows], self.positions[rows], self.fused[rows]

    def anchor_context(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the fused context of each row's last valid column [B, D], whether it has one [B]): the
        state of the token before the anchor, the last verified one; None before any context."""
        if self.valid is None:
            return None
        last = (self.valid.long() * torch.arange(1, self.length + 1, device=self.valid.device)).argmax(dim=1)
        rows = torch.arange(self.valid.shape[0], device=self.valid.device)
        return self.fused[rows, last], self.valid.any(dim=1)

    @torch.no_grad()
    def draft(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """Logits [B, block_size-1, V] of the block after `anchor_ids` [B] at `anchor_positions` [B].

        Each block token sees the row's valid context (all of it lies before the anchor) and
        its block, restricted per layer by its window and causality, as in training.
        """
        return self.drafter.logits(self.draft_states(anchor_ids, anchor_positions, block_size))

    @torch.no_grad()
    def draft_states(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, block_size: int, *,
                     with_anchor: bool = False) -> torch.Tensor:
        """The drafter's normed states [B, block_size-1, D] of the drafted slots (see `draft`); with
        `with_anchor` [B, block_size, D], the anchor's slot first."""
        d = self.drafter
        if self.valid is None:
            raise ValueError("append context before drafting a block.")
        batch = anchor_ids.shape[0]
        offsets = torch.arange(block_size, device=anchor_ids.device)
        block_ids = torch.full((batch, block_size), d.config.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        block_ids[:, 0] = anchor_ids
        positions = anchor_positions[:, None] + offsets
        masks = d.block_masks(self.positions, self.valid, positions)
        states = d.run_block(block_ids, positions, list(zip(self.keys, self.values)), masks)
        return states if with_anchor else states[:, 1:]


# -- the speculative loop ---------------------------------------------------------------------


class Proposer:
    """What the verification loop asks of a drafting method (the DFlash drafter, prompt lookup).

    The loop owns the target, its KV cache and the token bookkeeping; a proposer only turns
    what is known so far into draft tokens and keeps whatever state it needs in step with the
    verified columns. Every proposer runs under the same verification, so their acceptance
    lengths compare like for like.
    """

    needs_hidden_states: bool = False
    """True when the proposer reads the target's hidden states (the target then returns them)."""

    def prefill(self, out: Any, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """The target's prefill output over the left-padded prompts (`positions`, `valid` [B, N])."""

    def propose(self, anchors: torch.Tensor, anchor_positions: torch.Tensor,
                histories: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [B, m] after each row's anchor and how many of them are real ([B], <= m).

        `histories[i]` is row i's (prompt, output so far); the output ends with the anchor.
        Slots past a row's length are filler that verification never accepts.
        """
        raise NotImplementedError

    def update(self, out: Any, block_positions: torch.Tensor, kept: torch.Tensor, unused: int) -> None:
        """The verify pass's output over the block; `kept` [B, width] marks the verified slots,
        and the last `unused` columns are dropped everywhere."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (finished sequences leave the batch)."""


class DrafterProposer(Proposer):
    """The DFlash drafter: one pass over `[anchor, MASK x (T-1)]` at its trained block size T,
    the argmax of every slot; the first `block_size - 1` drafts are proposed.

    A smaller block is verified, never drafted: a drafter trained at 16 sees 15 masks in every
    training block, and a block of 8 is a shape it never saw (on the quality benchmark, a block
    drafted at 8 accepts about half of what the first 7 drafts of its 16-block accept).
    """

    needs_hidden_states = True

    def __init__(self, drafter: DFlashDrafter, block_size: int, *, temperature: float = 0.0, seed: int = 0,
                 confidence_threshold: float | None = None) -> None:
        trained = drafter.config.block_size
        if not 2 <= block_size <= trained:
            raise SettingError(Finding("eval.block-size-range", flag="--block-size", value=block_size, trained=trained))
        self.context = DraftContext(drafter)
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.block_size, self.trained_block_size = block_size, trained
        # the head's decode step (DFlash2: the selector walks the block), or None: the backbone's argmax
        self.walk = drafter.head.proposer(drafter, temperature, seed)
        if hasattr(self.walk, "bind"):  # a step that reads more of the context than the block's states
            self.walk.bind(self.context)
        self.whole_block = drafter.head.reads_whole_block
        self.confidence_threshold = confidence_threshold

    def prefill(self, out: Any, positions: torch.Tensor, valid: torch.Tensor) -> None:
        self.context.append(capture_hidden(out.hidden_states, self.layer_ids), positions, valid.bool())

    def propose(self, anchors: torch.Tensor, anchor_positions: torch.Tensor,
                histories: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.walk is not None:
            whole = self.whole_block  # XPress's refiner mixes the whole block, the anchor's slot included
            states = self.context.draft_states(anchors, anchor_positions, self.trained_block_size, with_anchor=whole)
            if whole:
                before = torch.tensor([(list(p) + list(o))[-2] for p, o in histories], device=anchors.device)
                drafts = self.walk(states, anchors, before)[:, : self.block_size - 1]
            else:
                drafts = self.walk(states[:, : self.block_size - 1], anchors)
            confidence = None
            if isinstance(drafts, tuple):  # the head predicts each draft's acceptance probability
                drafts, confidence = drafts
            return self._stop_where_unsure(drafts, confidence)
        logits = self.context.draft(anchors, anchor_positions, self.trained_block_size)
        return self._stop_where_unsure(logits[:, : self.block_size - 1].argmax(dim=-1), None)

    def _stop_where_unsure(self, drafts: torch.Tensor, confidence: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts, how many per row are proposed): all of them, or with a confidence threshold the
        leading drafts whose running product of confidences stays at or above it (at least one);
        the block is cut to the longest proposal."""
        full = torch.full_like(drafts[:, 0], drafts.shape[1])
        if self.confidence_threshold is None:
            return drafts, full
        if confidence is None:
            raise NoConfidenceError(Finding("eval.drafter-without-confidence", drafter=None,
                                            flag="--confidence-threshold"))
        sure = confidence.float().cumprod(dim=1) >= self.confidence_threshold
        lengths = sure.long().cumprod(dim=1).sum(dim=1).clamp(min=1)
        return drafts[:, : int(lengths.max())], lengths

    def update(self, out: Any, block_positions: torch.Tensor, kept: torch.Tensor, unused: int) -> None:
        self.context.append(capture_hidden(out.hidden_states, self.layer_ids), block_positions, kept)
        self.context.crop(unused)

    def select(self, rows: torch.Tensor) -> None:
        self.context.select(rows)


@torch.no_grad()
def speculative_generate(
    model: Any,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig,
) -> list[Generation]:
    """Speculative decoding of all `prompts` as one batch with the DFlash drafter (see the module docstring)."""
    block_size = config.block_size or drafter.config.block_size
    proposer = DrafterProposer(drafter, block_size, temperature=config.temperature, seed=config.seed,
                               confidence_threshold=config.confidence_threshold)
    return verify_generate(model, proposer, prompts, config)


@torch.no_grad()
def verify_generate(
    model: Any,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig,
) -> list[Generation]:
    """Draft-verify decoding of all `prompts` as one batch, the drafts coming from `proposer`."""
    device = next(model.parameters()).device
    choose = TokenChooser(config.temperature, config.seed, device)
    hidden = proposer.needs_hidden_states

    # Prefill: the target reads every prompt (its states become the drafter's first context).
    ids, mask = left_pad(prompts, config.pad_token_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = new_kv_cache(model)
    rollback = TargetStateRollback(cache, len(prompts), getattr(model, "config", None))
    out = forward_with_cache(model, cache, input_ids=ids, attention_mask=mask, position_ids=positions,
                   output_hidden_states=hidden, logits_to_keep=1)
    proposer.prefill(out, positions, mask.bool())
    anchors = choose(out.logits[:, -1])
    next_pos = mask.sum(-1)  # position of each row's anchor = tokens known so far
    results = [Generation(tokens=[]) for _ in prompts]
    active = list(range(len(prompts)))
    done = [_finish(results[row].tokens, [int(anchors[i])], config) for i, row in enumerate(active)]

    while True:
        keep = [i for i, finished in enumerate(done) if not finished]
        if not keep:
            return results
        if len(keep) < len(active):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            proposer.select(index)
            mask, anchors, next_pos = mask[index], anchors[index], next_pos[index]
            active = [active[i] for i in keep]

        # Draft: `lengths[i]` real proposals per row; filler past them is never accepted.
        drafts, lengths = proposer.propose(anchors, next_pos, [(prompts[row], results[row].tokens) for row in active])
        drafts, lengths = drafts.to(device), lengths.to(device)
        block = torch.cat([anchors[:, None], drafts], dim=1)
        width = block.shape[1]
        offsets = torch.arange(width, device=device)
        block_pos = next_pos[:, None] + offsets

        # Verify: one target pass over the block; target choice after slot k checks slot k+1.
        snapshot = rollback.snapshot(cache)
        out = forward_with_cache(model, cache, input_ids=block, attention_mask=torch.cat([mask, torch.ones_like(block)], dim=1),
                       position_ids=block_pos, output_hidden_states=hidden)
        chosen = choose(out.logits)  # [B, width]
        real = offsets[None, : width - 1] < lengths[:, None]
        accepted = ((drafts == chosen[:, :-1]) & real).long().cumprod(dim=1).sum(dim=1)  # [B]

        # Keep the anchor and accepted drafts (slots 0..a); the rest become holes.
        kept = offsets[None, :] <= accepted[:, None]
        unused = width - 1 - int(accepted.max())
        if snapshot is not None and unused > 0:  # one row: rerun the target over what it accepted
            rollback.restore(cache, snapshot, width)
            n = width - unused
            out = forward_with_cache(model, cache, input_ids=block[:, :n], position_ids=block_pos[:, :n],
                           attention_mask=torch.cat([mask, torch.ones_like(block[:, :n])], dim=1),
                           output_hidden_states=hidden)
            proposer.update(out, block_pos[:, :n], kept[:, :n], 0)
        else:
            proposer.update(out, block_pos, kept, unused)
            crop_kv(cache, unused)
        mask = torch.cat([mask, kept.long()], dim=1)
        mask = mask[:, : mask.shape[1] - unused]

        done = []
        for i, row in enumerate(active):
            a = int(accepted[i])
            results[row].acceptance_lengths.append(a + 1)
            results[row].drafted.append(int(lengths[i]))
            done.append(_finish(results[row].tokens, chosen[i, : a + 1].tolist(), config))
        anchors = chosen.gather(1, accepted[:, None]).squeeze(1)
        next_pos = next_pos + accepted + 1


# -- statistics -------------------------------------------------------------------------------


def acceptance_summary(generations: Sequence[Generation]) -> dict[str, Any]:
    """tau (mean of accepted+1 over all cycles of all sequences), its histogram and the drafts
    proposed per cycle."""
    lengths = [n for g in generations for n in g.acceptance_lengths]
    drafted = [n for g in generations for n in g.drafted]
    histogram: dict[int, int] = {}
    for n in lengths:
        histogram[n] = histogram.get(n, 0) + 1
    return {
        "tau": sum(lengths) / len(lengths) if lengths else 0.0,
        "cycles": len(lengths),
        "histogram": {str(k): histogram[k] for k in sorted(histogram)},
        # (a decoder that records its drafts: prompt lookup's vary by match, a drafter's by confidence)
        **({"drafted_per_cycle": sum(drafted) / len(drafted)} if drafted else {}),
    }


def first_divergence(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))
