"""LiLiCorr's loss over a batch's scored slots: each block's lattice as decoding builds it, scored by
the correlator, and the walk's cross-entropy along the true path (lattice.path_loss).

No released trainer trains this head; the objective is ours. It is the decode rule's own
likelihood: decoding walks the lattice from the anchor, one softmax over the K successors of the
previous choice per slot, so the probability that it drafts the true tokens of a block's first s
slots is the product of those softmaxes along the true path, and the loss is its negative log,
weighted per slot like the backbone's cross-entropy. The lattice is the decode lattice (the plain
top-K of every slot, the full vocabulary's log-probs as features): a slot whose true token is not
among its candidates ends the path (no walk can be right past it), and its lattice stays as is.
"""

from __future__ import annotations

import torch
from dflash.train.heads.base import HeadInputs
from dflash.train.heads.lilicorr.lattice import path_loss

_NEEDS = ("slots", "anchors", "context", "label_logprobs", "top_ids")


def lattice_objective(inputs: HeadInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(the walk's weighted path cross-entropy, the walk's choice [N]) over the N scored slots."""
    missing = [name for name in _NEEDS if getattr(inputs, name, None) is None]
    if missing:
        raise ValueError(f"the LiLiCorr loss needs the objective's {', '.join(missing)} of the scored slots "
                         "(train/loss/objective.py hands them to every head).")
    d = inputs.drafter
    head = d.lilicorr
    row, block, slot = inputs.slots
    states, labels, top_ids = inputs.states, inputs.labels, inputs.top_ids
    slots, k = d.config.block_size - 1, top_ids.shape[-1]

    # The blocks with a scored slot, each once, in a grid [M, S] of their slots.
    keys, at = torch.unique(row * inputs.anchors.shape[1] + block, return_inverse=True)
    m = keys.shape[0]
    row_of, block_of = keys // inputs.anchors.shape[1], keys % inputs.anchors.shape[1]
    pos_of = inputs.anchors[row_of, block_of]

    # The candidates' full-vocabulary log-probs: their logits less the row's log-normalizer, which the
    # label's logit and log-prob give (features, no gradient: the engines feed them as numbers).
    with torch.no_grad():
        ids = torch.cat([top_ids, labels[:, None]], dim=-1)
        logits = inputs.gather_logits(states.detach(), ids).float()
        log_probs = logits[:, :k] - (logits[:, k] - inputs.label_logprobs.float())[:, None]

    def grid(values: torch.Tensor, fill: float | int) -> torch.Tensor:
        out = values.new_full((m, slots, *values.shape[1:]), fill)
        return out.index_put((at, slot), values)

    scored = grid(torch.ones_like(labels, dtype=torch.bool), False)
    lattice_states = grid(states, 0.0)
    lattice_ids = grid(top_ids, 0)
    lattice_lp = grid(log_probs, 0.0)
    lattice_labels = grid(labels, -1)
    weights = grid(inputs.weights.detach().float(), 0.0)
    # The anchor: the fused context of the last verified token (position p-1), none at p = 0. Read
    # without gradient: the backbone's fc trains through its own loss, and the drafter's unit is
    # left alone after its forward (FSDP).
    with torch.no_grad():
        before = inputs.context[row_of, (pos_of - 1).clamp(min=0)]
        anchor = d.fuse_context(before[:, None])[:, 0]
    anchor_valid = pos_of > 0
    scores = head(d.embed(lattice_ids), lattice_lp, lattice_states, anchor.to(states.dtype), anchor_valid,
                  key_valid=scored)
    loss, choice = path_loss(scores, lattice_ids, lattice_labels, scored, weights)
    return loss, choice[at, slot]
