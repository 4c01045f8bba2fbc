"""The label log-probabilities of the frozen target head, over chunks of rows.

The plain path of the objective holds the logits of every scored block slot at once: N slots x V
ids in bf16, their float32 copy and log-softmax, and as much again in the backward. N is the
micro-batch's anchors x (block size - 1): a token budget of 16K tokens of short samples holds
10K anchors, 150K slots, and at a vocabulary of 152K ids that is over 200 GiB. `label_logprobs`
runs the head over chunks of rows instead and keeps one chunk's logits at a time.

The head is frozen, so the only gradient is the one of the drafter's states h. The gradient of
log p(label_i) with respect to h_i is W[label_i] - softmax_i @ W, which depends on row i alone:
it is computed chunk by chunk in the forward, where the chunk's softmax is at hand, and the
backward only scales it by the incoming gradient. The head's matmuls are the two of the plain
path (the logits, and the softmax against W); nothing is recomputed.
"""

from __future__ import annotations

import torch

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


class _LabelLogprobs(torch.autograd.Function):
    """(h [N, D], label [N]) -> (log p(label) [N] float32, argmax [N] long), chunk by chunk."""

    @staticmethod
    def forward(ctx, h, label, head, rows_per_chunk):  # noqa: D102 - see the class
        n = h.shape[0]
        logprob = torch.empty(n, dtype=torch.float32, device=h.device)
        argmax = torch.empty(n, dtype=torch.long, device=h.device)
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        weight = head.lm_head_weight
        for start in range(0, n, rows_per_chunk):
            end = min(n, start + rows_per_chunk)
            logits = head.logits(h[start:end])  # bf16 under autocast, as on the plain path
            dtype = logits.dtype
            logits = logits.float()
            lse = torch.logsumexp(logits, dim=-1)
            t = label[start:end]
            logprob[start:end] = logits.gather(1, t[:, None]).squeeze(1) - lse
            argmax[start:end] = logits.argmax(-1)
            if grad is not None:
                # d log p(t) / d logits = onehot(t) - softmax; times W: the gradient of h.
                p = logits.sub_(lse[:, None]).exp_()
                p.scatter_add_(1, t[:, None], torch.full_like(p[:, :1], -1.0))
                grad[start:end] = -(p.to(dtype) @ weight.to(dtype)).to(grad.dtype)
            del logits
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(argmax)
        return logprob, argmax

    @staticmethod
    def backward(ctx, grad_logprob, _grad_argmax):  # noqa: D102
        (grad,) = ctx.saved_tensors
        if grad is None:
            return None, None, None, None
        return grad * grad_logprob[:, None].to(grad.dtype), None, None, None


def label_logprobs(head, h: torch.Tensor, label: torch.Tensor, rows_per_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label_i) of the head's softmax over h_i (differentiable in h) and the head's argmax
    per row, holding at most `rows_per_chunk` rows of logits at a time. `head` has `logits(h)`
    and the frozen `lm_head_weight` (the drafter)."""
    if head.lm_head_weight.requires_grad:
        raise ValueError("label_logprobs needs a frozen head: its weight gets no gradient here.")
    return _LabelLogprobs.apply(h, label, head, rows_per_chunk)
