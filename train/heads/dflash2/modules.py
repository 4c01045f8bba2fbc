"""DFlash2: the DFlash drafter plus an in-block dynamic convolution and a candidate selector.

Both parts are declared by the checkpoint (`architectures: ["DFlash2DraftModel"]`) and read by
vLLM (`qwen3_dflash2.py` and its DFlash2 speculator) and SGLang (`srt/models/dflash.py`); the
parameter names, shapes and arithmetic here are theirs (docs/drafter.md, "DFlash2").

- `GroupedDynamicConv`, one around each attention and each MLP sublayer of every draft layer:
  `out[i, c] = sum_t (base[t, c] + delta[i, t, g(c)]) * x[i - t, c]` over taps t < taps, where
  `i - t` must lie in the same block (the taps are zero across a block boundary) and g(c) is the
  channel's group of `group_size` channels. One linear projection of the sublayer's (normed)
  input gives `delta` for both convolutions: the one on the sublayer's input and the one on its
  output. Initialised to the identity (tap 0 = 1, every other tap and the projection 0), so a
  fresh DFlash2 drafter computes exactly what DFlash does with the same weights.
- `CandidateSelector`: per drafted slot the top-K tokens of the target head's logits (after the
  target's `output_multiplier` and optional `final_logit_softcapping`: the "unary" score of a
  candidate is that transformed logit), and a low-rank transition score
  `edge(p -> c) = <A[p] * proj(h), B[c]> + unary[c]` from a predecessor codebook A and a
  successor codebook B over the vocabulary, h being the slot's drafter state. Decoding walks
  from the verified anchor, as both engines do: at T = 0 each slot takes the best successor of
  the token chosen before it; at T > 0 it samples from softmax(edge / T) over the K candidates,
  and that row is q, the draft distribution the verification sees.
- Training adds `alpha * selector_loss`: a K-way cross-entropy over the candidates of each scored
  slot, its predecessor the true previous token (what the walk has chosen when every earlier
  slot was right), the true token put in place of the K-th candidate when the top-K misses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupedDynamicConv(nn.Module):
    """The pair of in-block convolutions around one sublayer (`attention_conv` or `mlp_conv`).

    `base_kernel` [2, taps, D]: the static per-channel taps of the input (0) and output (1)
    convolution; `kernel_projection` [2*taps*G, D]: the per-token, per-group tap offsets of both,
    from the sublayer's input (G = D / group_size groups).
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        if taps < 1 or group_size < 1 or hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size {hidden_size}, and "
                             f"conv_kernel_size ({taps}) be at least 1.")
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """The identity: tap 0 of both convolutions 1, the rest and the projection 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input convolution of `x` [B, Q, D], the output convolution's offsets [B, Q, taps, G])."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return self._convolve(x, delta[..., 0, :, :], 0, block_size), delta[..., 1, :, :]

    def finish(self, x: torch.Tensor, delta: torch.Tensor, block_size: int) -> torch.Tensor:
        """The output convolution of the sublayer's output `x` with the offsets from `prepare`."""
        return self._convolve(x, delta, 1, block_size)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int, block_size: int) -> torch.Tensor:
        # x [B, Q, D] holds whole blocks laid end to end: token i is slot i % block_size of its block.
        # Computed in the projection's dtype (bf16 under autocast, as the engines run it; float32
        # when training in float32): a float32 base kernel would make every product a float32
        # copy of the activations, each kept for the backward.
        dtype = delta.dtype
        grouped = x.to(dtype).unflatten(-1, (self.groups, self.group_size))  # [B, Q, G, gs]
        base = self.base_kernel[side].to(dtype).view(self.taps, self.groups, self.group_size)
        return _InBlockConv.apply(grouped, delta, base, block_size).flatten(-2)


def _in_block(length: int, t: int, block_size: int, device: torch.device) -> torch.Tensor:
    """[1, length - t, 1, 1]: whether token i (from t on) and token i - t lie in the same block."""
    return (torch.arange(t, length, device=device) % block_size >= t).view(1, length - t, 1, 1)


def _pad_tokens(x: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """`x` [B, n, ...] with `before` and `after` zero tokens around its n (dim 1)."""
    return F.pad(x, (0, 0) * (x.dim() - 2) + (before, after))


class _InBlockConv(torch.autograd.Function):
    """`out[i] = sum_t (base[t] + delta[i, t, g]) * x[i - t]` within a block (GroupedDynamicConv's
    arithmetic) whose backward reads x itself: autograd through the plain expression keeps every
    shifted copy and product (32 bytes a block token, layer and channel in bf16,
    tests/test_train_memory.py), and a shifted copy made in the forward is one torch.compile keeps
    too; this keeps x (often kept anyway by the projection that reads it) and the offsets, and takes
    token i - t as a slice of x, which the compiled backward reads where it is. The same products
    and sums, so the same values, as the plain expression."""

    @staticmethod
    def forward(ctx, grouped, delta, base, block_size):  # noqa: D102 - see the class
        length = grouped.shape[1]
        out = (base[0] + delta[..., 0, :, None]) * grouped
        for t in range(1, min(base.shape[0], length)):
            weight = base[t] + delta[:, t:, t, :, None]
            out = out + _pad_tokens(weight * grouped[:, :-t] * _in_block(length, t, block_size, grouped.device), t, 0)
        ctx.save_for_backward(grouped, delta, base)
        ctx.block_size = block_size
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        grouped, delta, base = ctx.saved_tensors
        length, taps = grouped.shape[1], min(base.shape[0], grouped.shape[1])
        inside = [None] + [_in_block(length, t, ctx.block_size, grad.device) for t in range(1, taps)]
        grad_grouped = grad_delta = grad_base = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            # d out[i] / d (base[t] + delta[i, t]) = x[i - t] in its block, 0 elsewhere
            products = [grad * grouped] + [_pad_tokens(grad[:, t:] * (grouped[:, :-t] * inside[t]), t, 0)
                                           for t in range(1, taps)]
            grad_delta = torch.zeros_like(delta) if ctx.needs_input_grad[1] else None
            grad_base = torch.zeros_like(base) if ctx.needs_input_grad[2] else None
            for t, product in enumerate(products):
                if grad_delta is not None:
                    grad_delta[..., t, :] = product.sum(-1)
                if grad_base is not None:
                    grad_base[t] = product.sum((0, 1))
        if ctx.needs_input_grad[0]:
            grad_grouped = grad * (base[0] + delta[..., 0, :, None])
            for t in range(1, taps):  # token i's gradient reaches token i - t of its own block
                moved = grad[:, t:] * (base[t] + delta[:, t:, t, :, None]) * inside[t]
                grad_grouped = grad_grouped + _pad_tokens(moved, 0, t)
        return grad_grouped, grad_delta, grad_base, None


class CandidateSelector(nn.Module):
    """`candidate_selector`: predecessor/successor codebooks [V, rank], hidden_projection [rank, D]."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        if rank < 1 or not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_rank ({rank}) must be >= 1 and selector_top_k ({top_k}) in 1..{vocab_size}.")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random codebooks, a zero projection: every edge starts at 0, so the walk starts as the
        backbone's top-1, and the projection's gradient (A[p] * B[c]) is not zero."""
        with torch.no_grad():
            nn.init.normal_(self.predecessor_codebook, std=std)
            nn.init.normal_(self.successor_codebook, std=std)
            self.hidden_projection.weight.zero_()

    def forward(self, states: torch.Tensor, candidate_ids: torch.Tensor, unary: torch.Tensor,
                predecessor_ids: torch.Tensor) -> torch.Tensor:
        """Edge scores [..., P, C]: `states` [..., D], `candidate_ids` / `unary` [..., C] (the
        successors), `predecessor_ids` [..., P]."""
        h = self.hidden_projection(states)
        # The codebooks' rows in the projection's dtype (bf16 under autocast): the [..., C, r]
        # gather is the largest tensor of the selector. Through F.embedding, whose backward sums
        # the rows of a repeated token in parallel (the candidates of most slots are the same few
        # tokens; an indexing backward accumulates each token's repeats one after another).
        left = F.embedding(predecessor_ids, self.predecessor_codebook.to(h.dtype)) * h.unsqueeze(-2)  # [..., P, r]
        right = F.embedding(candidate_ids, self.successor_codebook.to(h.dtype))  # [..., C, r]
        return unary.unsqueeze(-2).float() + (left @ right.transpose(-1, -2)).float()


def transform_logits(logits: torch.Tensor, output_multiplier: float = 1.0,
                     softcap: float | None = None) -> torch.Tensor:
    """The candidates' unary scores: float32 logits times `output_multiplier`, then soft-capped."""
    values = logits.float()
    if output_multiplier != 1.0:
        values = values * output_multiplier
    if softcap:
        values = torch.tanh(values / softcap) * softcap
    return values


def topk_segment(vocab: int, k: int, maxima_given: bool = False) -> int:
    """The segment width of `exact_topk` over rows of `vocab` ids: 256 ids for a large vocabulary,
    128 below 64K (bench/bench_topk_train.py on an H100, top-16: at 151,936 ids widths of 256-512
    run in 0.22-0.32x torch.topk's time, 128 in 0.25-0.43x; at 8,192 ids 128 in 0.69-0.91x, where
    the sqrt(vocab / k) width of 16 was 1.5x slower than torch.topk). `maxima_given`: the width
    where the caller computes the segment maxima in a pass of its own (the compiled head loss),
    so that only the second stage is left: 128 ids, 64 below 64K (the same bench at cdba7f3, bf16:
    at 151,936 ids 0.57 ms against 0.84 at 256; at 8,192 ids 4.86 ms against 5.94 at 128). 0 where
    a row is too short for segments to pay (fewer than 4k of them): torch.topk over the whole row."""
    width = (128 if vocab >= 65536 else 64) if maxima_given else (256 if vocab >= 65536 else 128)
    return width if vocab // width >= 4 * k else 0


def segment_maxima(scores: torch.Tensor, segment: int) -> torch.Tensor:
    """[R, S]: the maximum of each whole segment of `segment` ids of the rows of `scores` [R, V]."""
    whole = scores.shape[-1] // segment * segment
    return scores[:, :whole].unflatten(-1, (-1, segment)).amax(-1)


def exact_topk(scores: torch.Tensor, k: int, segment: int | None = None,
               maxima: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [..., k] of the k largest of `scores` [..., V], best first: torch.topk's values
    exactly, in two stages where a row is long (a 151,936-id head's logits). The row is cut into
    segments of `segment` ids (default `topk_segment`; 0: torch.topk alone); the k largest lie in
    the k segments of the largest maxima (a value outside them has the k maxima of those
    segments at or above it) and the few ids past the last whole segment, so one max-reduction over
    the row and a top-k over those k * segment candidates replace torch.topk's passes over the whole
    row. Ids are torch.topk's where the values hold no tie at the k-th; among tied values another
    of the tied ids may be returned (torch.topk leaves that order unspecified too). `maxima`: the
    rows' `segment_maxima`, where the caller computed them with another pass over the row (2-D
    `scores` only)."""
    vocab = scores.shape[-1]
    segment = topk_segment(vocab, k) if segment is None else segment
    if not segment or vocab // segment <= k:
        return torch.topk(scores, k, dim=-1)
    lead, rows = scores.shape[:-1], scores.reshape(-1, vocab)
    whole = vocab // segment * segment
    segments = rows[:, :whole].unflatten(-1, (-1, segment))  # [R, S, segment], a view
    maxima = segment_maxima(rows, segment) if maxima is None else maxima
    best = torch.topk(maxima, k, dim=-1).indices.sort(-1).values  # [R, k], in id order
    picked = segments.gather(1, best[..., None].expand(-1, -1, segment)).flatten(1)  # [R, k * segment]
    if whole < vocab:  # the tail past the last whole segment: always a candidate
        picked = torch.cat([picked, rows[:, whole:]], dim=1)
    values, at = torch.topk(picked, k, dim=-1)
    inside = at < k * segment
    ids = torch.where(inside, best.gather(1, (at // segment).clamp(max=k - 1)) * segment + at % segment,
                      at - k * segment + whole)
    return values.view(*lead, k), ids.view(*lead, k)


def top_candidates(logits: torch.Tensor, top_k: int, output_multiplier: float = 1.0,
                   softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, unary scores) [..., K] of the K best tokens of `logits` [..., V], best first."""
    ids = torch.topk(logits.detach(), top_k, dim=-1).indices  # a gradient through topk is a dense [..., V]
    return ids, transform_logits(logits.gather(-1, ids), output_multiplier, softcap)


def block_lattice(selector: CandidateSelector, states: torch.Tensor, logits: torch.Tensor,
                  anchor_ids: torch.Tensor, output_multiplier: float = 1.0,
                  softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidate ids [B, L, K], edge scores [B, L, K, K]) of the L drafted slots of a block:
    `states` [B, L, D] and `logits` [B, L, V] of slots 1..L, `anchor_ids` [B]. Slot 0's
    predecessors are the anchor (K times), slot l's the candidates of slot l-1."""
    ids, unary = top_candidates(logits, selector.top_k, output_multiplier, softcap)
    first = anchor_ids[:, None, None].expand(-1, 1, ids.shape[-1])
    predecessors = torch.cat([first, ids[:, :-1]], dim=1)
    return ids, selector(states, ids, unary, predecessors)


def walk_greedy(candidate_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Tokens [B, L]: from the anchor, each slot's best successor of the previous choice."""
    batch, slots, k = candidate_ids.shape
    rows = torch.arange(batch, device=candidate_ids.device)
    previous = torch.zeros(batch, dtype=torch.long, device=candidate_ids.device)
    tokens = []
    for slot in range(slots):
        previous = scores[rows, slot, previous].argmax(-1)
        tokens.append(candidate_ids[rows, slot, previous])
    return torch.stack(tokens, dim=1)


def walk_sampled(candidate_ids: torch.Tensor, scores: torch.Tensor, temperature: float,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, L], q [B, L, K]): each slot sampled from softmax(edge / T) over the successors
    of the previous choice; q is that distribution, over `candidate_ids` (0 for every other token)."""
    if temperature <= 0:
        raise ValueError(f"a sampled walk needs a temperature > 0, got {temperature}; use walk_greedy.")
    batch, slots, k = candidate_ids.shape
    rows = torch.arange(batch, device=candidate_ids.device)
    previous = torch.zeros(batch, dtype=torch.long, device=candidate_ids.device)
    tokens, qs = [], []
    for slot in range(slots):
        q = torch.softmax(scores[rows, slot, previous] / temperature, dim=-1)
        previous = torch.multinomial(q, 1, generator=generator).squeeze(-1)
        tokens.append(candidate_ids[rows, slot, previous])
        qs.append(q)
    return torch.stack(tokens, dim=1), torch.stack(qs, dim=1)


def _fused_scores(selector: CandidateSelector, states: torch.Tensor, head_weight: torch.Tensor,
                  candidates: torch.Tensor, predecessor_ids: torch.Tensor, output_multiplier: float,
                  softcap: float | None) -> torch.Tensor:
    """`selector(states, candidates, transformed logits, predecessors)` [N, C] for one predecessor a
    slot, through kernels.gather_dot: the candidates' logits from their rows of the head, and the
    edges <A[p] * proj(h), B[c]> from the successor codebook's rows."""
    from dflash.train.heads.dflash2.kernels import gather_dot

    h = selector.hidden_projection(states)
    left = F.embedding(predecessor_ids, selector.predecessor_codebook.to(h.dtype)) * h  # [N, r]
    unary = transform_logits(gather_dot(states, head_weight, candidates), output_multiplier, softcap)
    return unary + gather_dot(left, selector.successor_codebook, candidates)


def selector_objective(selector: CandidateSelector, states: torch.Tensor, logits: torch.Tensor | None,
                       predecessor_ids: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, *,
                       output_multiplier: float = 1.0, softcap: float | None = None,
                       stop_gradient: bool = False, top_ids: torch.Tensor | None = None,
                       gather_logits=None, head_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted K-way cross-entropy, the selector's choice [N]) over N scored slots.

    `states` [N, D] and `logits` [N, V] of the slots, `predecessor_ids` [N] the true token before
    each (the anchor for slot 1), `labels` [N] the true tokens, `weights` [N] the slots' loss
    weights. When the top-K misses the label it takes the K-th candidate's place in the loss; the
    choice (for the metrics) is the walk's, over the plain top-K. `stop_gradient`: the selector's
    loss does not reach the backbone (its states and logits enter detached). Without `logits`
    (the objective's path, head_loss.py): `top_ids` [N, K] are the top-K and `gather_logits(states,
    candidates)` gives the logits of the top-K and the label (head_loss.candidate_logits).
    With `head_weight` (the head's [V, D] rows; the objective's path of a compiled drafter on CUDA)
    the candidates' logits and the edges are compiled gather-reductions (kernels.gather_dot) that
    never hold the [N, K+1, D] and [N, K+1, rank] gathered rows.
    """
    if stop_gradient:
        states, logits = states.detach(), None if logits is None else logits.detach()
    ids = exact_topk(logits.detach(), selector.top_k)[1] if logits is not None else top_ids
    k = ids.shape[-1]
    candidates = torch.cat([ids, labels[:, None]], dim=-1)
    # The K + 1 scores: from the candidates' rows of the head (the objective), or gathered from
    # given logits (whose backward is one dense [N, V]).
    if head_weight is not None and logits is None:
        scores = _fused_scores(selector, states, head_weight, candidates, predecessor_ids, output_multiplier, softcap)
    else:
        picked = logits.gather(-1, candidates) if logits is not None else gather_logits(states, candidates)
        scores_in = transform_logits(picked, output_multiplier, softcap)
        scores = selector(states, candidates, scores_in, predecessor_ids[:, None]).squeeze(-2)  # [N, K+1]
    found = ids == labels[:, None]
    present = found.any(-1)
    # The loss's K candidates: the top-K when it holds the label (the appended copy is left out),
    # else the top-(K-1) and the label.
    left_out = torch.where(present, k, k - 1)
    masked = scores.masked_fill(F.one_hot(left_out, k + 1).bool(), float("-inf"))
    target = torch.where(present, found.long().argmax(-1), k)
    nll = F.cross_entropy(masked, target, reduction="none")
    loss = (weights * nll).sum() / weights.sum().clamp(min=1e-12)
    choice = ids.gather(-1, scores[:, :k].argmax(-1, keepdim=True)).squeeze(-1)
    return loss, choice
