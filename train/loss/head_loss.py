"""The slots' losses under the frozen target head, over chunks of rows.

The plain path of the objective holds the logits of every scored block slot at once: N slots x V
ids in bf16, their float32 copy and log-softmax, and as much again in the backward. N is the
micro-batch's anchors x (block size - 1): a token budget of 16K tokens of short samples holds
10K anchors, 150K slots, and at a vocabulary of 152K ids that is over 200 GiB. `slot_losses`
runs the head over chunks of rows instead and keeps one chunk's logits at a time.

The head is frozen, so the only gradient is the one of the drafter's states h. The gradient of
a slot's loss with respect to h_i ((softmax_i - onehot(label_i)) @ W for the cross-entropy, and
(softmax_i - p_i) @ W for the KL to soft labels p_i) depends on row i alone: it is computed chunk
by chunk in the forward, where the chunk's softmax is at hand, and the backward only scales it
by the incoming gradient (the slot's loss weight). The head's matmuls are the two of the plain
path (the logits, and the softmax against W); nothing is recomputed.

DFlash2's selector reads the top-K ids of each row (taken chunk by chunk too) and the logits of
its K + 1 candidates, which `candidate_logits` computes from the candidates' rows of W alone. On
the plain path `log_softmax_with_candidates` gives the log-probs and the candidates' logits from
one node, whose backward adds the candidates' gradient into the log-softmax's.
"""

from __future__ import annotations

import torch
from dflash.train.heads.dflash2.modules import exact_topk

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


class _SlotLosses(torch.autograd.Function):
    """Per scored slot, chunk by chunk: the loss (1 - w) * -log q(label) + w * KL(p || q)
    [N] (differentiable in h; w = `soft_weight`, p the soft labels), and, detached, log q(label)
    [N], the KL [N] (empty without soft labels), the argmax [N] and the top-k ids [N, k]."""

    @staticmethod
    def forward(ctx, h, label, head, rows_per_chunk, top_k, soft_weight, soft_ids, soft_logprobs,
                soft_hidden):  # noqa: D102 - see the class
        n, device = h.shape[0], h.device
        loss = torch.empty(n, dtype=torch.float32, device=device)
        logprob = torch.empty(n, dtype=torch.float32, device=device)
        kl = torch.empty(n if soft_weight else 0, dtype=torch.float32, device=device)
        argmax = torch.empty(n, dtype=torch.long, device=device)
        top = torch.empty((n, top_k), dtype=torch.long, device=device)
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        weight = head.lm_head_weight
        for start in range(0, n, rows_per_chunk):
            end = min(n, start + rows_per_chunk)
            logits = head.logits(h[start:end])  # bf16 under autocast, as on the plain path
            dtype = logits.dtype
            if top_k:  # over the head's own dtype: its float32 copy orders the same, at twice the bytes
                top[start:end] = exact_topk(logits, top_k)[1]
            logits = logits.float()
            lse = torch.logsumexp(logits, dim=-1)
            t = label[start:end]
            logprob[start:end] = logits.gather(1, t[:, None]).squeeze(1) - lse
            argmax[start:end] = logits.argmax(-1)
            row_loss = -logprob[start:end]
            logq = logits.sub_(lse[:, None])  # log q, in place of the logits
            if soft_weight:
                if soft_hidden is not None:  # p over the whole vocabulary, from the target's own head
                    p_log = torch.log_softmax(head.target_logits(soft_hidden[start:end]).float(), dim=-1)
                    p = p_log.exp()
                    kl[start:end] = (p * (p_log - logq)).sum(-1)
                    del p_log
                else:  # p over the cached top-k ids (renormalized)
                    ids, p_log = soft_ids[start:end], soft_logprobs[start:end]
                    p = p_log.exp()
                    kl[start:end] = (p * (p_log - logq.gather(1, ids))).sum(-1)
                row_loss = (1 - soft_weight) * row_loss + soft_weight * kl[start:end]
            q = logq.exp_()  # the drafter's softmax, in place again
            # d loss / d logits, built in q's place: (1 - w)(q - onehot(t)) + w (q sum(p) - p)
            if soft_weight and soft_hidden is not None:
                q.sub_(p, alpha=soft_weight)  # sum(p) = 1
                del p
            elif soft_weight:
                q.mul_(1.0 - soft_weight + soft_weight * p.sum(-1, keepdim=True))
                q.scatter_add_(1, ids, -soft_weight * p)
            onehot = -(1.0 - soft_weight)
            loss[start:end] = row_loss
            if grad is not None:
                q.scatter_add_(1, t[:, None], torch.full_like(q[:, :1], onehot))
                grad[start:end] = (q.to(dtype) @ weight.to(dtype)).to(grad.dtype)
            del logits, logq, q
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(logprob, kl, argmax, top)
        return loss, logprob, kl, argmax, top

    @staticmethod
    def backward(ctx, grad_loss, *_):  # noqa: D102
        (grad,) = ctx.saved_tensors
        none = (None,) * 8
        if grad is None:
            return (None, *none)
        return (grad * grad_loss[:, None].to(grad.dtype), *none)


class _LogSoftmaxWithCandidates(torch.autograd.Function):
    """(logits [N, V], ids [N, M]) -> (log_softmax(logits.float()) [N, V], logits.gather(-1, ids)
    [N, M]): the plain path's log-probs and DFlash2's candidate logits from one node, so that the
    candidates' gradient is added into the log-softmax's [N, V] gradient in place. Apart, autograd
    builds a second dense [N, V] (the gather's backward: zeros and a scatter) and adds the two; here
    the same sum is formed, rounded as autograd rounds it: the log-softmax's gradient cast to the
    logits' dtype, then each candidate's gradient added (the selector's loss leaves its one
    duplicate, a label already among the top-K, a gradient of exactly 0)."""

    @staticmethod
    def forward(ctx, logits, ids):  # noqa: D102 - see the class
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        ctx.save_for_backward(logprobs, ids)
        ctx.dtype = logits.dtype
        ctx.set_materialize_grads(False)
        return logprobs, logits.gather(-1, ids)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_picked):  # noqa: D102
        logprobs, ids = ctx.saved_tensors
        if grad_logprobs is not None:  # what LogSoftmaxBackward0 and the .float()'s backward compute
            grad = torch._log_softmax_backward_data(grad_logprobs, logprobs, -1, logprobs.dtype).to(ctx.dtype)
        else:
            grad = torch.zeros(logprobs.shape, dtype=ctx.dtype, device=logprobs.device)
        if grad_picked is not None:
            grad.scatter_add_(-1, ids, grad_picked.to(ctx.dtype))
        return grad, None


def log_softmax_with_candidates(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(logits.float()) [N, V], logits.gather(-1, ids) [N, M]) with the values and the
    gradient of computing them apart, in one [N, V] gradient instead of two (`ids` holding no
    repeated id whose gradients both differ from 0)."""
    return _LogSoftmaxWithCandidates.apply(logits, ids)


class _CandidateLogits(torch.autograd.Function):
    """(h [N, D], ids [N, M]) -> the head's logits of those ids [N, M], from their rows of W, chunk
    by chunk (the rows gathered for a chunk are dropped after it, and gathered again in the backward)."""

    @staticmethod
    def forward(ctx, h, ids, head, rows_per_chunk):  # noqa: D102
        weight = head.lm_head_weight
        dtype = head.logits(h[:1]).dtype  # the plain path's logits dtype (bf16 under autocast)
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
                soft_logprobs: torch.Tensor | None = None, soft_hidden: torch.Tensor | None = None):
    """(loss [N], log q(label) [N], KL [N], argmax [N], top-k ids [N, k]) of the head's softmax q
    over h_i, holding at most `rows_per_chunk` rows of logits at a time: the loss (1 - w) *
    -log q(label) + w * KL(p || q) is differentiable in h, the rest detached. Soft labels p (with
    w > 0): `soft_ids` / `soft_logprobs` [N, k] (the target's top-k, renormalized), or
    `soft_hidden` [N, D] (the target's last hidden state, through `head.target_logits`). `head`
    has `logits(h)` and the frozen `lm_head_weight` (the drafter)."""
    _frozen(head)
    if soft_weight and soft_hidden is None and (soft_ids is None or soft_logprobs is None):
        raise ValueError("soft labels need soft_hidden or soft_ids with soft_logprobs")
    return _SlotLosses.apply(h, label, head, rows_per_chunk, top_k, float(soft_weight), soft_ids,
                             soft_logprobs, soft_hidden)


def candidate_logits(head, h: torch.Tensor, ids: torch.Tensor, rows_per_chunk: int) -> torch.Tensor:
    """The head's logits of `ids` [N, M] at h [N, D] (as `head.logits(h).gather(-1, ids)`),
    differentiable in h, without the [N, V] logits."""
    _frozen(head)
    return _CandidateLogits.apply(h, ids, head, rows_per_chunk)
