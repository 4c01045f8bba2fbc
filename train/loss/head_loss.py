"""The slots' losses under the frozen target head, over chunks of rows.

Every scored block slot's loss goes through `slot_losses`. A micro-batch scores N slots x V ids
of logits: N is its anchors x (block size - 1), and a token budget of 16K tokens of short
samples holds 10K anchors, 150K slots, which at a vocabulary of 152K ids is 90 GiB of float32
logits. `slot_losses` runs the head over chunks of rows and keeps one chunk's logits at a time:
one chunk while the micro-batch's fit --logits-chunk-mib, chunks of CHUNK_MIB past it.

The head is frozen, so the only gradient is the one of the drafter's states h. The gradient of
a slot's loss with respect to h_i ((softmax_i - onehot(label_i)) @ W for the cross-entropy, and
(softmax_i - p_i) @ W for the KL to soft labels p_i) depends on row i alone: it is computed chunk
by chunk in the forward, where the chunk's softmax is at hand, and the backward only scales it
by the incoming gradient (the slot's loss weight). The head's two matmuls are those autograd
would run (the logits, and their gradient against W); nothing is recomputed, and a chunk holds
one float32 copy of its logits, turned in place into the shifted logits, their exponentials, the
softmax and the gradient.

DFlash2's selector reads the top-K ids of each row (taken chunk by chunk too) and the logits of
its K + 1 candidates, which `candidate_logits` computes from the candidates' rows of W alone.
"""

from __future__ import annotations

import torch
from dflash.train.heads.dflash2.modules import exact_topk, segment_maxima, topk_segment
from dflash.train.loss.compiled import compiled_over_rows

_F32 = 4  # bytes of one float32 logit
CHUNK_MIB = 1024
"""The chunk of float32 logits once a micro-batch's are too many at once (measured at the 8B shape:
4.6 % slower a step than all at once there, for 9.7 GiB less memory)."""


def chunk_rows(vocab: int, chunk_mib: int) -> int:
    """Rows of float32 logits that fit in `chunk_mib` MiB (at least one)."""
    return max(1, (chunk_mib << 20) // (_F32 * max(1, vocab)))


def needs_chunks(rows: int, vocab: int, limit_mib: int) -> bool:
    """Whether `rows` x `vocab` float32 logits exceed `limit_mib` MiB (0: no limit)."""
    return limit_mib > 0 and rows > chunk_rows(vocab, limit_mib)


def logits_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype of the head's logits at h: autocast's where it is on (bf16), else h's."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


def _chunk_terms(logits, t, w, ids, p_log, want_grad, head, soft_hidden):
    """One chunk's (loss, log q(label), KL or None, argmax, d loss / d logits in the logits' dtype
    or None), eagerly: one float32 copy of the logits, turned in place into the shifted logits,
    their exponentials, the softmax and the gradient."""
    dtype = logits.dtype
    peak, argmax = logits.max(-1)  # the first of the largest, as argmax
    x = logits.float()  # the chunk's one float32 copy (the logits themselves without autocast)
    del logits
    x.sub_(peak.to(x.dtype)[:, None])  # shifted: the largest at 0
    at_label = x.gather(1, t[:, None]).squeeze(1)
    kl = p = None
    if w and soft_hidden is None:  # p over the cached top-k ids (renormalized)
        p, at_ids = p_log.exp(), x.gather(1, ids)
    elif w:  # p over the whole vocabulary, from the target's own head: sum p (log p - x) now
        p_log = torch.log_softmax(head.target_logits(soft_hidden).float(), dim=-1)
        p = p_log.exp()
        p_gap = (p * p_log.sub_(x)).sum(-1)
        del p_log
    e = x.exp_()  # exp of the shifted logits, in place
    total = e.sum(-1)
    lse = total.log()  # log q = x - lse
    logprob = at_label - lse
    loss = -logprob
    if w:  # KL(p || q) = sum p (log p - x) + lse sum p
        if soft_hidden is None:
            kl = (p * (p_log - at_ids + lse[:, None])).sum(-1)
        else:
            kl = p_gap + lse * p.sum(-1)
        loss = (1 - w) * loss + w * kl
    grad = None
    if want_grad:
        # d loss / d logits in e's place: (1 - w)(q - onehot(t)) + w (q sum(p) - p), q = e / total
        scale = 1.0 / total if not w or soft_hidden is not None else (1 - w + w * p.sum(-1)) / total
        q = e.mul_(scale[:, None])
        if w and soft_hidden is not None:
            q.sub_(p, alpha=w)  # sum(p) = 1
        elif w:
            q.scatter_add_(1, ids, -w * p)
        if w < 1:
            q.scatter_add_(1, t[:, None], torch.full_like(q[:, :1], w - 1))
        grad = q.to(dtype)
    return loss, logprob, kl, argmax, grad


def fused_chunk_terms(logits, t, w, ids, p_log, want_grad, segment=0):
    """`_chunk_terms` without the float32 copy, for torch.compile to fuse into a few passes over
    the logits in their own dtype (soft labels from the cached top-k only): the row's max and
    argmax, its sum of exponentials, and one pass that writes the gradient. Eagerly it allocates
    float32 temporaries of the chunk; it is meant to run compiled (`compiled_chunk_terms`). With a
    `segment` width it returns the rows' segment maxima last (for `exact_topk`), else None."""
    maxima = segment_maxima(logits, segment) if segment else None
    peak, argmax = logits.max(-1)
    x = logits.float() - peak.float()[:, None]
    lse = x.exp().sum(-1).log()
    logprob = x.gather(1, t[:, None]).squeeze(1) - lse
    loss, kl = -logprob, None
    if w:
        p = p_log.exp()
        kl = (p * (p_log - x.gather(1, ids) + lse[:, None])).sum(-1)
        loss = (1 - w) * loss + w * kl
    if not want_grad:
        return loss, logprob, kl, argmax, None, maxima
    q = (x - lse[:, None]).exp()
    vocab = torch.arange(x.shape[1], device=x.device)[None, :]
    if w:  # (1 - w)(q - onehot(t)) + w (q sum(p) - p): the k soft ids' terms as compares, no scatter
        q = q * (1 - w + w * p.sum(-1))[:, None]
        for j in range(ids.shape[1]):
            q = q - torch.where(vocab == ids[:, j:j + 1], w * p[:, j:j + 1], 0.0)
    if w < 1:
        q = q + torch.where(vocab == t[:, None], w - 1.0, 0.0)
    return loss, logprob, kl, argmax, q.to(logits.dtype), maxima


COMPILED_KERNELS = True
"""Whether a compiled drafter on CUDA runs the head's loss through compiled kernels (each chunk
through `compiled_chunk_terms`, DFlash2's candidates through its gather-reductions); bench_train.py
and profile_step.py `--head-kernels eager` turn it off to time both side by side."""


def use_compiled(drafter, h: torch.Tensor) -> bool:
    """Whether this step's head loss runs compiled kernels: a compiled drafter on CUDA (on the CPU
    inductor's kernels are no faster than the eager path)."""
    return COMPILED_KERNELS and drafter.compiled_loss and h.is_cuda


def compiled_chunk_terms():
    """`fused_chunk_terms` under torch.compile, made once: the chunk's row count symbolic from the
    first call (the slots of a step vary), the vocabulary static."""
    return compiled_over_rows(fused_chunk_terms)


class _SlotLosses(torch.autograd.Function):
    """Per scored slot, chunk by chunk: the loss (1 - w) * -log q(label) + w * KL(p || q)
    [N] (differentiable in h; w = `soft_weight`, p the soft labels), and, detached, log q(label)
    [N], the KL [N] (empty without soft labels), the argmax [N] and the top-k ids [N, k]."""

    @staticmethod
    def forward(ctx, h, label, head, rows_per_chunk, top_k, soft_weight, soft_ids, soft_logprobs,
                soft_hidden, fused):  # noqa: D102 - see the class
        n, device, w = h.shape[0], h.device, soft_weight
        loss = torch.empty(n, dtype=torch.float32, device=device)
        logprob = torch.empty(n, dtype=torch.float32, device=device)
        kl = torch.empty(n if w else 0, dtype=torch.float32, device=device)
        argmax = torch.empty(n, dtype=torch.long, device=device)
        top = torch.empty((n, top_k), dtype=torch.long, device=device)
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        weight = head.lm_head_weight
        fused = fused and soft_hidden is None
        segment = topk_segment(weight.shape[0], top_k, maxima_given=fused) if top_k else 0
        for start in range(0, n, rows_per_chunk):
            rows = slice(start, min(n, start + rows_per_chunk))
            chunk = [head.logits(h[rows])]  # bf16 under autocast; held here only until _chunk_terms takes it
            ids = soft_ids[rows] if w and soft_hidden is None else None
            p_log = soft_logprobs[rows] if w and soft_hidden is None else None
            maxima = None
            if fused:  # the top-k's segment maxima from the same compiled function
                *terms, maxima = compiled_chunk_terms()(chunk[0], label[rows], w, ids, p_log, grad is not None, segment)
            if top_k:  # over the head's own dtype: its float32 copy orders the same, at twice the bytes
                top[rows] = exact_topk(chunk[0], top_k, segment, maxima)[1]
            if not fused:  # the logits handed over: freed once their float32 copy exists
                terms = _chunk_terms(chunk.pop(), label[rows], w, ids, p_log, grad is not None, head,
                                     None if soft_hidden is None else soft_hidden[rows])
            del chunk, maxima  # before the next chunk's
            loss[rows], logprob[rows], row_kl, argmax[rows], g = terms
            if w:
                kl[rows] = row_kl
            if g is not None:
                grad[rows] = (g @ weight.to(g.dtype)).to(grad.dtype)
            del terms, g
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(logprob, kl, argmax, top)
        return loss, logprob, kl, argmax, top

    @staticmethod
    def backward(ctx, grad_loss, *_):  # noqa: D102
        (grad,) = ctx.saved_tensors
        none = (None,) * 9
        if grad is None:
            return (None, *none)
        return (grad * grad_loss[:, None].to(grad.dtype), *none)


class _CandidateLogits(torch.autograd.Function):
    """(h [N, D], ids [N, M]) -> the head's logits of those ids [N, M], from their rows of W, chunk
    by chunk (the rows gathered for a chunk are dropped after it, and gathered again in the backward)."""

    @staticmethod
    def forward(ctx, h, ids, head, rows_per_chunk):  # noqa: D102
        weight = head.lm_head_weight
        dtype = logits_dtype(h)  # the dtype of the head's logits (bf16 under autocast)
        out = torch.empty(ids.shape, dtype=dtype, device=h.device)
        for start in range(0, h.shape[0], rows_per_chunk):
            end = min(h.shape[0], start + rows_per_chunk)
            rows = weight[ids[start:end]].to(dtype)  # [n, M, D]
            out[start:end] = torch.bmm(rows, h[start:end].to(dtype)[:, :, None]).squeeze(-1)
        ctx.save_for_backward(ids)
        ctx.head, ctx.rows, ctx.h_dtype = head, rows_per_chunk, h.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (ids,) = ctx.saved_tensors
        weight = ctx.head.lm_head_weight
        grad = torch.empty((ids.shape[0], weight.shape[1]), dtype=ctx.h_dtype, device=ids.device)
        for start in range(0, ids.shape[0], ctx.rows):
            end = min(ids.shape[0], start + ctx.rows)
            rows = weight[ids[start:end]].to(grad_out.dtype)  # [n, M, D]
            grad[start:end] = torch.bmm(grad_out[start:end, None, :], rows).squeeze(1).to(grad.dtype)
        return grad, None, None, None


def _frozen(head) -> None:
    if head.lm_head_weight.requires_grad:
        raise ValueError("the chunked head needs a frozen head: its weight gets no gradient here.")


def slot_losses(head, h: torch.Tensor, label: torch.Tensor, rows_per_chunk: int, *, top_k: int = 0,
                soft_weight: float = 0.0, soft_ids: torch.Tensor | None = None,
                soft_logprobs: torch.Tensor | None = None, soft_hidden: torch.Tensor | None = None,
                fused: bool = False):
    """(loss [N], log q(label) [N], KL [N], argmax [N], top-k ids [N, k]) of the head's softmax q
    over h_i, holding at most `rows_per_chunk` rows of logits at a time: the loss (1 - w) *
    -log q(label) + w * KL(p || q) is differentiable in h, the rest detached. Soft labels p (with
    w > 0): `soft_ids` / `soft_logprobs` [N, k] (the target's top-k, renormalized), or
    `soft_hidden` [N, D] (the target's last hidden state, through `head.target_logits`). `head`
    has `logits(h)` and the frozen `lm_head_weight` (the drafter). `fused`: each chunk's softmax,
    loss and gradient through `compiled_chunk_terms` (a compiled drafter on CUDA; soft labels from
    the cached top-k or none)."""
    _frozen(head)
    if soft_weight and soft_hidden is None and (soft_ids is None or soft_logprobs is None):
        raise ValueError("soft labels need soft_hidden or soft_ids with soft_logprobs")
    return _SlotLosses.apply(h, label, head, rows_per_chunk, top_k, float(soft_weight), soft_ids,
                             soft_logprobs, soft_hidden, bool(fused))


def candidate_logits(head, h: torch.Tensor, ids: torch.Tensor, rows_per_chunk: int) -> torch.Tensor:
    """The head's logits of `ids` [N, M] at h [N, D] (as `head.logits(h).gather(-1, ids)`),
    differentiable in h, without the [N, V] logits."""
    _frozen(head)
    return _CandidateLogits.apply(h, ids, head, rows_per_chunk)
