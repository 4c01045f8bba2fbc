"""DSpark's Markov and confidence heads, their training loss and their decode step.

Names, shapes and arithmetic are the engines' (vLLM 0.34.0 `qwen3_dspark.py`, SGLang 0.5.23
`srt/models/dspark.py`; the loss after speculators 0.9.0 `models/dspark/`):

- `MarkovHead`: `markov_w1` [V, r], an embedding of the token before a slot, and `markov_w2`
  [V, r], a bias-free projection of it onto the vocabulary; the bias `markov_w2(markov_w1[prev])`
  is added to the slot's logits (the target's lm_head over the drafter's state). Decoding walks
  the block from the verified anchor, left to right: slot 1's previous token is the anchor, each
  later slot's the token drafted before it (argmax at T = 0, a sample of softmax(z / T) at T > 0).
- `ConfidenceHead`: `proj` [1, D (+ r)] with a bias, on the slot's state (and the previous token's
  Markov embedding, with confidence_head_with_markov); sigmoid of it is the predicted probability
  that the slot's draft is accepted.
- The loss over the scored slots, each with the true token before it as its previous token (what
  the walk has drafted when every earlier slot was right): the biased logits' (1 - w) CE + w KL to
  the target's top-k (w: --soft-label-weight, as the backbone's), plus --markov-tv-weight times
  their total-variation distance to it, plus --confidence-loss-weight times the confidence head's
  binary cross-entropy toward the slot's acceptance probability sum_v min(q_v, p_v) (q the biased
  draft distribution, p the target's: its top-k, or one-hot at the label without soft labels,
  where it is q(label)). The confidence head reads detached inputs: it predicts, it does not pull
  the drafter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from dflash.train.heads.base import HeadInputs
from dflash.train.loss.head_loss import CHUNK_MIB, chunk_rows
from torch import nn
from torch.utils.checkpoint import checkpoint


class MarkovHead(nn.Module):
    """The low-rank transition bias: `markov_w1` [V, r] embeds the previous token, `markov_w2`
    (weight [V, r]) maps the embedding to a bias over the vocabulary."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """`markov_w1` normal(0.01) as speculators starts it, `markov_w2` 0: no bias at the start."""
        with torch.no_grad():
            self.markov_w1.weight.normal_(std=0.01)
            self.markov_w2.weight.zero_()

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids.long())

    def bias(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(embedding.to(self.markov_w2.weight.dtype))


class ConfidenceHead(nn.Module):
    """`proj` [1, input] with a bias: the logit of a draft's acceptance probability."""

    def __init__(self, input_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_size, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.bias.zero_()

    def forward(self, states: torch.Tensor, embedding: torch.Tensor | None) -> torch.Tensor:
        x = states if embedding is None else torch.cat([states, embedding.to(states.dtype)], dim=-1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1)


def biased_logits(drafter: Any, states: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
    """float32 logits of `states` [..., D] plus the Markov bias of `embedding` [..., r]."""
    return drafter.logits(states).float() + drafter.markov_head.bias(embedding).float()


def _slot_terms(drafter: Any, states: torch.Tensor, embedding: torch.Tensor, labels: torch.Tensor,
                soft_ids: torch.Tensor | None, soft_logprobs: torch.Tensor | None, soft_hidden: torch.Tensor | None,
                soft_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per slot: (the biased logits' (1 - w) CE + w KL, their TV distance to the target's
    distribution, the acceptance probability sum min(q, p) (detached), the argmax)."""
    logprobs = torch.log_softmax(biased_logits(drafter, states, embedding), dim=-1)
    ce = -logprobs.gather(1, labels[:, None]).squeeze(1)
    if soft_ids is not None:  # the target's top-k, renormalized
        p, q = soft_logprobs.exp(), logprobs.gather(1, soft_ids).exp()
        kl = (p * (soft_logprobs - logprobs.gather(1, soft_ids))).sum(-1)
        overlap = torch.minimum(p, q).sum(-1)
    elif soft_hidden is not None:  # the target's whole distribution from its last states
        target = torch.log_softmax(drafter.target_logits(soft_hidden).float(), dim=-1)
        kl = (target.exp() * (target - logprobs)).sum(-1)
        overlap = torch.minimum(target.exp(), logprobs.exp()).sum(-1)
    else:  # one-hot at the label
        kl, overlap = torch.zeros_like(ce), (-ce).exp()
    loss = ce if soft_weight == 0 else (1 - soft_weight) * ce + soft_weight * kl
    return loss, 1 - overlap, overlap.detach(), logprobs.detach().argmax(-1)


def dspark_objective(inputs: HeadInputs, *, markov_weight: float, tv_weight: float, confidence_weight: float,
                     soft_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the weighted loss, the biased logits' loss before its weight (detached), the choice [N])."""
    d = inputs.drafter
    states, labels = inputs.states, inputs.labels
    embedding = d.markov_head.embed(inputs.predecessors)
    soft = inputs.soft_labels
    args = [soft.get("soft_ids"), soft.get("soft_logprobs"), soft.get("soft_hidden")]
    rows = chunk_rows(d.lm_head_weight.shape[0], CHUNK_MIB)
    parts = []
    for start in range(0, states.shape[0], rows):  # one chunk's logits at a time, recomputed in the backward
        cut = slice(start, start + rows)
        chunk = [states[cut], embedding[cut], labels[cut], *(a[cut] if a is not None else None for a in args)]
        if states.shape[0] > rows and torch.is_grad_enabled():
            parts.append(checkpoint(_slot_terms, d, *chunk, soft_weight, use_reentrant=False))
        else:
            parts.append(_slot_terms(d, *chunk, soft_weight))
    loss, tv, accept, choice = (torch.cat(t) for t in zip(*parts))
    weights = inputs.weights.detach()
    total = weights.sum().clamp(min=1e-12)
    markov = (weights * loss).sum() / total
    out = markov_weight * markov
    if tv_weight:
        out = out + tv_weight * (weights * tv).sum() / total
    if getattr(d, "confidence_head", None) is not None and confidence_weight:
        with_markov = d.config.confidence_head_with_markov
        logit = d.confidence_head(states.detach(), embedding.detach() if with_markov else None).float()
        bce = F.binary_cross_entropy_with_logits(logit, accept, reduction="none")
        out = out + confidence_weight * (weights * bce).sum() / total
    return out, markov.detach(), choice


class MarkovWalk:
    """DSpark's drafts from a block's states: from the anchor, each slot's logits plus the bias of
    the token before it, greedy at T = 0, sampled at T > 0; with a confidence head, each draft's
    predicted acceptance probability beside it (its previous token's embedding as the engines
    feed it: the anchor's for slot 1, then the drafts')."""

    def __init__(self, drafter: Any, temperature: float, seed: int) -> None:
        self.drafter, self.temperature = drafter, temperature
        self.generator: torch.Generator | None = None
        if temperature > 0:
            device = drafter.embed_weight.device
            self.generator = torch.Generator(device=device).manual_seed(seed + 1)  # not the target's draws

    def __call__(self, states: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        d = self.drafter
        base = d.logits(states).float()  # [B, L, V]
        previous, drafts, embeddings = anchors, [], []
        for slot in range(states.shape[1]):
            embedding = d.markov_head.embed(previous)
            logits = base[:, slot] + d.markov_head.bias(embedding).float()
            if self.temperature == 0:
                previous = logits.argmax(-1)
            else:
                q = torch.softmax(logits / self.temperature, dim=-1)
                previous = torch.multinomial(q, 1, generator=self.generator).squeeze(-1)
            drafts.append(previous)
            embeddings.append(embedding)
        drafts = torch.stack(drafts, dim=1)
        if getattr(d, "confidence_head", None) is None:
            return drafts
        embedding = torch.stack(embeddings, dim=1) if d.config.confidence_head_with_markov else None
        return drafts, torch.sigmoid(d.confidence_head(states, embedding).float())
