"""DFlash training objective: anchors, blocks, position-weighted loss, optional soft labels.

A batch from the cache loader is a dict:

- `hidden` [B, T, K*D]: the K captured target layers of every token, concatenated (bf16/float);
- `input_ids` [B, T] long; `loss_mask` [B, T] 0/1 (1 on completion tokens);
- `lengths` [B] long: true lengths (sequences are right-padded to T);
- optional soft labels: `last_hidden` [B, T, D] (the target's final hidden state before its
  norm) or `topk_ids` / `topk_logprobs` [B, T, k] (the target's top-k next-token log-probs).
  Row t of either describes the target's distribution of token t+1.

For every sequence, up to `max_anchors` anchors p are drawn where the anchor and the next
token are completion tokens; each anchor gives a block `[token_p, MASK x (block_size-1)]` at
positions p..p+block_size-1; block slot k (1..block_size-1) predicts token p+k. All blocks of
the batch run in one forward pass with the mask of `attention.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from dflash.runtime.errors import InputError
from dflash.runtime.findings import Finding
from dflash.train.config import ObjectiveConfig
from dflash.train.heads.base import HeadInputs
from dflash.train.loss import head_loss
from dflash.train.loss.head_loss import (
    CHUNK_MIB,
    candidate_logits,
    chunk_rows,
    needs_chunks,
    slot_losses,
)
from dflash.train.model.attention import build_layer_masks
from dflash.train.model.drafter import DFlashDrafter

_GAMMA_TABLE = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """Decay of the position weights: the paper's 7/5/4 for blocks of 16/10/8.

    Other sizes follow `floor(1 + 3 * block_size / 8 + 0.5)`, the line through those points
    (it reproduces all three).
    """
    if block_size in _GAMMA_TABLE:
        return _GAMMA_TABLE[block_size]
    return float(math.floor(1 + 3 * block_size / 8 + 0.5))


def position_weights(block_size: int, gamma: float, device: torch.device | str | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block slots k = 1..block_size-1 (index 0 is k=1)."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def acceptance_weights(label_logprobs: torch.Tensor, b: torch.Tensor, a: torch.Tensor, k: torch.Tensor,
                       shape: torch.Size) -> torch.Tensor:
    """Per scored slot (b, a, k): the drafter's detached probability of reaching it, prod_{j<k}
    p_j(label_j) over the earlier slots of its block (1 for the first slot). A greedy verifier
    reaches slot k only when every earlier draft was accepted, so the loss goes where acceptance
    is decided, and follows the drafter as it learns. Unscored earlier slots count as reached."""
    p = torch.ones(shape, dtype=label_logprobs.dtype, device=label_logprobs.device)
    p[b, a, k] = label_logprobs.detach().exp()
    reach = torch.cumprod(torch.cat([torch.ones_like(p[..., :1]), p[..., :-1]], dim=-1), dim=-1)
    return reach[b, a, k]


def scored_slots(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                 anchor_positions: torch.Tensor, anchor_valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """[3, N] long: (sequence, anchor, slot) of every scored block slot, in row-major order.

    Computed where the batch's tensors live; from the host copy it spares the training step
    the device-to-host synchronisation of a `nonzero()` on the GPU.
    """
    _labels, valid = block_targets(input_ids, loss_mask, lengths, anchor_positions, anchor_valid, block_size)
    return torch.stack(valid.nonzero(as_tuple=True))


def add_hidden_noise(
    hidden: torch.Tensor, config: ObjectiveConfig, progress: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """`hidden` plus the scheduled noise (a new tensor; the cache's tensor is left untouched)."""
    amplitude = config.noise_amplitude(progress)
    if config.noise_type == "none" or amplitude == 0.0:
        return hidden
    if generator is not None and generator.device != hidden.device:
        generator = None  # a CPU generator cannot fill a CUDA tensor; fall back to the global RNG
    dtype = hidden.dtype if hidden.is_floating_point() else torch.float32
    if config.noise_type == "uniform":
        noise = torch.rand(hidden.shape, generator=generator, device=hidden.device, dtype=dtype)
        noise = (noise * 2 - 1) * amplitude
    else:
        noise = torch.randn(hidden.shape, generator=generator, device=hidden.device, dtype=dtype) * amplitude
    return hidden.to(dtype) + noise


def eligible_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, T] bool on the CPU: positions a block may start at (p + 1 < length, loss_mask[p]
    and loss_mask[p + 1] set)."""
    mask = loss_mask.detach().to("cpu", torch.bool)
    lengths = lengths.detach().to("cpu", torch.long)
    pos = torch.arange(mask.shape[1])
    return mask & torch.roll(mask, -1, dims=1) & (pos[None, :] + 1 < lengths[:, None])


def padded_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row anchor positions -> (positions [B, A], valid [B, A]), padded with 0 / False to
    the longest row (A >= 1, so a batch without anchors still runs)."""
    width = max(1, max((r.numel() for r in rows), default=0))
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        positions[b, : r.numel()] = r
        valid[b, : r.numel()] = True
    return positions, valid


def anchor_chunks(eligible: torch.Tensor, max_anchors: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every eligible position of each row, as successive (positions [B, A], valid [B, A])
    chunks of at most `max_anchors` columns (ascending; at least one chunk)."""
    rows = [e.nonzero().flatten() for e in eligible.cpu()]
    longest = max((r.numel() for r in rows), default=0)
    return [padded_rows([r[start : start + max_anchors] for r in rows])
            for start in range(0, max(longest, 1), max_anchors)]


def sample_anchors(
    loss_mask: torch.Tensor, lengths: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw anchors: positions [B, A] (ascending, padding = 0) and valid [B, A] bool.

    Eligible: p + 1 < length, loss_mask[p] == 1 and loss_mask[p + 1] == 1. Drawn without
    replacement with `generator` (a CPU generator; same seed, same anchors). A >= 1 so a batch
    without anchors still runs (and gets zero loss).
    """
    eligible = eligible_anchors(loss_mask, lengths)
    batch = eligible.shape[0]
    chosen: list[torch.Tensor] = []
    for b in range(batch):
        candidates = eligible[b].nonzero().flatten()
        if candidates.numel() > max_anchors:
            pick = torch.randperm(candidates.numel(), generator=generator)[:max_anchors]
            candidates = candidates[pick].sort().values
        chosen.append(candidates)
    positions, valid = padded_rows(chosen)
    device = loss_mask.device
    return positions.to(device), valid.to(device)


def build_blocks(
    input_ids: torch.Tensor, anchor_positions: torch.Tensor, mask_token_id: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tokens and their absolute positions, both [B, A*block_size]."""
    batch, num_anchors = anchor_positions.shape
    ids = torch.full((batch, num_anchors, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchor_positions)
    offsets = torch.arange(block_size, device=input_ids.device)
    positions = anchor_positions[:, :, None] + offsets
    return ids.flatten(1), positions.flatten(1)


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    anchor_positions: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and validity [B, A, block_size-1] for block slots k = 1..block_size-1.

    Slot k of anchor p is scored when the anchor is real, p + k < length and loss_mask[p + k] == 1.
    """
    seq_len = input_ids.shape[1]
    k = torch.arange(1, block_size, device=input_ids.device)
    target_pos = anchor_positions[:, :, None] + k  # [B, A, Bs-1]
    in_range = target_pos < lengths.to(input_ids.device)[:, None, None]
    safe = target_pos.clamp(max=seq_len - 1).flatten(1)
    labels = input_ids.gather(1, safe).view_as(target_pos)
    scored = loss_mask.gather(1, safe).view_as(target_pos).bool()
    valid = anchor_valid[:, :, None] & in_range & scored
    return labels, valid


@dataclass
class LossOutput:
    """What one `compute_loss` call produced; everything but `loss` is detached."""

    loss: torch.Tensor
    """Scalar to backpropagate."""
    ce: torch.Tensor
    """Weighted cross-entropy (scalar)."""
    kl: torch.Tensor | None
    """Weighted KL to the target's distribution (scalar), when soft labels were used."""
    correct: torch.Tensor
    """[B, A, block_size-1] bool: drafter's top-1 equals the label (False where not valid)."""
    valid: torch.Tensor
    """[B, A, block_size-1] bool: the slot is scored."""
    anchor_positions: torch.Tensor
    """[B, A] long."""
    anchor_valid: torch.Tensor
    """[B, A] bool."""
    predicted: torch.Tensor | None = None
    """[B, A, block_size-1] long: the drafter's top-1 token of each scored slot (-1 elsewhere); for
    a head with a loss of its own its choice (DFlash2: what the selector's walk drafts when the
    earlier slots were right)."""
    head_loss: torch.Tensor | None = None
    """The head's own loss before its weight (scalar; DFlash2: the selector's cross-entropy)."""
    backbone_predicted: torch.Tensor | None = None
    """With a head's choice: like `predicted`, the backbone's own top-1 (the drafter without its head)."""
    backbone_correct: torch.Tensor | None = None
    """With a head's choice: like `correct`, for `backbone_predicted`."""

    @property
    def selector_loss(self) -> torch.Tensor | None:
        """DFlash2's name for `head_loss`."""
        return self.head_loss


_NO_SOFT_LABELS = ("soft_label_weight > 0 but the batch has neither last_hidden nor topk_ids/topk_logprobs; "
                   "extract them into the cache or set soft_label_weight 0.")


def label_summary(config: ObjectiveConfig, manifest: Any) -> str:
    """The trainer's startup summary on what the slots train toward, read from the training cache's
    manifest: the soft labels' weight and source (or how to get them), and --hard-label target's
    source (a cache without the target's top-k or top-1 is refused there)."""
    return _soft_label_summary(config, manifest) + _hard_label_summary(config, manifest)


def _soft_label_summary(config: ObjectiveConfig, manifest: Any) -> str:
    """The startup summary's word on soft labels: their weight and source, or how to get them."""
    weight = config.soft_label_weight
    if weight:
        source = f"the target's top-{manifest.topk} log-probs" if manifest.topk else "the target's last hidden state"
        return f"; soft labels: weight {weight:g}, from {source} in the cache"
    if manifest.store_last_hidden or manifest.topk:
        return "; soft labels: off (--soft-label-weight 0)"
    return ("; soft labels: off, the cache stores no top-k log-probs (extract with --store-topk for them; "
            "docs/recipe.md, Defaults)")


def stores_target_top1(manifest: Any) -> bool:
    """Whether a cache holds the target's top-1 for its samples: its top-k (the first of them), or
    its top-1 for a share of them (dflash-extract --top1-share)."""
    return bool(manifest.topk or (manifest.top1 and manifest.top1_share > 0))


def _hard_label_summary(config: ObjectiveConfig, manifest: Any) -> str:
    """The startup summary's word on --hard-label target (DFlash2's default where the cache has a
    top-1; nothing for sample, DFlash's); a cache with neither the target's top-k nor its top-1 is
    refused, naming the fix."""
    if config.hard_label != "target":
        return ""
    if manifest.topk:
        return f"; hard labels: the target's top-1 (the first of its top-{manifest.topk} in the cache)"
    if stores_target_top1(manifest):
        share = manifest.top1_share
        return ("; hard labels: the target's top-1 from the cache" + (
            "" if share >= 1 else f", for the share {share:g} of the samples that store it (dflash-extract "
            "--top1-share); the others train on their own tokens"))
    raise InputError(Finding("train.hard-label-target-without-top1", cache=str(manifest.cache_dir), flag="--hard-label"))


def target_top1(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """[B, T] the target's greedy next token after each row (top1_ids, else the first of
    topk_ids), None when the batch has neither. A sample whose cache holds no top-1 for it
    (outside a --top1-share, `top1_known`) gets the first of its top-k, else its own next token,
    so that its replay checks the drafts against its tokens, as for a cache without top-1."""
    if "top1_ids" in batch:
        top1 = batch["top1_ids"][..., 0]
        known = batch.get("top1_known")
        if known is None:
            return top1
        if "topk_ids" in batch:
            other = batch["topk_ids"][..., 0].to(device=top1.device, dtype=top1.dtype)
        else:
            other = torch.zeros_like(top1)
            other[:, :-1] = batch["input_ids"][:, 1:].to(device=top1.device, dtype=top1.dtype)
        return torch.where(known.to(top1.device)[:, None], top1, other)
    if "topk_ids" in batch:
        return batch["topk_ids"][..., 0]  # topk is sorted, best first
    return None


_NO_TOP1 = ("hard_label 'target' but the batch holds neither the target's top-k nor its top-1; extract them "
            "into the cache (dflash-extract stores the top-8 by default) or set hard_label 'sample'.")


def greedy_labels(batch: dict, labels: torch.Tensor, b: torch.Tensor, a: torch.Tensor, k: torch.Tensor,
                  rows: torch.Tensor) -> torch.Tensor:
    """`labels` [B, A, S] with each scored slot (b, a, k) holding the target's top-1 at cache row
    `rows` (target_top1: its greedy choice after the sample's tokens up to there; a sample
    without one keeps its own next token)."""
    top1 = target_top1(batch)
    if top1 is None:
        raise ValueError(_NO_TOP1)
    out = labels.clone()
    out[b, a, k] = top1.to(labels.device)[b, rows].to(labels.dtype)
    return out


def _soft_labels(batch: dict, b: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The soft labels of the slots at cache rows `rows` as head_loss.slot_losses takes them:
    the target's top-k (renormalized log-probs) or its last hidden states."""
    if "topk_ids" in batch and "topk_logprobs" in batch:
        return {"soft_ids": batch["topk_ids"][b, rows].long(),
                "soft_logprobs": torch.log_softmax(batch["topk_logprobs"][b, rows].float(), dim=-1)}
    if "last_hidden" in batch:
        return {"soft_hidden": batch["last_hidden"][b, rows]}
    raise ValueError(_NO_SOFT_LABELS)


def compute_loss(
    drafter: DFlashDrafter,
    batch: dict,
    config: ObjectiveConfig,
    *,
    progress: float = 0.0,
    noise_generator: torch.Generator | None = None,
) -> LossOutput:
    """Run every block of the batch (its anchors drawn where it was read: anchors.add_anchors) in
    one pass and score the predictions.

    `progress` in [0, 1] drives the noise schedule, drawn with `noise_generator`.
    """
    missing = {"hidden", "input_ids", "loss_mask", "lengths", "anchor_positions", "anchor_valid"} - set(batch)
    if missing:
        raise ValueError(f"batch is missing {sorted(missing)}; the cache loader must provide them "
                         "(the anchors: train/data/anchors.py).")
    c = drafter.config
    hidden, input_ids, loss_mask = batch["hidden"], batch["input_ids"].long(), batch["loss_mask"]
    lengths = batch["lengths"].long()
    block_size = c.block_size
    anchors, anchor_valid = batch["anchor_positions"], batch["anchor_valid"]  # drawn on the host: no device sync
    block_ids, block_positions = build_blocks(input_ids, anchors, c.mask_token_id, block_size)
    labels, valid = block_targets(input_ids, loss_mask, lengths, anchors, anchor_valid, block_size)
    kinds = [c.layer_attention(i) for i in range(c.num_hidden_layers)]
    mask = build_layer_masks(anchors, hidden.shape[1], block_size, kinds, c.attention_backend)
    hidden = add_hidden_noise(hidden, config, progress, noise_generator)
    blocks = drafter(hidden, block_ids, block_positions, mask).view(anchors.shape[0], anchors.shape[1], block_size, -1)
    states = blocks[:, :, 1:]

    # Only scored slots go through the (large) lm_head. Their indices come with the batch
    # when the caller computed them on the host (no device sync); else from `valid`.
    if "scored_slots" in batch:
        b, a, k = batch["scored_slots"].to(valid.device, non_blocking=True).unbind(0)
    else:
        b, a, k = valid.nonzero(as_tuple=True)
    scored = states[b, a, k]  # [N, D], once: the selector reads them too
    cache_rows = anchors[b, a] + k  # slot k+1 predicts token p+k+1, described by cache row p+k
    if config.hard_label == "target":  # the target's greedy choice there, not the sample's token
        labels = greedy_labels(batch, labels, b, a, k, cache_rows)
    target = labels[b, a, k]
    head = drafter.head  # (through a DDP/FSDP wrapper too: LossModel forwards attributes to the drafter)
    vocab = drafter.lm_head_weight.shape[0]
    limit = config.logits_chunk_mib
    # The head over chunks of rows (head_loss.py): one while the slots' float32 logits fit
    # --logits-chunk-mib (0: no limit), else chunks of CHUNK_MIB.
    chunk = chunk_rows(vocab, min(CHUNK_MIB, limit)) if needs_chunks(len(target), vocab, limit) else max(1, len(target))
    soft_weight = config.soft_label_weight or 0.0  # None (not yet decided by the cache, TrainConfig.with_soft_labels): off
    soft = _soft_labels(batch, b, cache_rows) if soft_weight > 0 else {}
    compiled = head_loss.use_compiled(drafter, scored)
    row_loss, label_lp, per_position, top1, top_ids = slot_losses(
        drafter, scored, target, chunk, top_k=head.candidates(c), soft_weight=soft_weight, fused=compiled, **soft)
    if config.loss_weighting == "acceptance":
        weights = acceptance_weights(label_lp, b, a, k, valid.shape)
    else:
        gamma = config.gamma if config.gamma is not None else default_gamma(block_size)
        weights = position_weights(block_size, gamma, label_lp.device)[k]
    total_weight = weights.sum().clamp(min=1e-12)
    loss = (weights * row_loss).sum() / total_weight
    ce = loss.detach() if soft_weight == 0 else (weights * -label_lp.detach()).sum() / total_weight
    kl = (weights * per_position.detach()).sum() / total_weight if soft_weight > 0 else None

    predicted = torch.full_like(labels, -1)
    predicted[b, a, k] = top1
    correct = predicted == labels  # False where not scored (-1 is no token)
    own = head.objective(HeadInputs(
        drafter=drafter, states=scored, labels=target, weights=weights, input_ids=input_ids, rows=(b, cache_rows),
        top_ids=top_ids, soft_labels=soft,
        gather_logits=lambda h, ids: candidate_logits(drafter, h, ids, chunk),
        block_states=blocks, anchors=anchors, slots=(b, a, k), context=hidden,
        label_logprobs=label_lp.detach(), compiled=compiled), config)
    if own is None:
        return LossOutput(
            loss=loss, ce=ce.detach(), kl=kl, correct=correct, valid=valid,
            anchor_positions=anchors, anchor_valid=anchor_valid, predicted=predicted,
        )
    chosen = torch.full_like(labels, -1)
    chosen[b, a, k] = own.choice
    return LossOutput(
        loss=loss + own.loss, ce=ce.detach(), kl=kl,
        correct=chosen == labels, valid=valid, anchor_positions=anchors, anchor_valid=anchor_valid,
        predicted=chosen, head_loss=own.logged, backbone_predicted=predicted,
        backbone_correct=correct,
    )
